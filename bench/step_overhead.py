"""How much of a decode step is the decoder's own host work, next to HF `generate`'s whole step.

On a GPU a small model's forward takes a few milliseconds, so the Python between forwards decides the speed. This
bench stands in for that on a CPU with a 2-layer random model whose forward is short. For each batch size it runs
HF greedy `generate` and the project's AR, Jacobi, multiblock and AR + prompt lookup decoders back to back (order rotated per round)
on the same prompts, EOS off so every row runs the whole budget, and times every model forward with hooks:

- whole step: decode time (prefill excluded) / decode forwards
- forward: time inside the model's forward / decode forwards (a sync closes each on a GPU), measured by the
  decoder itself for the project's methods and by evaluation's forward hooks for `generate`
- host: whole step - forward: the decoder's own work per step

Printed and written to JSON: each figure, and host time / HF generate's whole step (the issue's targets at batch
64: AR <= 0.3, Jacobi <= 0.45, multiblock <= 0.9, and AR's whole step <= HF's).

    python -m bench.step_overhead                       # batches 1 8 64 128
    python -m bench.step_overhead --batches 64 --rounds 1 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import RESULTS, prompts_for, short_forward_model
from jfcore.decoding import DecodeConfig, decode
from jfcore.evaluation.methods import hf_method

METHODS = {
    "ar": DecodeConfig(method="ar"),
    "jacobi": DecodeConfig(method="jacobi"),
    "multiblock": DecodeConfig(method="multiblock"),
    "ar+lookup": DecodeConfig(method="ar", lookup_tokens=2, lookup_ngram=3),  # the tuned CPU default (ar+L2g3)
}


def run_hf(model, prompts: list[list[int]], new_tokens: int) -> dict:
    """HF greedy `generate` timed by evaluation's own hooks (the first forward is the prefill, left out)."""
    run = hf_method(model, [], 0, min_new_tokens=new_tokens)(prompts, new_tokens)
    return _figures(run.decode_seconds, run.forward_seconds, run.decode_forwards // len(prompts))


def run_project(model, prompts: list[list[int]], new_tokens: int, config: DecodeConfig) -> dict:
    out = decode(model, prompts, replace(config, max_new_tokens=new_tokens), eos_token_id=[], pad_token_id=0)
    s = out.stats  # the decoder's own timings: decode_seconds and forward_seconds leave the prefill out
    return _figures(s.decode_seconds, s.forward_seconds, s.forward_calls, tpf=s.new_tokens / max(1, s.decode_forwards))


def _figures(decode_seconds: float, forward_seconds: float, steps: int, tpf: float = 1.0) -> dict:
    steps = max(1, steps)
    step = decode_seconds / steps
    forward = forward_seconds / steps
    return {
        "step_ms": 1e3 * step,
        "forward_ms": 1e3 * forward,
        "host_ms": 1e3 * (step - forward),
        "steps": steps,
        "tpf": tpf,
    }


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 128])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per batch size (median kept)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--layers", type=int, default=2, help="layers of the short-forward model (SmolLM2-135M has 30)")
    p.add_argument("--label", default="", help="a name for this run in the results file (e.g. before/after)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = short_forward_model(layers=args.layers)
    vocab = model.config.vocab_size
    run_project(model, prompts_for(2, vocab, 99), 8, METHODS["jacobi"])  # warm-up
    results = {}
    for batch in args.batches:
        prompts = prompts_for(batch, vocab, batch)
        names = ["hf_generate", *METHODS]
        rounds: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                if name == "hf_generate":
                    rounds[name].append(run_hf(model, prompts, args.max_new_tokens))
                else:
                    rounds[name].append(run_project(model, prompts, args.max_new_tokens, METHODS[name]))
        results[batch] = {name: _median(rs) for name, rs in rounds.items()}
        hf_step = results[batch]["hf_generate"]["step_ms"]
        for name, fig in results[batch].items():
            fig["host_over_hf_step"] = fig["host_ms"] / hf_step
            fig["step_over_hf_step"] = fig["step_ms"] / hf_step
        _print(batch, results[batch])
    out = args.out or RESULTS / f"step-overhead-{args.label or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    host = {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    settings = {
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "label": args.label,
        "layers": args.layers,
    }
    out.write_text(json.dumps({"settings": settings, "host": host, "results": results}, indent=2))
    print(f"wrote {out}")
    return out


def _median(runs: list[dict]) -> dict:
    ordered = sorted(runs, key=lambda f: f["step_ms"])
    return dict(ordered[len(ordered) // 2])


def _print(batch: int, figures: dict[str, dict]) -> None:
    print(f"\nbatch {batch}")
    print(f"{'method':<12} {'step ms':>8} {'fwd ms':>8} {'host ms':>8} {'TPF':>5} {'host/HF step':>13} {'step/HF':>8}")
    for name, f in figures.items():
        print(
            f"{name:<12} {f['step_ms']:8.2f} {f['forward_ms']:8.2f} {f['host_ms']:8.2f} {f['tpf']:5.2f} "
            f"{f['host_over_hf_step']:13.2f} {f['step_over_hf_step']:8.2f}"
        )


if __name__ == "__main__":
    main()
