"""Sampled decoding: TPF and speed of the project's methods at temperature 0.7 and 1.0, next to greedy, in ONE
interleaved run.

Every prompt is decoded by every (temperature, method) pair back to back, the order rotated per prompt. At each
temperature the methods sample with the same keyed noise (jfcore/decoding/sampling.py), so they return the same
tokens as AR sampling at that temperature (checked: `same_as_ar`); their speedup is measured against AR at the same
temperature and against HF `generate` sampling with the same settings (its own random numbers, so other tokens).

    python -m bench.sampling_bench --model runs/smollm2/training/latest/final --limit 5
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import RESULTS, Prompt, environment, tuned_settings
from jfcore.chat import encode_chat
from jfcore.decoding import special_tokens
from jfcore.evaluation.methods import hf_method, project_method
from jfcore.models import ModelConfig, load_model
from jfcore.paths import default_data_dir, eval_prompts


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="preset, checkpoint dir, .gguf file or hub id")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    p.add_argument("--top-p", type=float, default=0.95, help="for the sampled temperatures")
    p.add_argument("--block-sizes", type=int, nargs="*", default=[16], help="Jacobi methods beside AR (and tuned)")
    p.add_argument("--limit", type=int, default=5, help="prompts from each of GSM8K and HumanEval")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    p.add_argument("--data-dir", type=Path, default=None, help=f"shared data (default {default_data_dir()})")
    p.add_argument("--out", type=Path, default=RESULTS / "sampling_bench.json")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)  # HF sampling's own generator
    model_config = ModelConfig(name_or_path=args.model)
    model, tokenizer = load_model(model_config)
    eos, pad = special_tokens(model, None, tokenizer.pad_token_id)
    prompts = [
        Prompt(name, text, encode_chat(tokenizer, text))
        for name in ("gsm8k", "humaneval")
        for text in eval_prompts(name, args.limit, args.data_dir)
    ]
    configs = {"ar": {"method": "ar"}} | {
        f"jacobi_n{n}": {"method": "jacobi", "block_size": n} for n in args.block_sizes
    }
    try:
        configs["tuned"] = tuned_settings(model_config, model, 1)
    except SystemExit as why:
        print(f"no tuned method: {why}")
    methods = {}
    for t in args.temperatures:
        sampling = {"temperature": t, "top_p": args.top_p, "sample_seed": args.seed} if t > 0 else {}
        hf = {"do_sample": True, "temperature": t, "top_p": args.top_p} if t > 0 else {}
        methods[(t, "hf_generate")] = hf_method(model, eos, pad, **hf)
        methods |= {(t, name): project_method(model, eos, pad, **c, **sampling) for name, c in configs.items()}
    keys = list(methods)
    for key in keys:  # warm-up
        methods[key]([prompts[0].ids], 16)
    totals = {key: {"prompts": 0, "tokens": 0, "seconds": 0.0, "forwards": 0, "same_as_ar": 0} for key in keys}
    for i, prompt in enumerate(prompts):
        runs = {}
        for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
            start = time.perf_counter()
            runs[key] = methods[key]([prompt.ids], args.max_new_tokens)
            total = totals[key]
            total["seconds"] += time.perf_counter() - start
            total["tokens"] += len(runs[key].sequences[0])
            total["forwards"] += runs[key].decode_forwards
        for key, run in runs.items():
            totals[key]["prompts"] += 1
            totals[key]["same_as_ar"] += run.sequences == runs[(key[0], "ar")].sequences
        print(f"[{i + 1}/{len(prompts)}] {prompt.source}", flush=True)

    rows = []
    for (t, name), total in totals.items():
        tps = total["tokens"] / total["seconds"]
        rows.append(
            total
            | {
                "temperature": t,
                "method": name,
                "tpf": total["tokens"] / total["forwards"] if total["forwards"] else None,
                "tps": tps,
                "speedup_vs_ar": tps / (totals[(t, "ar")]["tokens"] / totals[(t, "ar")]["seconds"]),
                "speedup_vs_hf": tps / (totals[(t, "hf_generate")]["tokens"] / totals[(t, "hf_generate")]["seconds"]),
                "same_as_ar": total["same_as_ar"] / total["prompts"],
            }
        )
    print(f"{'T':>4} {'method':<14}{'TPF':>6}{'TPS':>8}{'vs AR':>8}{'vs HF':>8}{'same as AR':>12}")
    for r in rows:
        tpf = "-" if r["tpf"] is None else f"{r['tpf']:.2f}"
        print(
            f"{r['temperature']:>4} {r['method']:<14}{tpf:>6}{r['tps']:>8.1f}{r['speedup_vs_ar']:>7.2f}x"
            f"{r['speedup_vs_hf']:>7.2f}x{r['same_as_ar']:>12.0%}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"top_p": args.top_p, "seed": args.seed, "max_new_tokens": args.max_new_tokens, "prompts": len(prompts)}
    result = {"environment": environment(model_config), "settings": settings, "configs": configs, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
