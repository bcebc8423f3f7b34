"""Decoding benchmark: HF greedy `generate` against the project's AR, Jacobi and multiblock decoders
and HF prompt-lookup decoding, on one model and one prompt set, in ONE interleaved run.

Every batch of prompts is decoded by every method back to back, the method order rotated per batch,
so the host's speed drift hits all methods alike. See docs/BENCHMARKS.md for what each column means.

    python -m bench.decode_bench --limit 4 --max-new-tokens 64
    python -m bench.decode_bench --model runs/smollm2/training/latest/final --tuned \
        --benchmarks gsm8k humaneval mbpp math500 --block-sizes "" --limit 5   # the tuned decoding vs HF
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import transformers

from bench.common import RESULTS, Prompt, environment, top2_gap, tuned_settings
from jfcore.chat import encode_chat, read_jsonl
from jfcore.decoding import DecodeConfig, special_tokens
from jfcore.decoding.reference import first_divergence
from jfcore.decoding.runner.slots import device_sync
from jfcore.evaluation.config import SAME_ENGINE_AR
from jfcore.evaluation.methods import Method, hf_method, project_method
from jfcore.models import ModelConfig, load_model
from jfcore.paths import default_data_dir, eval_prompts

BASELINE = "hf_greedy"
NEAR_TIE = 1e-5  # a compiled kernel may flip a greedy token only where the top-2 logits are this close


@dataclass(frozen=True)
class BenchSettings:
    max_new_tokens: int = 128
    block_sizes: tuple[int, ...] = (8, 16, 32)  # one Jacobi method per size
    multiblock_size: int = DecodeConfig.block_size
    num_blocks: int = DecodeConfig.num_blocks
    pool_size: int = DecodeConfig.pool_size
    spawn_ratio: float = DecodeConfig.spawn_ratio
    ngram_size: int = DecodeConfig.ngram_size
    prompt_lookup_tokens: int = 10
    batch_size: int = 1
    warmup_tokens: int = 32
    tuned: dict | None = None  # the model's tuned decoding for this machine (DecodeConfig keys), run as "tuned"
    compile: bool = False  # also each project method with compile="inductor" (named "<method>+inductor")
    lookup_tokens: int = 0  # > 0: also AR with prompt-lookup candidates of this many tokens, 3-gram match ("ar+L2g3")
    torch_linear: bool = False  # also each project method with linear="torch" (named "<method>+torch_linear")


def project_configs(s: BenchSettings) -> dict[str, dict]:
    """The project's methods as DecodeConfig keys, by name."""
    configs = {"ar": {"method": "ar"}}
    for n in s.block_sizes:
        configs[f"jacobi_n{n}"] = {"method": "jacobi", "block_size": n}
    if s.multiblock_size:
        configs[f"multiblock_n{s.multiblock_size}"] = {
            "method": "multiblock",
            "block_size": s.multiblock_size,
            "num_blocks": s.num_blocks,
            "pool_size": s.pool_size,
            "spawn_ratio": s.spawn_ratio,
            "ngram_size": s.ngram_size,
        }
    if s.lookup_tokens:
        configs[f"ar+L{s.lookup_tokens}g3"] = {"method": "ar", "lookup_tokens": s.lookup_tokens, "lookup_ngram": 3}
    if s.tuned is not None:
        configs["tuned"] = dict(s.tuned)
    if s.torch_linear:
        configs |= {f"{name}+torch_linear": {**c, "linear": "torch"} for name, c in configs.items()}
    if s.compile:
        configs |= {f"{name}+inductor": {**c, "compile": "inductor"} for name, c in configs.items()}
    return configs


def build_methods(model, eos: list[int], pad: int, s: BenchSettings) -> dict[str, Method]:
    methods = {BASELINE: hf_method(model, eos, pad)}
    if s.batch_size == 1:  # HF assisted generation (prompt lookup) supports batch size 1 only
        methods["hf_prompt_lookup"] = hf_method(model, eos, pad, prompt_lookup_num_tokens=s.prompt_lookup_tokens)
    return methods | {name: project_method(model, eos, pad, **c) for name, c in project_configs(s).items()}


def run_bench(
    model, prompts: list[Prompt], settings: BenchSettings, eos: list[int], pad: int, log: Callable[[str], None] = print
) -> dict:
    """Decode `prompts` with every method, interleaved; per-batch records and per-method aggregates."""
    methods = build_methods(model, eos, pad, settings)
    names = list(methods)
    sync = device_sync(next(model.parameters()).device)
    index = {id(p): i for i, p in enumerate(prompts)}
    by_source: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_source.setdefault(p.source, []).append(p)
    batches = [
        group[i : i + settings.batch_size]
        for group in by_source.values()
        for i in range(0, len(group), settings.batch_size)
    ]

    for name in names:  # warm-up: one-off costs (allocator, kernels, lazy init) stay out of the timings
        methods[name]([batches[0][0].ids], settings.warmup_tokens)
    compile_seconds = {}
    for name in [n for n in names if n.endswith("+inductor")]:  # every shape the timed runs meet compiles now
        start = time.perf_counter()
        for batch in batches:
            methods[name]([p.ids for p in batch], settings.max_new_tokens)
        compile_seconds[name] = time.perf_counter() - start
        log(f"{name}: compiled and warmed on every batch in {compile_seconds[name]:.0f} s")
    log(f"warm-up done; timing {len(batches)} batches x {len(names)} methods")

    records = []
    for i, batch in enumerate(batches):
        ids = [p.ids for p in batch]
        order = names[i % len(names) :] + names[: i % len(names)]
        runs, seconds = {}, {}
        for name in order:
            sync()
            start = time.perf_counter()
            runs[name] = methods[name](ids, settings.max_new_tokens)
            sync()
            seconds[name] = time.perf_counter() - start
        reference = runs[BASELINE].sequences
        records.append(
            {
                "source": batch[0].source,
                "prompts": [index[id(p)] for p in batch],
                "prompt_tokens": [len(x) for x in ids],
                "methods": {
                    name: {
                        "seconds": seconds[name],
                        **{k: v for k, v in vars(run).items() if k != "sequences"},
                        "new_tokens": [len(x) for x in run.sequences],
                        "exact": [x == r for x, r in zip(run.sequences, reference)],
                        "first_divergence": [first_divergence(x, r) for x, r in zip(run.sequences, reference)],
                        "divergence_margin": [
                            None if x == r else top2_gap(model, p, r[: first_divergence(x, r)])
                            for p, x, r in zip(ids, run.sequences, reference)
                        ],
                    }
                    for name, run in runs.items()
                },
            }
        )
        log(f"[{i + 1}/{len(batches)}] {batch[0].source:<10} " + "  ".join(f"{n} {seconds[n]:.1f}s" for n in names))

    sources = list(by_source)
    return {
        "methods": names,
        "compile_seconds": compile_seconds,
        "aggregates": aggregate(records, names),
        "by_source": {src: aggregate([r for r in records if r["source"] == src], names) for src in sources},
        "batches": records,
    }


def aggregate(records: list[dict], names: list[str]) -> dict[str, dict]:
    """Totals per method: TPS = all new tokens / all seconds (so long outputs weigh more), and ratios of sums."""
    out = {}
    for name in names:
        rows = [r["methods"][name] for r in records]
        total = {
            key: sum(r[key] for r in rows)
            for key in ("seconds", "prefill_seconds", "decode_seconds", "forward_seconds", "decode_forwards")
        }
        tokens = sum(sum(r["new_tokens"]) for r in rows)
        decode_s, forwards = total["decode_seconds"], total["decode_forwards"]
        divergence = [d for r in rows for d in r["first_divergence"]]
        margins = [m for r in rows for m in r["divergence_margin"] if m is not None]
        exact = [e for r in rows for e in r["exact"]]
        out[name] = {
            "prompts": len(exact),
            "new_tokens": tokens,
            **total,
            "tpf": tokens / forwards if forwards else None,
            "tps": tokens / total["seconds"],
            "decode_tps": tokens / decode_s if decode_s > 0 else None,
            "overhead": 1 - total["forward_seconds"] / decode_s if decode_s > 0 else None,
            "exact": sum(exact) / len(exact),
            "first_divergence_mean": sum(divergence) / len(divergence),
            "first_divergence_min": min(divergence),
            # Outputs that left HF greedy's, and how many did so where the eager top-2 logits were within 1e-5
            "flips": len(margins),
            "near_tie_flips": sum(m < NEAR_TIE for m in margins),
            "flip_margin_max": max(margins, default=None),
        }
    for agg in out.values():
        agg["speedup_vs_ar"] = agg["tps"] / out[SAME_ENGINE_AR]["tps"]  # what the method adds, same engine and kernels
        agg["speedup"] = agg["tps"] / out[BASELINE]["tps"]  # kernels and method together
    return out


def format_table(result: dict) -> str:
    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"{'method':<20}{'TPF':>6}{'TPS':>8}{'dec TPS':>9}{'vs AR':>8}{'vs HF':>8}{'overhead':>10}{'exact':>7}"
        + f"{'1st diff mean/min':>19}"
    ]
    for name, a in result["aggregates"].items():
        lines.append(
            f"{name:<20}{fmt(a['tpf'], '.2f'):>6}{a['tps']:>8.1f}{fmt(a['decode_tps'], '.1f'):>9}"
            f"{a['speedup_vs_ar']:>7.2f}x{a['speedup']:>7.2f}x{fmt(a['overhead'], '.1%'):>10}{a['exact']:>7.0%}"
            f"{a['first_divergence_mean']:>13.1f}/{a['first_divergence_min']:<5}"
        )
    lines += [
        "",
        (
            "vs AR: over this project's AR on the same kernels (what the method adds); vs HF: over HF greedy generate "
            "(kernels and method together)"
        ),
    ]
    if len(result["by_source"]) > 1:
        lines += ["", "speedup vs AR (vs HF) by prompt set: " + ", ".join(result["by_source"])]
        for name in result["methods"]:
            per = "  ".join(
                f"{src} {agg[name]['speedup_vs_ar']:.2f}x ({agg[name]['speedup']:.2f}x)"
                for src, agg in result["by_source"].items()
            )
            lines.append(f"  {name:<20}{per}")
    return "\n".join(lines)


def load_prompts(args: argparse.Namespace, tokenizer) -> list[Prompt]:
    if args.benchmarks:  # asked exactly as evaluation asks them
        from jfcore.evaluation.benchmarks import BenchmarkConfig, load_benchmark

        problems = [
            p
            for name in args.benchmarks
            for p in load_benchmark(BenchmarkConfig(name=name, limit=args.limit, seed=args.seed), args.data_dir)
        ]
        return [Prompt(p.benchmark, p.prompt, encode_chat(tokenizer, p.prompt)) for p in problems]
    if args.prompts:
        texts = [(Path(args.prompts).name.split(".")[0], t) for t in read_jsonl(args.prompts, args.field, args.limit)]
    else:
        texts = [(name, t) for name in ("gsm8k", "humaneval") for t in eval_prompts(name, args.limit, args.data_dir)]
    return [Prompt(source, text, encode_chat(tokenizer, text)) for source, text in texts]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="preset, checkpoint dir, .gguf file or hub id")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--attn", default="sdpa")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"shared data dir (default: $JF_SHARED_DATA or <repo>/../shared/data = {default_data_dir()})",
    )
    p.add_argument("--prompts", help="JSONL(.gz) of custom prompts instead of GSM8K + HumanEval")
    p.add_argument(
        "--benchmarks",
        nargs="+",
        help="evaluation benchmarks (gsm8k humaneval mbpp math500), asked as evaluation asks them, --limit each",
    )
    p.add_argument("--seed", type=int, default=0, help="with --benchmarks: shuffle seed before --limit (evaluation's)")
    p.add_argument(
        "--tuned", action="store_true", help="also run the model's tuned decoding for this machine (see jf-tune)"
    )
    p.add_argument("--field", default="prompt", help="field of --prompts holding the text")
    p.add_argument("--limit", type=int, default=10, help="prompts per set (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-sizes", default="8,16,32", help="Jacobi block sizes, comma-separated")
    p.add_argument("--multiblock-size", type=int, default=16, help="block size n of multiblock + recycling (0: none)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts per call (prompt lookup needs 1)")
    p.add_argument("--warmup-tokens", type=int, default=32)
    p.add_argument(
        "--compile",
        action="store_true",
        help="also every project method compiled (compile='inductor'); each first decodes every batch untimed",
    )
    p.add_argument("--lookup-tokens", type=int, default=0, help="also AR + prompt lookup of this many tokens (3-gram)")
    p.add_argument(
        "--torch-linear",
        action="store_true",
        help="also every project method with linear='torch' (torch's own linear kernels; the default 'auto' may "
        "compute small products weight first: jfcore/decoding/runner/linear.py)",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/decode_<model>_<device>_<dtype>.json)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        block_sizes=tuple(int(n) for n in args.block_sizes.split(",") if n),
        multiblock_size=args.multiblock_size,
        batch_size=args.batch_size,
        warmup_tokens=args.warmup_tokens,
        compile=args.compile,
        lookup_tokens=args.lookup_tokens,
        torch_linear=args.torch_linear,
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    model_config = ModelConfig(
        name_or_path=args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn
    )
    model, tokenizer = load_model(model_config)
    prompts = load_prompts(args, tokenizer)
    eos, pad = special_tokens(model, None, tokenizer.pad_token_id)
    if args.tuned:
        settings = replace(settings, tuned=tuned_settings(model_config, model, settings.batch_size))
    print(
        f"{args.model} {args.dtype} on {args.device}: {len(prompts)} prompts, batch {settings.batch_size}, "
        f"{settings.max_new_tokens} new tokens, {torch.get_num_threads()} threads",
        flush=True,
    )
    if settings.batch_size > 1:
        print("note: hf_prompt_lookup left out (HF assisted generation supports batch size 1 only)")
    result = run_bench(model, prompts, settings, eos, pad, log=lambda line: print(line, file=sys.stderr, flush=True))
    print("\n" + format_table(result))

    tag = re.sub(r"[^\w.-]+", "-", Path(args.model.rstrip("/")).name)
    out = args.out or RESULTS / f"decode_{tag}_{args.device.replace(':', '')}_{args.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "settings": asdict(settings),
        "environment": environment(model_config),
        "prompts": [{"source": p.source, "tokens": len(p.ids), "text": p.text} for p in prompts],
        **result,
    }
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()  # generate's per-call notices would drown the progress lines
    sys.exit(main())
