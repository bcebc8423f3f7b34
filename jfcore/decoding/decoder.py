"""The decoder: one decode of a batch of prompts, and the one place that picks which rules run
(docs/DESIGN.md, "Which rules run").

    decode() -> Scheduler.add (prefill, rules.start) -> while rows: Scheduler.step
             -> rules.layout -> SlotBatch.forward -> rules.commit -> SlotBatch.keep_first

The rules are the C ones (jfcore/decoding/rules/native.py) where the C module was built at install, otherwise the
Python reference (rules/python.py); both leave every row exactly as the other would. The model side (compiled
forwards, CPU linear kernels, shared prompt prefixes) is the model runner's (jfcore/decoding/runner/).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Collection
from typing import Literal

import torch

from jfcore.decoding.config import DecodeConfig
from jfcore.decoding.result import DecodeOutput, DecodeStats, StepEvent
from jfcore.decoding.rules import native
from jfcore.decoding.rules.python import PythonRules
from jfcore.decoding.runner.model_runner import ModelRunner
from jfcore.decoding.scheduler import Scheduler

RulesChoice = Literal["auto", "native", "python"]


class Decoder:
    def __init__(
        self,
        model: torch.nn.Module,
        config: DecodeConfig,
        eos_token_ids: Collection[int],
        pad_token_id: int,
        on_step: Callable[[StepEvent], None] | None = None,
        rules: RulesChoice = "auto",
    ):
        """`rules`: "auto" (C where built, else Python), or one backend by name ("python": the reference, which the
        tests hold the C rules to)."""
        self.model = model
        self.config = config
        self.on_step = on_step
        self.runner = ModelRunner(model, config)
        if rules not in ("auto", "native", "python"):
            raise ValueError(f"rules must be 'auto', 'native' or 'python', got {rules!r}")
        in_c = rules == "native" or (rules == "auto" and native.available())
        self.rules: PythonRules = (native.NativeRules if in_c else PythonRules)(config, eos_token_ids, pad_token_id)

    @property
    def eos(self) -> frozenset[int]:
        return self.rules.eos

    def scheduler(self) -> Scheduler:
        """An empty batch of rows that decode with this decoder's model, rules and step callback."""
        return Scheduler(self.runner, self.rules, self.on_step)

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]]) -> DecodeOutput:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("decode needs at least one prompt, and every prompt at least one token")
        stats = DecodeStats()
        batch = self.scheduler()
        try:
            start = time.perf_counter()
            rows = batch.add(prompts)
            stats.prefill_seconds = time.perf_counter() - start
            start = time.perf_counter()
            with collector_paused():
                while batch.rows:
                    batch.step()
            stats.decode_seconds = time.perf_counter() - start
        finally:
            self.runner.restore()  # its own attention, whatever happened (see jfcore/decoding/runner/shared_prefix.py)
        stats.forward_calls = batch.steps
        stats.forward_seconds = batch.forward_seconds
        stats.tokens_per_row = [len(r.out) for r in rows]
        stats.forwards_per_row = [r.forwards for r in rows]
        stats.new_tokens = sum(stats.tokens_per_row)
        stats.decode_forwards = sum(stats.forwards_per_row)
        stats.recycled_tokens = sum(r.recycled for r in rows)
        trajectories = [r.trajectories for r in rows] if self.rules.record else None
        return DecodeOutput([r.out for r in rows], stats, trajectories)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while a decode steps. A decode's allocations start collections, and a
    full one walks every object the process holds (torch and transformers make that hundreds of thousands): about
    170 ms, 0.4 ms a step over a 256-token multiblock decode at 64 rows (with an earlier pool that kept more
    objects). A decode makes no reference cycles of its own; what it allocates goes with its rows when it returns,
    and the collector runs again as usual after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
