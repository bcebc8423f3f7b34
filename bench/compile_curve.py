"""Eager vs compiled decode forward: the cost curve t(q)/t(1) and the step time, side by side in one run.

A parallel decoder gains only where t(q) stays near t(1). Batch-1 decoding of a small model is memory-bound, so
the roofline puts t(16) close to t(1); eager PyTorch on a CPU does not get there (per-op overhead and kernels that
switch at small q). This bench measures, on the decoder's own forward path (a slot batch on a `--context`-token
cache), one forward of q new positions for each q and each variant:

- eager: the model as loaded
- inductor: `torch.compile(model, dynamic=False)` (one graph per shape: q and the cache length are fixed here)
- inductor-frozen: the same with inductor's weight freezing (constant-folded, prepacked weights)
- inductor-dynamic: `dynamic=True`, one graph for every q and cache length (what a decoder could use as is)
- linear-auto: eager, with linear layers as `DecodeConfig.linear="auto"` runs them (jfcore/decoding/runner/linear.py:
  products over a few rows computed the fastest way: torch's, weight first or the C kernel)
- linear-two-ways: the same without the C kernel (torch's way or weight first), as the mode ran before it
- bfloat16: eager, a copy of the model in bfloat16 (on a CPU with bfloat16 matrix instructions its curve can be far
  flatter than float32's; its greedy tokens are not float32's)

Eager and the variants named (at most one compiled: dynamo keys compiled code to the forward's code, so a second
compiled variant in one process would reuse the first's graphs), their widths interleaved over rounds so that drift
hits all alike; the median is kept. Compile seconds are reported apart. Printed and written to JSON.

    python -m bench.compile_curve                          # SmolLM2-135M, batch 1, fp32, q = 1 2 4 8 16, inductor
    python -m bench.compile_curve --compiled inductor-frozen --widths 1 16 --rounds 3
    python -m bench.compile_curve --compiled linear-auto --widths 1 2 3 4 6 8 12 16
    python -m bench.compile_curve --compiled linear-two-ways linear-auto --widths 1 2 4 8 16 32
    python -m bench.compile_curve --compiled bfloat16 --widths 1 2 4 8 16 32
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.common import RESULTS
from jfcore.decoding.runner.linear import FasterLinear, faster_linear, faster_way
from jfcore.decoding.runner.slots import SlotBatch
from jfcore.decoding.sampling import greedy_argmax
from jfcore.models import ModelConfig, load_model

COMPILED = ("inductor", "inductor-frozen", "inductor-dynamic")
LINEAR = ("linear-auto", "linear-two-ways")
BESIDE = (*COMPILED, *LINEAR, "bfloat16")


def build(model: torch.nn.Module, variant: str) -> torch.nn.Module:
    if variant == "eager" or variant in LINEAR:
        return model
    if variant == "bfloat16":
        return copy.deepcopy(model).to(torch.bfloat16)
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)  # one graph per width
    inductor_config.freezing = variant == "inductor-frozen"
    return torch.compile(model, dynamic=variant == "inductor-dynamic")


class Runner:
    """One variant's slot batch on a fixed context; `forward(q)` times one forward of q new positions."""

    def __init__(self, model: torch.nn.Module, batch: int, context: int, seed: int, linear: FasterLinear | None = None):
        vocab = model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") else None
        self.model, self.batch, self.context = model, batch, context
        self.generator = torch.Generator().manual_seed(seed)
        self.vocab = vocab or model.config.vocab_size
        self.slots = SlotBatch(model, batch, compact=False, linear=linear)
        prompt = torch.randint(0, self.vocab, (batch, context), generator=self.generator)
        valid = torch.ones(batch, context, dtype=torch.bool)
        self.slots.forward(prompt, valid, torch.arange(context).expand(batch, -1))
        self.slots.keep(valid)

    def forward(self, q: int) -> float:
        tokens = torch.randint(0, self.vocab, (self.batch, q), generator=self.generator)
        positions = torch.arange(self.context, self.context + q).expand(self.batch, -1)
        start = time.perf_counter()
        logits = self.slots.forward(tokens, torch.ones(self.batch, q, dtype=torch.bool), positions)
        greedy_argmax(logits).tolist()
        seconds = time.perf_counter() - start
        self.slots.keep(torch.zeros(self.batch, q, dtype=torch.bool))  # the cache stays at `context`
        return seconds


@torch.inference_mode()
def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=ModelConfig().name_or_path)
    p.add_argument("--compiled", nargs="+", default=["inductor"], choices=BESIDE, help="the variants beside eager")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    model, _ = load_model(ModelConfig(name_or_path=args.model))
    widths = sorted(set(args.widths) | {1})
    if len(set(args.compiled) & set(COMPILED)) > 1:
        p.error(f"at most one compiled variant a run (of {', '.join(COMPILED)})")
    variants = ["eager", *dict.fromkeys(args.compiled)]
    runners, compile_seconds = {}, {}
    for variant in variants:
        start = time.perf_counter()
        linear = None
        if variant == "linear-auto":
            linear = faster_linear(model)
            print(f"linear-auto: {'on' if linear else 'off (torch measured as fast here)'}", flush=True)
        if variant == "linear-two-ways":  # timed here, in this process: the record holds the three ways' choices
            linear = FasterLinear(choose=lambda x, w, b: faster_way(x, w, b, ways=("torch", "weight_first")))
        runners[variant] = Runner(build(model, variant), args.batch, args.context, seed=0, linear=linear)
        for q in widths:  # every shape compiled (and warmed) before anything is timed
            runners[variant].forward(q)
        compile_seconds[variant] = time.perf_counter() - start
        print(f"{variant}: ready in {compile_seconds[variant]:.1f} s", flush=True)
    times = {v: {q: [] for q in widths} for v in variants}
    pairs = [(v, q) for v in variants for q in widths]
    for r in range(args.rounds):
        for v, q in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:
            times[v][q].append(runners[v].forward(q))
    results = {}
    for v in variants:
        ms = {q: 1e3 * statistics.median(times[v][q]) for q in widths}
        results[v] = {"ms": ms, "ratio": {q: ms[q] / ms[1] for q in widths}, "ready_seconds": compile_seconds[v]}
    eager_t1 = results["eager"]["ms"][1]
    print(f"\nbatch {args.batch}, context {args.context}, {args.rounds} rounds (median ms; t(q)/t(1); vs eager t(1))")
    print(f"{'variant':<16}" + "".join(f"{'q=' + str(q):>18}" for q in widths) + f"{'ready s':>9}")
    for v, res in results.items():
        cells = "".join(f"{res['ms'][q]:7.1f} {res['ratio'][q]:4.2f} {res['ms'][q] / eager_t1:4.2f}" for q in widths)
        print(f"{v:<16}{cells}{res['ready_seconds']:9.0f}")
    out = args.out or RESULTS / f"compile-curve-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    host = {"processor": platform.processor(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"settings": settings, "host": host, "results": results}, indent=2))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
