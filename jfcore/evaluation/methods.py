"""Decoding methods as timed callables, so evaluation and benchmarks measure them the same way.

A method takes token-id prompts and a token budget and returns a `Run`: the
new tokens per prompt and the split of the wall time into prefill and decode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from jfcore.decoding import DecodeConfig, decode
from jfcore.decoding.reference import hf_generate
from jfcore.decoding.runner.slots import device_sync


@dataclass
class Run:
    """One method on one batch: the new tokens per prompt and where the time went."""

    sequences: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    forward_seconds: float  # decode time inside model forwards
    decode_forwards: int  # per sequence: a batched forward counts once per row it serves

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


Method = Callable[[list[list[int]], int], Run]  # (prompt ids, max_new_tokens) -> Run


def project_method(model, eos: list[int], pad: int, **config) -> Method:
    """The project's decoder with `DecodeConfig(**config)` (method "ar", "jacobi" or "multiblock")."""

    def run(prompts: list[list[int]], max_new_tokens: int) -> Run:
        out = decode(
            model, prompts, DecodeConfig(max_new_tokens=max_new_tokens, **config), eos_token_id=eos, pad_token_id=pad
        )
        s = out.stats
        return Run(out.sequences, s.prefill_seconds, s.decode_seconds, s.forward_seconds, s.decode_forwards)

    return run


def hf_method(model, eos: list[int], pad: int, **generate_kwargs) -> Method:
    """HF `generate`, its forwards timed by hooks: the first model call is the prefill (for prompt lookup it
    also verifies the first draft); every later call is a decode forward."""
    sync = device_sync(next(model.parameters()).device)

    def run(prompts: list[list[int]], max_new_tokens: int) -> Run:
        starts: list[float] = []
        ends: list[float] = []

        def before(*_) -> None:  # hooks must return None, or they replace the inputs / outputs
            sync()
            starts.append(time.perf_counter())

        def after(*_) -> None:
            sync()
            ends.append(time.perf_counter())

        hooks = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
        start = time.perf_counter()
        try:
            sequences = hf_generate(model, prompts, max_new_tokens, eos, pad, **generate_kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        end = time.perf_counter()
        forward = sum(b - a for a, b in zip(starts[1:], ends[1:]))
        return Run(sequences, ends[0] - start, end - ends[0], forward, (len(ends) - 1) * len(prompts))

    return run
