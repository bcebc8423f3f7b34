"""The embedded default model: loads offline and decodes losslessly on real prompts."""

from __future__ import annotations

import os

import pytest
import torch

from jfcore.chat import encode_chat
from jfcore.decoding import DecodeConfig, decode
from jfcore.models import ModelConfig, load_model
from jfcore.paths import eval_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # a real model uses every core
    yield load_model(ModelConfig(name_or_path="smollm2-135m-instruct", dtype="float32"))
    torch.set_num_threads(threads)


def real_prompts(tokenizer) -> list[list[int]]:
    texts = [*eval_prompts("gsm8k", limit=2), *eval_prompts("humaneval", limit=1), *eval_prompts("mbpp", limit=1)]
    return [encode_chat(tokenizer, t) for t in texts]


def test_jacobi_and_multiblock_equal_generate(smollm2):
    model, tokenizer = smollm2
    prompts = real_prompts(tokenizer)
    max_new = 40
    expected = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False)
        expected.append(out[0, len(p) :].tolist())
    assert any(tokenizer.eos_token_id in e for e in expected) or all(len(e) == max_new for e in expected)
    for config in [
        DecodeConfig(method="jacobi", block_size=16, max_new_tokens=max_new),
        DecodeConfig(method="multiblock", block_size=16, max_new_tokens=max_new),
    ]:
        one_by_one = [decode(model, [p], config).sequences[0] for p in prompts[:2]]
        assert one_by_one == expected[:2], config.method
        assert decode(model, prompts, config).sequences == expected, config.method
    assert "egg" in tokenizer.decode(expected[0]).lower()  # it really read the question (Janet's ducks)
