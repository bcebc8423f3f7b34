"""How often does each decoding method's output differ from HF greedy and from the project's own AR, on real prompts?

    python -m bench.flip_rate                                  # SmolLM2, float32, 50 problems x 4 benchmarks, 128 tokens
    python -m bench.flip_rate --per-benchmark 5 --out bench/results/flip-rate-smoke

Every method is greedy, so any difference is a *flip*: at some position two computations of the same logits rounded
differently and a near-tie went the other way; from there on the texts part. The project's methods differ from
`generate` by their kernels (the linear mode, jfcore/decoding/runner/linear.py, computes some products weight-first), by
forward width (a Jacobi forward scores n positions at once, AR one) and by batching: HF greedy decodes each prompt
alone, the project's methods `--batch` prompts together, as jf-serve does (`--batch 1`: one at a time). Per method this counts the outputs that differ,
the first differing position, and the top-2 logit gap of HF's own forward at that position (a flip at a gap far above
float32 rounding would be a bug, not a tie). Each prompt's tokens are appended to `<out>/tokens.jsonl` as it finishes,
so a rerun resumes; `<out>/flip_rate.json` holds the summary and `flip_rate.md` the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.common import top2_gap
from jfcore.chat import encode_chat
from jfcore.decoding import DecodeConfig, decode, special_tokens
from jfcore.decoding.reference import first_divergence, hf_generate
from jfcore.evaluation.benchmarks import BenchmarkConfig, load_benchmark
from jfcore.models import ModelConfig, load_model, load_tokenizer

BENCHMARKS = ("gsm8k", "humaneval", "mbpp", "math500")
REFERENCE, OWN_AR = "hf_greedy", "ar"
# The project's methods: AR, the fixed parallel configurations, and the lookup configuration jf-tune picks on CPUs.
METHODS: dict[str, dict] = {
    OWN_AR: {"method": "ar"},
    "jacobi-n8": {"method": "jacobi", "block_size": 8},
    "multiblock-n8-k2": {"method": "multiblock", "block_size": 8, "num_blocks": 2, "ngram_size": 8},
    "ar+lookup2": {"method": "ar", "lookup_tokens": 2},
}


def summarize(records: list[dict], methods: list[str]) -> dict:
    summary = {"prompts": len(records), "reference_tokens": sum(len(r["tokens"][REFERENCE]) for r in records)}
    for method in methods:
        for against in (REFERENCE, OWN_AR):
            if method == against:
                continue
            flips = []
            for r in records:
                tokens, ref = r["tokens"][method], r["tokens"][against]
                if tokens != ref:
                    flip = {"problem": r["problem"], "position": first_divergence(tokens, ref)}
                    flips.append(flip | ({"gap": r["gaps"][method]} if against == REFERENCE else {}))
            compared = sum(len(r["tokens"][against]) for r in records)
            summary[f"{method} vs {against}"] = {
                "outputs_differing": len(flips),
                "tokens_compared": compared,
                "flips_per_10k_tokens": round(len(flips) / compared * 1e4, 2) if compared else None,
                "flips": flips,
            }
    return summary


def markdown(summary: dict, methods: list[str]) -> str:
    lines = [
        f"{summary['prompts']} prompts, {summary['reference_tokens']} HF greedy tokens.",
        "",
        "| method | against | outputs differing | flips per 10k tokens | first differing positions | HF top-2 gap there |",
        "|---|---|---:|---:|---|---|",
    ]
    for method in methods:
        for against in (REFERENCE, OWN_AR):
            entry = summary.get(f"{method} vs {against}")
            if entry is None:
                continue
            positions = ", ".join(str(f["position"]) for f in entry["flips"]) or "-"
            gaps = ", ".join(f"{f['gap']:.3g}" for f in entry["flips"] if "gap" in f) or "-"
            lines.append(
                f"| {method} | {against} | {entry['outputs_differing']} / {summary['prompts']} "
                f"| {entry['flips_per_10k_tokens']} | {positions} | {gaps} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--per-benchmark", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="rows the project's methods decode together (HF: one)")
    parser.add_argument("--linear", choices=["auto", "torch"], default="auto")
    parser.add_argument("--out", type=Path, default=Path("bench/results/flip-rate"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = ModelConfig(name_or_path=args.model, dtype="float32", device="cpu")
    model, tokenizer = load_model(config)[0], load_tokenizer(config)
    eos, pad = special_tokens(model, None, tokenizer.pad_token_id)
    problems = [
        p for name in BENCHMARKS for p in load_benchmark(BenchmarkConfig(name=name, limit=args.per_benchmark, seed=0))
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "tokens.jsonl"
    records = [json.loads(line) for line in store.open()] if store.is_file() else []
    done = {record["problem"]: record for record in records}
    todo = [p for p in problems if f"{p.benchmark}/{p.id}" not in done]
    with store.open("a") as file:
        for start in range(0, len(todo), args.batch):
            group = todo[start : start + args.batch]
            prompts = [encode_chat(tokenizer, p.prompt) for p in group]
            outputs = {
                REFERENCE: [hf_generate(model, [prompt], args.max_new_tokens, eos, pad)[0] for prompt in prompts]
            }
            for name, settings in METHODS.items():
                run = DecodeConfig(max_new_tokens=args.max_new_tokens, linear=args.linear, **settings)
                outputs[name] = decode(model, prompts, run, eos_token_id=eos, pad_token_id=pad).sequences
            for j, (problem, prompt) in enumerate(zip(group, prompts)):
                key, tokens = f"{problem.benchmark}/{problem.id}", {name: seqs[j] for name, seqs in outputs.items()}
                ref = tokens[REFERENCE]
                gaps = {
                    name: top2_gap(model, prompt, ref[: first_divergence(seq, ref)])
                    for name, seq in tokens.items()
                    if name != REFERENCE and seq != ref
                }
                done[key] = {"problem": key, "tokens": tokens, "gaps": gaps}
                file.write(json.dumps(done[key]) + "\n")
                print(f"[{len(done)}/{len(problems)}] {key}: {len(ref)} tokens, differ from HF: {list(gaps) or 'none'}")
            file.flush()
    records = [done[f"{p.benchmark}/{p.id}"] for p in problems]
    methods = list(METHODS)
    summary = summarize(records, methods) | {"settings": vars(args) | {"out": str(args.out)}}
    (args.out / "flip_rate.json").write_text(json.dumps(summary, indent=1))
    table = markdown(summary, methods)
    (args.out / "flip_rate.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
