"""Decode and trajectory tokens/s on a GPU: eager forwards against CUDA graphs, side by side.

Each variant runs in its own process on the same model and prompts (pre-tokenised: the GPU machine needs no
tokenizer), one after the other in one run:

- `eager`: this tree, compile off; it also runs HF greedy `generate` on the decode prompts (the reference);
- `cuda_graphs`: this tree, compile="cuda_graphs" (jfcore/decoding/runner/graphs.py).

Measured per variant: batch-1 decoding of every decode prompt (`--methods`: AR, Jacobi n16, multiblock 2 x 16),
trajectory decoding (`decode_trajectories`, Jacobi n16, recorded) of the trajectory prompts at each
`--trajectory-batch`, and at each `--step-batch` one step's split into host work and forward, as
bench/step_overhead.py measures it on a CPU, next to HF `generate`'s whole step (the eager variant times it). Each
measurement first runs once untimed (CUDA graphs are captured there). The outputs' digests are compared across
variants and with `generate`'s tokens: the same model gives the same tokens whatever runs the forwards, except
where a kernel's rounding flips a near-tie (counted as `differs_from_generate`).

    python -m bench.gpu_decode --model DIR_OR_GGUF --prompts prompts.json --out results/
    python -m bench.gpu_decode --check-tiny   # CUDA graphs on tiny random models vs generate, token for token

`prompts.json`: {"decode": [[ids...], ...], "trajectories": [[ids...], ...]} (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
BLOCK = {"ar": 1, "jacobi": 16, "multiblock": 16}  # draft length per method (multiblock: 2 blocks, the defaults)
TREE = HERE.parent.parent


def _digest(sequences: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(sequences).encode()).hexdigest()[:16]


def _load(args: argparse.Namespace):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    if args.random_config:  # the architecture with seeded random weights (when the real weights are not at hand)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.random_config), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model.config._attn_implementation = "sdpa"
    return model.to(args.device).eval()


def measure(args: argparse.Namespace) -> dict:
    """One variant, in this process."""
    import torch

    import jfcore
    from jfcore.decoding import DecodeConfig, decode
    from jfcore.trajectories import TrajectoryConfig, decode_trajectories

    model = _load(args)
    prompts = json.loads(Path(args.prompts).read_text())
    extra = {"compile": "cuda_graphs" if args.variant == "cuda_graphs" else "off"}
    result: dict = {
        "variant": args.variant,
        "jfcore": str(Path(jfcore.__file__).parent),
        "decode": {},
        "trajectories": {},
        "steps": {},
    }

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def timed(run):
        run()  # untimed: first-use costs (CUDA graph captures, allocator growth, kernel selection)
        sync()
        start = time.perf_counter()
        value = run()
        sync()
        return value, time.perf_counter() - start

    for method in args.methods:
        config = DecodeConfig(method=method, block_size=BLOCK[method], max_new_tokens=args.max_new_tokens, **extra)
        outs, seconds = timed(lambda config=config: [decode(model, [p], config) for p in prompts["decode"]])
        sequences = [o.sequences[0] for o in outs]
        tokens = sum(map(len, sequences))
        forwards = sum(o.stats.forward_calls for o in outs)
        # Where a decode's time goes, so a change in tokens/s can be placed: its prefill, its steps (of which
        # forwards, graph storage adoption and replays included), and the rest (the call's own set-up and return).
        prefill = sum(o.stats.prefill_seconds for o in outs)
        steps = sum(o.stats.decode_seconds for o in outs)
        result["decode"][method] = {
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1),
            "tokens_per_forward": round(tokens / forwards, 3),
            "split_s": {
                "prefill": round(prefill, 4),
                "steps": round(steps, 4),
                "forwards": round(sum(o.stats.forward_seconds for o in outs), 4),
                "rest": round(seconds - prefill - steps, 4),
            },
            "digest": _digest(sequences),
            "sequences": sequences,
        }
    for batch in args.trajectory_batch:
        config = TrajectoryConfig(block_size=16, max_new_tokens=args.max_new_tokens, batch_size=batch, **extra)
        ids = [str(i) for i in range(len(prompts["trajectories"]))]
        table, seconds = timed(
            lambda config=config, ids=ids: decode_trajectories(model, ids, prompts["trajectories"], config, "m", "t")
        )
        rows = table.to_pylist()
        tokens = sum(len(r["fixed_point"]) for r in rows)
        result["trajectories"][str(batch)] = {
            "prompts": len(ids),
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1),
            "digest": hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16],
        }
    for batch in args.step_batch:
        result["steps"][str(batch)] = _steps(model, prompts["trajectories"], batch, args, extra, timed)
    if args.variant == "cuda_graphs":
        from jfcore.decoding.runner.graphs import graph_forward

        runner = graph_forward(model)
        result["graphs"] = {"captured": runner.captures, "adopted": runner.adoptions}
    if args.variant == "eager":
        result["generate"] = _generate(model, prompts["decode"], args.max_new_tokens, timed, args.device)
    return result


def _steps(model, pool: list[list[int]], batch: int, args: argparse.Namespace, extra: dict, timed) -> dict:
    """One step's cost at `batch` rows, as bench/step_overhead.py splits it (host = whole step - forward, the
    forward closed by a sync), for each method and, in the eager variant, HF `generate`: EOS off, so every row
    runs `--step-tokens`."""
    from jfcore.decoding import DecodeConfig, decode

    prompts = [pool[i % len(pool)] for i in range(batch)]
    figures = {}
    for method in args.methods:
        config = DecodeConfig(method=method, block_size=BLOCK[method], max_new_tokens=args.step_tokens, **extra)
        out, _ = timed(lambda config=config: decode(model, prompts, config, eos_token_id=[], pad_token_id=0))
        s = out.stats
        figures[method] = _step_figures(s.decode_seconds, s.forward_seconds, s.forward_calls, s.tpf)
    if args.variant == "eager":
        from jfcore.evaluation.methods import hf_method

        hf = hf_method(model, [], 0, min_new_tokens=args.step_tokens)
        run, _ = timed(lambda: hf(prompts, args.step_tokens))
        figures["hf_generate"] = _step_figures(
            run.decode_seconds, run.forward_seconds, run.decode_forwards // batch, 1.0
        )
    return figures


def _step_figures(decode_seconds: float, forward_seconds: float, steps: int, tpf: float) -> dict:
    steps = max(1, steps)
    return {
        "step_ms": round(1e3 * decode_seconds / steps, 3),
        "forward_ms": round(1e3 * forward_seconds / steps, 3),
        "host_ms": round(1e3 * (decode_seconds - forward_seconds) / steps, 3),
        "steps": steps,
        "tpf": round(tpf, 3),
    }


def _generate(model, prompts: list[list[int]], max_new_tokens: int, timed, device: str) -> dict:
    import torch

    def run():
        outs = []
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens
            )
            outs.append(out[0, len(p) :].tolist())
        return outs

    sequences, seconds = timed(run)
    tokens = sum(map(len, sequences))
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "sequences": sequences,
    }


def check_tiny() -> dict:
    """CUDA graphs (the default on a GPU, compile="auto") on tiny random models (float32) against generate, token
    for token: every method, ragged prompts, rows leaving at different steps, a row joining mid-decode, prompts
    crossing a cache granule; then eager forwards with rows reading a shared prompt prefix."""
    import random

    sys.path.insert(0, str(TREE))
    from jfcore.decoding import DecodeConfig
    from jfcore.decoding.decoder import Decoder
    from jfcore.decoding.runner.graphs import graph_forward
    from tests.support.tiny_models import greedy_reference, tiny_model

    checked, failures, captures, shared = 0, [], 0, 0
    for arch in ("llama", "qwen3", "gpt2"):
        model = tiny_model(arch).to("cuda")
        rng = random.Random(arch)
        for config in (
            DecodeConfig(method="ar", max_new_tokens=24),
            DecodeConfig(method="jacobi", block_size=5, max_new_tokens=24),
            DecodeConfig(method="jacobi", block_size=3, max_new_tokens=24, lookup_tokens=3),
            DecodeConfig(
                method="multiblock",
                block_size=3,
                num_blocks=2,
                pool_size=2,
                ngram_size=3,
                max_new_tokens=24,
            ),
        ):
            prompts = [[rng.randrange(1, 96) for _ in range(n)] for n in (3, 246, 7, 11, 5)]
            budgets = [24, 12, 5, 17, 1]
            live = Decoder(model, config, [], 0).scheduler()
            rows = live.add(prompts, budgets)
            live.step()
            prompts, budgets = prompts + [[9, 4, 4, 1]], budgets + [9]
            rows += live.add(prompts[-1:], budgets[-1:])  # a row joins: the storage grows under the graphs
            while live.rows:
                live.step()
            for row, prompt, budget in zip(rows, prompts, budgets):
                checked += 1
                if row.out != greedy_reference(model, prompt, budget):
                    failures.append(f"{arch} {config.describe()} row {row.index}")
        captures += graph_forward(model).captures
        # Eager forwards on the GPU with rows reading a shared prompt prefix (jfcore/decoding/runner/shared_prefix.py).
        opening = [rng.randrange(1, 96) for _ in range(12)]
        prompts = [opening + [rng.randrange(1, 96) for _ in range(n)] for n in (1, 4, 9)]
        for method in ("ar", "jacobi", "multiblock"):
            config = DecodeConfig(method=method, block_size=4, max_new_tokens=16, compile="off", share_prefix_tokens=8)
            live = Decoder(model, config, [], 0).scheduler()
            rows = live.add(prompts, [16] * len(prompts))
            shared += len(rows) if live.slots.shared is not None else 0
            while live.rows:
                live.step()
            for row, prompt in zip(rows, prompts):
                checked += 1
                if row.out != greedy_reference(model, prompt, 16):
                    failures.append(f"{arch} {method} shared prefix, eager: row {row.index}")
    if not captures:
        failures.append("no CUDA graph was captured: compile='auto' did not choose CUDA graphs on this GPU")
    return {"rows_checked": checked, "failures": failures, "graphs_captured": captures, "rows_sharing_a_prefix": shared}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF checkpoint dir, or a .gguf file (converted once)")
    p.add_argument("--random-config", help="a config dir: its architecture with seeded random weights instead")
    p.add_argument("--prompts", help="JSON file of pre-tokenised prompts (see above)")
    p.add_argument("--variants", nargs="+", default=["eager", "cuda_graphs"], choices=["eager", "cuda_graphs"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cuda", help="cuda; cpu only to rehearse the run (no cuda_graphs variant)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--trajectory-batch", type=int, nargs="+", default=[32])
    p.add_argument("--methods", nargs="+", default=list(BLOCK), choices=list(BLOCK), help="batch-1 and step methods")
    p.add_argument("--step-batch", type=int, nargs="*", default=[], help="batch sizes for the per-step split")
    p.add_argument("--step-tokens", type=int, default=32, help="new tokens per row in the per-step split")
    p.add_argument("--out", type=Path, default=HERE.parent / "results")
    p.add_argument("--check-tiny", action="store_true")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # set in the child processes
    args = p.parse_args(argv)

    if args.check_tiny:
        report = check_tiny()
        print(json.dumps(report, indent=1))
        return 1 if report["failures"] else 0
    if args.variant:
        print(json.dumps(measure(args)))
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("model", "random_config", "prompts"):  # the children run in the tree's folder
        if getattr(args, name) and os.path.exists(getattr(args, name)):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    if args.model and args.model.endswith(".gguf"):
        sys.path.insert(0, str(TREE))
        from jfcore.models import ModelConfig, resolve_checkpoint

        args.model = resolve_checkpoint(ModelConfig(name_or_path=args.model))
    results = {}
    for variant in args.variants:
        tree = str(TREE)
        child = [sys.executable, str(HERE), "--variant", variant, "--prompts", args.prompts, "--dtype", args.dtype]
        child += ["--device", args.device]
        child += ["--max-new-tokens", str(args.max_new_tokens), "--trajectory-batch", *map(str, args.trajectory_batch)]
        child += ["--methods", *args.methods, "--step-tokens", str(args.step_tokens)]
        child += ["--step-batch", *map(str, args.step_batch)]
        child += ["--random-config", args.random_config] if args.random_config else ["--model", args.model]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run(child, check=False, env=env, capture_output=True, text=True, cwd=tree)
        if done.returncode:
            print(done.stderr[-4000:], file=sys.stderr)
            results[variant] = {"error": done.stderr[-2000:]}
            continue
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        _print(results[variant])
        (args.out / "gpu_decode.json").write_text(json.dumps(results, indent=1))  # what is done, if cut short
    _compare(results)
    (args.out / "gpu_decode.json").write_text(json.dumps(results, indent=1))
    return 0


def _print(r: dict) -> None:
    for method, d in r["decode"].items():
        print(
            f"{r['variant']:12s} decode {method:7s} {d['tokens_per_s']:8.1f} tok/s  TPF {d['tokens_per_forward']}  {d['digest']}"
            + "  s: "
            + "  ".join(f"{part} {value}" for part, value in d["split_s"].items())
        )
    for batch, d in r["trajectories"].items():
        print(f"{r['variant']:12s} trajectories batch {batch:3s} {d['tokens_per_s']:8.1f} tok/s  {d['digest']}")
    if "generate" in r:
        print(f"{'generate':12s} decode          {r['generate']['tokens_per_s']:8.1f} tok/s")
    for batch, methods in r.get("steps", {}).items():
        for method, f in methods.items():
            print(
                f"{r['variant']:12s} step batch {batch:>3s} {method:11s} step {f['step_ms']:7.2f} ms  forward "
                f"{f['forward_ms']:7.2f}  host {f['host_ms']:6.2f}  TPF {f['tpf']}"
            )


def _compare(results: dict) -> None:
    """Speedups against eager forwards and `generate`, and token agreement with `generate` (sequences that differ)."""
    reference = results.get("eager", {}).get("generate")
    base = results.get("eager", {})
    for name, r in results.items():
        if "decode" not in r:
            continue
        for method, d in r["decode"].items():
            if reference:
                d["differs_from_generate"] = sum(a != b for a, b in zip(d["sequences"], reference["sequences"]))
                d["speedup_vs_generate"] = round(d["tokens_per_s"] / reference["tokens_per_s"], 3)
            if "decode" in base:
                d["speedup_vs_eager"] = round(d["tokens_per_s"] / base["decode"][method]["tokens_per_s"], 3)
            print(
                f"{name:12s} decode {method:7s} vs generate {d.get('speedup_vs_generate')}x, vs eager "
                f"{d.get('speedup_vs_eager')}x, sequences differing from generate: {d.get('differs_from_generate')}"
            )
        for batch, d in r["trajectories"].items():
            if "trajectories" in base:
                d["speedup_vs_eager"] = round(d["tokens_per_s"] / base["trajectories"][batch]["tokens_per_s"], 3)
                d["same_as_eager"] = d["digest"] == base["trajectories"][batch]["digest"]
            print(
                f"{name:12s} trajectories batch {batch}: vs eager {d.get('speedup_vs_eager')}x, "
                f"same rows as eager: {d.get('same_as_eager')}"
            )
        for batch, methods in r.get("steps", {}).items():  # the measure: host time / HF's whole step
            hf = results.get("eager", {}).get("steps", {}).get(batch, {}).get("hf_generate")
            for method, f in methods.items():
                if hf:
                    f["host_over_hf_step"] = round(f["host_ms"] / hf["step_ms"], 3)
                    f["step_over_hf_step"] = round(f["step_ms"] / hf["step_ms"], 3)
                print(
                    f"{name:12s} step batch {batch} {method}: host / HF step {f.get('host_over_hf_step')}, "
                    f"step / HF step {f.get('step_over_hf_step')}"
                )


if __name__ == "__main__":
    sys.exit(main())
