"""The server's incremental detokenization: streamed pieces add up to the whole text, stop strings are cut
even when they span tokens, and nothing that could still become a stop string is sent early."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from jfcore.serving.engine import TextStream
from tests.support.tiny_models import save_tiny_checkpoint


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(save_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "ck"))


def stream(tokenizer, tokens: list[int], stop: list[str]) -> tuple[list[str], bool]:
    text = TextStream(tokenizer, stop)
    pieces = [text.update(tokens[:k], final=k == len(tokens)) for k in range(1, len(tokens) + 1)]
    return pieces, text.stopped


def test_pieces_add_up_to_the_whole_text(tokenizer):
    tokens = [10, 11, 12, 13, 14]
    pieces, stopped = stream(tokenizer, tokens, [])
    assert "".join(pieces) == tokenizer.decode(tokens) == "w7 w8 w9 w10 w11" and not stopped


def test_a_stop_string_spanning_tokens_is_cut_and_never_sent(tokenizer):
    tokens = [10, 11, 12, 13, 14]  # "w7 w8 w9 w10 w11"
    pieces, stopped = stream(tokenizer, tokens[:4], ["w9 w10"])
    assert stopped and "".join(pieces) == "w7 w8 "
    assert all("w9" not in p for p in pieces)  # "w9" was held back until it was known to start the stop string


def test_text_after_an_unmatched_stop_prefix_is_released(tokenizer):
    pieces, stopped = stream(tokenizer, [10, 11, 12, 14], ["w9 w10"])
    assert not stopped and "".join(pieces) == "w7 w8 w9 w11"
