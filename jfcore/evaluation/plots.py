"""The two pictures of an evaluation: speedup against accuracy, and how TPF is spread over samples.

Drawn on bare matplotlib `Figure`s (no pyplot, no global backend), so they work in worker processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jfcore.contracts import ALL

MARKERS = {"hf_greedy": "o", "jacobi": "s", "multiblock": "^"}


def _figure(panels: int, height: float = 3.6):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * panels, height), layout="constrained")
    return fig, fig.subplots(1, panels, squeeze=False)[0]


def speedup_vs_accuracy(table: Sequence[dict], path: Path) -> Path:
    """One panel per benchmark: a point per (model, method) at (speedup, accuracy)."""
    benchmarks = list(dict.fromkeys(r["benchmark"] for r in table if r["benchmark"] != ALL))
    models = list(dict.fromkeys(r["model"] for r in table))
    fig, axes = _figure(len(benchmarks))
    colors = {m: f"C{i}" for i, m in enumerate(models)}
    for ax, benchmark in zip(axes, benchmarks):
        for r in (r for r in table if r["benchmark"] == benchmark and r["speedup"] is not None):
            ax.scatter(
                r["speedup"],
                100 * r["accuracy"],
                s=60,
                color=colors[r["model"]],
                marker=MARKERS.get(r["method"], "D"),
                label=f"{r['model']} / {r['method']}",
            )
        top = max((100 * r["accuracy"] for r in table if r["benchmark"] == benchmark), default=0)
        ax.set_ylim(-2, min(102, top + 10))  # accuracy keeps its zero, so 0% reads as 0%
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")
        ax.set(title=benchmark, xlabel="speedup vs base HF greedy (x)", ylabel="accuracy (%)")
        ax.margins(x=0.2)
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="best")
    fig.suptitle("Speed against quality, per benchmark")
    fig.savefig(path, dpi=120)
    return path


def tpf_distribution(samples: Sequence[dict], path: Path) -> Path:
    """One panel per benchmark: a box per (model, method) of per-sample tokens per forward."""
    benchmarks = list(dict.fromkeys(s["benchmark"] for s in samples))
    pairs = list(dict.fromkeys((s["model"], s["method"]) for s in samples))
    fig, axes = _figure(len(benchmarks), height=4.2)
    for ax, benchmark in zip(axes, benchmarks):
        values = [
            [s["tpf"] for s in samples if s["benchmark"] == benchmark and (s["model"], s["method"]) == pair]
            for pair in pairs
        ]
        ax.boxplot(values, tick_labels=[f"{m}\n{k}" for m, k in pairs], showmeans=True)
        ax.set(title=benchmark, ylabel="tokens per forward (per sample)")
        ax.tick_params(axis="x", labelsize=7, rotation=30)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Tokens per forward: spread over samples (triangle: mean)")
    fig.savefig(path, dpi=120)
    return path
