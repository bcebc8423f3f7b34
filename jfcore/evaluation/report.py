"""From sample rows to the results table: one row per (benchmark, model, method), plus "all" benchmarks.

| column | meaning |
|---|---|
| samples | problems decoded |
| accuracy | share of completions scored correct (pass@1 for code: greedy, one sample) |
| timeouts | completions whose program ran out of its CPU budget (or waited past the wall-clock backstop): failures decided by time, not by a wrong answer |
| tpf | mean over samples of new tokens / decode forwards (the prefill forward is not counted) |
| tps | new tokens / wall seconds of the decode calls, prefill included (end-to-end) |
| decode_tps | new tokens / wall seconds after the prefill |
| speedup_vs_ar | tps / tps of the same model's AR in this project's engine (method `ar`, same kernels) on the same benchmark, measured side by side: what the method adds over one token per forward |
| speedup | tps / tps of the baseline model's HF greedy on the same benchmark, measured side by side: kernels and method together |
| repetition | mean over samples of the share of tokens that close a 4-gram the completion already held (jfcore/evaluation/repetition.py): a loop drafts itself, so a rise here inflates TPF |
| exact | share of samples whose tokens equal the same model's HF greedy tokens (and, timed in several rounds, were the same in every round) |
| round_tps | tps in each timing round (`decoding.timing_rounds`, for `decoding.timed_methods`), the first included; empty for one round |
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from statistics import mean

from jfcore.contracts import ALL, TABLE_METRICS
from jfcore.evaluation.config import REFERENCE, SAME_ENGINE_AR
from jfcore.evaluation.repetition import repeated_share

COLUMNS = ("benchmark", "model", "method", "samples", *TABLE_METRICS)  # a results table row's figures, in order


def summarize(samples: Sequence[dict], baseline: str) -> list[dict]:
    """The results table rows, in the order benchmarks, models and methods first appear in `samples`."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for row in samples:
        for benchmark in (row["benchmark"], ALL):
            groups.setdefault((benchmark, row["model"], row["method"]), []).append(row)
    if len({row["benchmark"] for row in samples}) == 1:  # "all" would repeat the one benchmark
        groups = {key: rows for key, rows in groups.items() if key[0] != ALL}
    table = []
    for (benchmark, model, method), rows in sorted(groups.items(), key=lambda kv: kv[0][0] == ALL):
        tokens = sum(r["new_tokens"] for r in rows)
        decode_seconds = sum(r["decode_seconds"] for r in rows)
        seconds = sum(r["prefill_seconds"] for r in rows) + decode_seconds
        table.append(
            {
                "benchmark": benchmark,
                "model": model,
                "method": method,
                "samples": len(rows),
                "accuracy": mean(r["correct"] for r in rows),
                "timeouts": sum(r["verdict"] == "timeout" for r in rows),
                "tpf": mean(r["tpf"] for r in rows),
                "tps": tokens / seconds if seconds > 0 else 0.0,
                "decode_tps": tokens / decode_seconds if decode_seconds > 0 else 0.0,
                "repetition": mean(repeated_share(r["tokens"]) for r in rows),
                "exact": mean(r["exact"] for r in rows),
                "new_tokens": tokens,
                "seconds": seconds,
                "round_tps": round_tps(rows, tokens),
            }
        )
    reference = {
        row["benchmark"]: row["tps"] for row in table if row["model"] == baseline and row["method"] == REFERENCE
    }
    own_ar = {(row["benchmark"], row["model"]): row["tps"] for row in table if row["method"] == SAME_ENGINE_AR}
    for row in table:
        base = reference.get(row["benchmark"], 0.0)
        row["speedup"] = row["tps"] / base if base > 0 else None
        ar = own_ar.get((row["benchmark"], row["model"]), 0.0)
        row["speedup_vs_ar"] = row["tps"] / ar if ar > 0 else None
    return table


def round_tps(rows: Sequence[dict], tokens: int) -> list[float]:
    """tps in each timing round (decoding.timing_rounds) of every row, the first included; [] for one round."""
    rounds = min(len(r.get("round_seconds") or ()) for r in rows)
    if rounds < 2:
        return []
    return [tokens / sum(r["round_seconds"][k] for r in rows) for k in range(rounds)]


def round_ratios(new: dict, bar: dict) -> list[float]:
    """`new`'s tps over `bar`'s in each timing round: both decoded side by side in it, so the host's drift cancels."""
    return [a / b for a, b in zip(new.get("round_tps") or (), bar.get("round_tps") or ()) if b > 0]


def timed_ratio_lines(table: Sequence[dict], baseline: str) -> list[str]:
    """One line per (benchmark, model, method) timed in several rounds: its speed over the baseline model's, same
    method, in each round. The table's speed columns read the first round only."""
    bars = {(r["benchmark"], r["method"]): r for r in table if r["model"] == baseline and r["round_tps"]}
    lines = []
    for r in table:
        bar = bars.get((r["benchmark"], r["method"]))
        if r["model"] == baseline or bar is None or not (ratios := round_ratios(r, bar)):
            continue
        median = sorted(ratios)[len(ratios) // 2]
        lines.append(
            f"- {r['benchmark']}, {r['method']}: {r['model']} over {baseline} in each of {len(ratios)} interleaved rounds "
            + ", ".join(f"{x:.3f}" for x in ratios)
            + f" (median {median:.3f}x)"
        )
    return lines


def all_exact(samples: Iterable[dict]) -> tuple[int, int]:
    """(samples equal to their model's HF greedy output, samples) over the non-reference methods."""
    checked = [row["exact"] for row in samples if row["method"] != REFERENCE]
    return sum(checked), len(checked)


def markdown_table(table: Sequence[dict], samples: Sequence[dict], baseline: str) -> str:
    """The table as Markdown, with a closing line on exactness against greedy decoding."""

    def times(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    lines = [
        (
            "| benchmark | model | method | samples | accuracy | timeouts | TPF | TPS | decode TPS | vs own AR "
            f"| vs {baseline} HF greedy | repeated 4-grams | = HF greedy |"
        ),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(
            f"| {r['benchmark']} | {r['model']} | {r['method']} | {r['samples']} | {r['accuracy']:.1%} | {r['timeouts']} "
            f"| {r['tpf']:.2f} | {r['tps']:.1f} | {r['decode_tps']:.1f} | {times(r['speedup_vs_ar'])} "
            f"| {times(r['speedup'])} | {r['repetition']:.1%} | {r['exact']:.0%} |"
        )
    equal, total = all_exact(samples)
    verdict = "every one" if equal == total else f"NOT all: {total - equal} differ"
    lines += [
        "",
        f"Parallel decoding vs HF greedy of the same model: {equal}/{total} outputs identical ({verdict}).",
        (
            "vs own AR: over the same model's AR in this project's engine on the same kernels (what the method adds); "
            f"vs {baseline} HF greedy: over transformers' greedy generate (kernels and method together)."
        ),
    ]
    if ratios := timed_ratio_lines(table, baseline):
        lines += ["", "Same method, timed side by side in several rounds:", *ratios]
    return "\n".join(lines)


# What `write_report` puts in its folder.
REPORT_FILES = (
    "results.md",
    "results.json",
    "results.parquet",
    "samples.parquet",
    "plots/speedup_vs_accuracy.png",
    "plots/tpf_distribution.png",
)


def write_report(folder: Path, samples: Sequence[dict], baseline: str) -> dict:
    """Table (Markdown, JSON, Parquet), every sample (Parquet) and the plots, in `folder`; returns the table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jfcore.evaluation import plots

    table = summarize(samples, baseline)
    markdown = markdown_table(table, samples, baseline)
    equal, total = all_exact(samples)
    (folder / "plots").mkdir(parents=True, exist_ok=True)
    (folder / "results.md").write_text(markdown + "\n")
    summary = {"baseline": baseline, "exact": {"equal": equal, "checked": total}, "table": table}
    (folder / "results.json").write_text(json.dumps(summary, indent=1))
    pq.write_table(pa.Table.from_pylist(table), folder / "results.parquet")
    pq.write_table(pa.Table.from_pylist(list(samples)), folder / "samples.parquet")
    plots.speedup_vs_accuracy(table, folder / "plots" / "speedup_vs_accuracy.png")
    plots.tpf_distribution(samples, folder / "plots" / "tpf_distribution.png")
    return summary | {"markdown": markdown}
