"""Which tokens prompt lookup would copy: the decoder's lookup replayed over a known text.

Decoding with lookup gets a token the text already holds without the model's drafts, so training counts such
tokens apart (held-out noisy accuracy) and can leave them out of L_pc (TrainConfig.consistency_copies).
"""

from __future__ import annotations

from collections.abc import Sequence

from jfcore.decoding.candidates.lookup import PromptLookup

LOOKUP_NGRAM = 3  # the decoder's default longest match (DecodeConfig.lookup_ngram)


def lookup_candidates(prompt: Sequence[int], response: Sequence[int], max_ngram: int = LOOKUP_NGRAM) -> list[int]:
    """For each response token, the one-token candidate prompt lookup would propose in its place from the text
    before it (the prompt and the response so far), or -1 where no suffix of that text occurred earlier."""
    if not prompt:
        raise ValueError("lookup_candidates: the prompt must hold at least one token")
    lookup = PromptLookup(max_ngram, 1, prompt[:-1])
    candidates, last = [], prompt[-1]
    for token in response:
        candidates.append((lookup.propose(last, 1) or [-1])[0])
        lookup.extend([last])
        last = token
    return candidates
