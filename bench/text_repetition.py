"""Is a trained model's higher TPF bought by repeating itself? Repetition of each model's greedy completions in an
evaluation report: the share of tokens that close a 4-gram the completion already held (a loop scores near 1,
fresh text near 0), the share of completions that end in a short loop (a newline after a newline, ",,,,") and in
any loop of a period up to 48 tokens (a line or sentence written again and again), beside accuracy and mean length.

    python -m bench.text_repetition runs/ablation/evaluation/<run key>/report

Jacobi drafts of a loop are right by construction, so a model that drifts into loops decodes with a higher TPF
without drafting any better; compare the base and trained rows before crediting training with a speedup.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq

from jfcore.evaluation.repetition import LINE_PERIOD, ends_in_short_loop, repeated_share, short_loop_start


def summarize(report: Path) -> dict:
    rows = pq.read_table(report / "samples.parquet").to_pylist()
    groups = defaultdict(list)
    for r in rows:
        if r["method"] == "hf_greedy":
            groups[(r["benchmark"], r["model"])].append(r)
            groups[("all", r["model"])].append(r)
    return {
        f"{bench}/{model}": {
            "samples": len(rs),
            "repeated_4gram_share": sum(repeated_share(r["tokens"]) for r in rs) / len(rs),
            "short_loop_ends": sum(ends_in_short_loop(r["tokens"]) for r in rs) / len(rs),
            "loop_ends": sum(short_loop_start(r["tokens"], LINE_PERIOD) is not None for r in rs) / len(rs),
            "accuracy": sum(bool(r["correct"]) for r in rs) / len(rs),
            "mean_new_tokens": sum(r["new_tokens"] for r in rs) / len(rs),
        }
        for (bench, model), rs in sorted(groups.items())
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="an evaluation report folder (with samples.parquet)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/text_repetition.json"))
    args = parser.parse_args(argv)
    summary = summarize(args.report)
    print(
        "| benchmark / model | samples | repeated 4-gram share | ending in a short loop | in any loop "
        "| accuracy | mean new tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, s in summary.items():
        print(
            f"| {key} | {s['samples']} | {s['repeated_4gram_share']:.3f} | {s['short_loop_ends']:.3f} "
            f"| {s['loop_ends']:.3f} | {s['accuracy']:.3f} | {s['mean_new_tokens']:.1f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"report": str(args.report), "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
