"""A campaign's results: JSON, a Markdown summary and two plots, from what the flow wrote under a recipe's work_dir.

    python -m bench.campaign_report configs/campaign/smoke.yaml [--set work_dir=...]

Reads only files (no MLflow): each evaluation folder's summary.json, the training runs' metrics.jsonl,
the trajectory shards and timings.jsonl (seconds per stage the flow ran). What it reports:

- learning curve: per point (base, each export, each stage's final model), training tokens and
  steps so far, and per benchmark and method: TPF, speedup over the point's own HF greedy
  (measured side by side), accuracy, exactness, the first token that differs from greedy,
  and the decoder's own overhead (share of decode time outside model forwards);
- acceptance on the held-out prompts while training (acceptance.jsonl): simulated TPF and noisy accuracy
  against training tokens, and the decoded check after the last step;
- throughput: trajectory tokens/s, training tokens/s (and MFU on a known accelerator);
- the final side-by-side evaluation and the float32 exactness check, when run.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path

import pyarrow.parquet as pq

from flows.recipe import Recipe, load_recipe
from jfcore.config import ConfigError, apply_overrides, load_file
from jfcore.contracts import (
    ACCEPTANCE,
    ALL,
    CURVE,
    EVALUATION,
    FINAL,
    FP32_CHECK,
    LATEST,
    METRICS,
    PACKING,
    SUMMARY,
    TIMINGS,
    TRAINING,
    TRAJECTORIES,
    Selection,
)
from jfcore.environment import cpu_model, usable_cores
from jfcore.evaluation.report import COLUMNS
from jfcore.training.checkpoints import read_metrics
from tasks.plan import StagePlan
from tasks.trajectories import newest_selection

PARALLEL = ("jacobi", "multiblock")


def sample_figures(report_dir: str | Path) -> dict[tuple[str, str, str], dict]:
    """(benchmark, model, method) -> first divergence and decoder overhead, from samples.parquet ("all" pooled)."""
    samples = pq.read_table(Path(report_dir) / "samples.parquet").to_pylist()
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for s in samples:
        for benchmark in (s["benchmark"], ALL):
            groups.setdefault((benchmark, s["model"], s["method"]), []).append(s)
    figures = {}
    for key, rows in groups.items():
        decode = sum(r["decode_seconds"] for r in rows)
        forward = sum(r["forward_seconds"] for r in rows)
        divergences = [r["first_divergence"] for r in rows if not r["exact"]]
        figures[key] = {
            "overhead": 1 - forward / decode if decode > 0 else None,
            "diverged": len(divergences),
            "first_divergence_min": min(divergences) if divergences else None,
        }
    return figures


def curve_rows(recipe: Recipe, curve: dict, training: dict) -> list[dict]:
    """One row per (point, benchmark, method) of the learning curve, training tokens included."""
    tokens_before, rows = 0, []
    stage_tokens: dict[str, list[int]] = {}
    for plan in recipe.stages():
        steps = training.get(plan.name, {}).get("tokens_by_step", [])
        stage_tokens[plan.name] = [tokens_before + sum(steps[:i]) for i in range(len(steps) + 1)]
        tokens_before += sum(steps)
    for point in recipe.curve_points():
        result = curve.get(point.label)
        if result is None:
            continue
        cumulative = stage_tokens.get(point.stage, [0])
        tokens = cumulative[min(point.step, len(cumulative) - 1)]
        extra = sample_figures(result["report"])
        for row in result["table"]:
            rows.append(
                {
                    "point": point.label,
                    "stage": point.stage,
                    "step": point.step,
                    "train_tokens": tokens,
                    "block_size": point.block_size,
                    **_cells(row),
                    **extra.get((row["benchmark"], row["model"], row["method"]), {}),
                }
            )
    return rows


def _cells(row: dict) -> dict:
    keys = [c for c in COLUMNS if c not in ("model", "decode_tps")]
    return {k: row.get(k) for k in keys}


def _current_outputs(recipe: Recipe) -> dict[str, Path]:
    """Stage name in timings.jsonl -> the folder this report reads: the newest trajectory store, the latest
    training run."""
    outputs = {}
    for plan in recipe.stages():
        where = f"/{plan.name}" if recipe.curriculum else ""
        try:
            outputs[f"{TRAJECTORIES}{where}"] = Path(
                Selection.read(newest_selection(plan.path(TRAJECTORIES))).store
            ).resolve()
        except ConfigError:  # not generated (yet)
            pass
        if (run := plan.path(TRAINING) / LATEST).exists():
            outputs[f"{TRAINING}{where}"] = run.resolve()
    return outputs


def phase_figures(recipe: Recipe) -> dict:
    """Seconds per stage the flow ran and trajectory throughput in generated tokens/s. A stage's seconds are
    summed over the runs that wrote the output this report reads (a resumed run's pieces); a rerun with other
    settings under the same stage name is left out, and so are the stages of other recipes that share the
    work_dir. Records written before they named their output are summed."""
    path = recipe.path(TIMINGS)
    records = [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []
    outputs = _current_outputs(recipe)
    names = {plan.name for plan in recipe.stages()}
    figures: dict = {}
    for r in records:
        stage, _, name = r["stage"].partition("/")
        if recipe.curriculum and stage in (TRAJECTORIES, PACKING, TRAINING) and name not in names:
            continue
        current = outputs.get(r["stage"])
        if current is not None and r.get("output") is not None and Path(r["output"]) != current:
            continue
        entry = figures.setdefault(r["stage"], {"seconds": 0.0, "invocations": 0})
        entry["seconds"] += r["seconds"]
        entry["invocations"] += 1
    for key, store in outputs.items():
        if not key.startswith(TRAJECTORIES):
            continue
        generated = sum(
            sum(len(f) for f in pq.read_table(p, columns=["fixed_point"])["fixed_point"].to_pylist())
            for p in sorted(store.glob("shard-*.parquet"))
        )
        entry = figures.setdefault(key, {"seconds": None})
        entry["generated_tokens"] = generated
        if entry.get("seconds"):
            entry["tokens_per_second"] = generated / entry["seconds"]
    return figures


def training_figures(plan: StagePlan, peak_flops: float | None) -> dict:
    """Tokens per step and throughput from the newest run's metrics.jsonl; model FLOPs utilisation on a known
    accelerator."""
    run = plan.path(TRAINING) / LATEST
    rows = read_metrics(run / METRICS)
    figures: dict = {
        "steps": len(rows),
        "tokens_by_step": [r["tokens"] for r in rows],
        # [step, loss, ar_loss, consistency_loss, copy_loss, repeat_loss]; older runs give None for the penalties
        "loss": [
            [r["step"], r["loss"], r["ar_loss"], r["consistency_loss"], r.get("copy_loss"), r.get("repeat_loss")]
            for r in rows
        ],
        "acceptance": read_metrics(run / ACCEPTANCE),
    }
    if rows:
        rates = sorted(r["tokens_per_second"] for r in rows[1:] or rows)
        figures["tokens_per_second"] = rates[len(rates) // 2]  # median, the first step's warm-up left out
        figures["tokens"] = sum(r["tokens"] for r in rows)
        params, peak = _parameter_count(run / FINAL), peak_flops or _peak_flops()
        if params and peak:  # 6 N FLOPs per trained token (forward + backward), attention left out
            figures["mfu"] = 6 * params * figures["tokens_per_second"] / peak
            figures["parameters"] = params
    return figures


def _parameter_count(final: Path) -> int | None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (final / "config.json").is_file():
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(final))
    return sum(p.numel() for p in model.parameters())


# Dense bf16 tensor-core peaks (FLOP/s), from the vendors' data sheets (SXM parts).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def _peak_flops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def environment() -> dict:
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "processor": cpu_model(),
        "cores": usable_cores(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def evaluations(recipe: Recipe) -> dict:
    """What the evaluation stage wrote: the side-by-side table, the learning curve, the float32 check."""

    def summary(folder: str) -> dict:
        path = recipe.path(folder) / SUMMARY
        return json.loads(path.read_text()) if path.is_file() else {}

    return {
        "curve": summary(CURVE),
        "final": summary(EVALUATION).get("base_vs_trained"),
        "fp32_check": summary(FP32_CHECK).get("trained-fp32"),
    }


def markdown(
    recipe: Recipe,
    source: str,
    command: str,
    curve: list[dict],
    phases: dict,
    training: dict,
    evaluation: dict,
    env: dict,
) -> str:
    lines = [
        f"# Campaign `{Path(source).stem}`",
        "",
        f"Reproduce: `{command}`, then `{command.replace('flows.run', 'bench.campaign_report', 1)}`.",
        "",
        (
            f"Machine: {env.get('gpu') or env['processor']} ({env['cores']} cores), torch {env['torch']}, "
            f"transformers {env['transformers']}, Python {env['python']}."
        ),
        "",
    ]
    stages = recipe.stages()
    lines += [
        "Stages: "
        + "; ".join(
            f"{p.name}: n={p.trajectories.block_size}, window {p.packing.window}, from {Path(p.model.name_or_path).name}"
            for p in stages
        ),
        "",
    ]
    lines += ["## Throughput", "", "| stage | seconds | figure |", "|---|---:|---|"]
    for phase, f in phases.items():
        figure = (
            f"{f['tokens_per_second']:.0f} generated tokens/s ({f['generated_tokens']} tokens)"
            if f.get("tokens_per_second")
            else ""
        )
        if phase.startswith("training/") and phase.split("/", 1)[1] in training:
            t = training[phase.split("/", 1)[1]]
            if t.get("tokens_per_second"):
                figure = f"{t['tokens_per_second']:.0f} training tokens/s (median step), {t['tokens']} tokens, {t['steps']} steps"
                figure += f", MFU {100 * t['mfu']:.1f}%" if t.get("mfu") else ""
        seconds = f"{f['seconds']:.0f}" if f.get("seconds") is not None else "-"
        lines.append(f"| {phase} | {seconds} | {figure} |")
    if curve:
        lines += [
            "",
            "## Learning curve (pooled over benchmarks)",
            "",
            (
                "Each point is decoded with its stage's block size; speedups are against the same model's AR in "
                "this project's engine (same kernels; '-' where the evaluation ran no `ar`) and its HF greedy, "
                "measured side by side."
            ),
            "",
            (
                "| point | training tokens | method | TPF | vs own AR | vs HF greedy | accuracy | repeated 4-grams "
                "| = greedy | first diff (min) | overhead |"
            ),
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        pooled = [r for r in curve if r["benchmark"] == ALL] or curve
        for r in pooled:
            if r["method"] == "hf_greedy":
                continue
            lines.append(
                f"| {r['point']} | {r['train_tokens']:,} | {r['method']} | {r['tpf']:.3f} "
                f"| {_x(r.get('speedup_vs_ar'))} | {_x(r['speedup'])} "
                f"| {r['accuracy']:.1%} | {_pct(r.get('repetition'))} | {r['exact']:.0%} "
                f"| {_or_dash(r.get('first_divergence_min'))} "
                f"| {_pct(r.get('overhead'))} |"
            )
        lines += [
            "",
            "Per benchmark (TPF jacobi / multiblock):",
            "",
            "| point | " + " | ".join(_benchmarks(curve)) + " |",
            "|---|" + "---:|" * len(_benchmarks(curve)),
        ]
        for point in dict.fromkeys(r["point"] for r in curve):
            cells = []
            for b in _benchmarks(curve):
                tpf = {r["method"]: r["tpf"] for r in curve if r["point"] == point and r["benchmark"] == b}
                cells.append(" / ".join(f"{tpf[m]:.3f}" for m in PARALLEL if m in tpf))
            lines.append(f"| {point} | " + " | ".join(cells) + " |")
    lines += acceptance_lines(training)
    for title, key in (
        ("Final evaluation: base vs trained, side by side", "final"),
        ("Float32 exactness check", "fp32_check"),
    ):
        if evaluation.get(key):
            report = Path(evaluation[key]["report"]) / "results.md"
            lines += ["", f"## {title}", "", report.read_text().strip() if report.is_file() else "(missing)"]
    return "\n".join(lines) + "\n"


def acceptance_lines(training: dict) -> list[str]:
    """The held-out acceptance each stage measured while training, and its decoded check."""
    lines = []
    for stage, figures in training.items():
        records = figures.get("acceptance") or []
        measured = [r for r in records if not r.get("decoded")]
        if not measured:
            continue
        names = sorted({k for r in measured for k in r if k.startswith("heldout/")})
        lines += [
            "",
            f"## Acceptance on held-out prompts while training ({stage})",
            "",
            "| step | training tokens | " + " | ".join(n.removeprefix("heldout/") for n in names) + " |",
            "|---:|---:|" + "---:|" * len(names),
        ]
        for r in measured:
            cells = [f"{r[n]:.3f}" if n in r else "-" for n in names]
            lines.append(f"| {r['step']} | {r['tokens']:,} | " + " | ".join(cells) + " |")
        for r in records:
            if r.get("decoded"):
                shown = ", ".join(
                    f"{k.removeprefix('heldout/')} {v:.3f}" for k, v in r.items() if k.startswith("heldout/")
                )
                lines += ["", f"Decoded by the exported model on the same prompts: {shown}."]
    return lines


ACCURACY_LINES = (  # held-out figure, marker, colour, label
    ("heldout/noisy_accuracy", "o", "C0", "all"),
    ("heldout/noisy_accuracy_at_0", "s", "C1", "offset 0"),
    ("heldout/noisy_accuracy_uncopyable", "v", "C3", "uncopyable"),
    ("heldout/text_kept", "^", "C2", "text kept"),
)


def plot_acceptance(training: dict, path: Path) -> bool:
    """Simulated TPF per block size, noisy accuracy (all, at offset 0, uncopyable) and text kept against training
    tokens, the stages of a curriculum one after another; False when no stage measured any."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6), layout="constrained")
    tpf_ax, acc_ax = fig.subplots(1, 2)
    before, drawn = 0, False
    for i, (stage, figures) in enumerate(training.items()):
        measured = [r for r in figures.get("acceptance") or [] if not r.get("decoded")]
        xs = [before + r["tokens"] for r in measured]
        for j, name in enumerate(sorted({k for r in measured for k in r if k.startswith("heldout/simulated_tpf")})):
            ys = [r.get(name) for r in measured]
            tpf_ax.plot(
                xs,
                ys,
                marker="o",
                color=f"C{j}",
                ls=("-", "--", ":")[i % 3],
                label=f"{stage} {name.removeprefix('heldout/simulated_tpf_')}",
            )
        # Uncopyable: what prompt lookup cannot supply; text kept: the drift beside the drafts (1 = the text as it was).
        for key, marker, color, label in ACCURACY_LINES:
            if any(key in r for r in measured):
                acc_ax.plot(xs, [r.get(key) for r in measured], marker=marker, color=color, label=f"{stage} {label}")
        before += sum(figures.get("tokens_by_step", []))
        drawn = drawn or bool(measured)
    tpf_ax.set(title="held-out simulated Jacobi TPF", xlabel="training tokens", ylabel="tokens per forward")
    acc_ax.set(title="held-out noisy accuracy, text kept", xlabel="training tokens", ylabel="argmax = fixed point")
    for ax in (tpf_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if drawn:
        fig.savefig(path, dpi=120)
    return drawn


def _benchmarks(curve: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["benchmark"] for r in curve))


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pct(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def plot_curve(curve: list[dict], path: Path) -> None:
    """TPF (and speedup) of the parallel methods against training tokens, pooled and per benchmark."""
    from matplotlib.figure import Figure

    benchmarks = _benchmarks(curve)
    fig = Figure(figsize=(4.2 * 2, 3.6 * len(benchmarks)), layout="constrained")
    axes = fig.subplots(len(benchmarks), 2, squeeze=False)
    for (tpf_ax, speed_ax), benchmark in zip(axes, benchmarks):
        for i, method in enumerate(PARALLEL):
            rows = [r for r in curve if r["benchmark"] == benchmark and r["method"] == method]
            xs = [r["train_tokens"] for r in rows]
            tpf_ax.plot(xs, [r["tpf"] for r in rows], marker="o", color=f"C{i}", label=method)
            speed_ax.plot(xs, [r["speedup"] or 0 for r in rows], marker="o", color=f"C{i}", label=method)
        tpf_ax.set(title=f"{benchmark}: tokens per forward", xlabel="training tokens", ylabel="TPF")
        speed_ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        speed_ax.set(title=f"{benchmark}: speedup vs HF greedy", xlabel="training tokens", ylabel="speedup (x)")
        for ax in (tpf_ax, speed_ax):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)


def plot_speed_accuracy(curve: list[dict], path: Path) -> None:
    """Pooled speedup against accuracy, one point per (curve point, method)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 4.2), layout="constrained")
    ax = fig.subplots()
    pooled = [r for r in curve if r["benchmark"] == ALL] or curve
    for i, method in enumerate(("hf_greedy", *PARALLEL)):
        rows = [r for r in pooled if r["method"] == method]
        ax.scatter([r["speedup"] or 0 for r in rows], [100 * r["accuracy"] for r in rows], color=f"C{i}", label=method)
        for r in rows:
            ax.annotate(r["point"], (r["speedup"] or 0, 100 * r["accuracy"]), fontsize=6, alpha=0.7)
    ax.axvline(1.0, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="speedup vs the point's HF greedy (x)", ylabel="accuracy (%)", title="Speed against accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)


def write_report(source: str, overrides: list[str], peak_flops: float | None = None) -> Path:
    """`work_dir/report/`: results.json, results.md and the plots, for the recipe at `source` (with `--set`
    overrides, as the flow ran it)."""
    recipe = load_recipe(apply_overrides(load_file(source), overrides))
    sets = "".join(f" --set {shlex.quote(item)}" for item in overrides)
    command = f"python -m flows.run {source}{sets}"
    folder = recipe.path("report")
    folder.mkdir(parents=True, exist_ok=True)
    evaluation, env = evaluations(recipe), environment()
    training = {plan.name: training_figures(plan, peak_flops) for plan in recipe.stages()}
    curve = curve_rows(recipe, evaluation["curve"], training)
    phases = phase_figures(recipe)
    results = {
        "recipe": source,
        "command": command,
        "environment": env,
        "phases": phases,
        "training": {k: {n: v for n, v in t.items() if n not in ("tokens_by_step",)} for k, t in training.items()},
        "curve": curve,
        "final": evaluation["final"],
        "fp32_check": evaluation["fp32_check"],
    }
    (folder / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (folder / "results.md").write_text(markdown(recipe, source, command, curve, phases, training, evaluation, env))
    plot_acceptance(training, folder / "acceptance_vs_training_tokens.png")
    if curve:
        plot_curve(curve, folder / "tpf_vs_training_tokens.png")
        plot_speed_accuracy(curve, folder / "speedup_vs_accuracy.png")
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="the recipe the flow ran, e.g. configs/campaign/smoke.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="the run's overrides")
    parser.add_argument(
        "--peak-flops", type=float, help="the accelerator's dense bf16 FLOP/s for MFU (default: known GPUs)"
    )
    args = parser.parse_args(argv)
    try:
        folder = write_report(args.recipe, args.set, args.peak_flops)
    except (ConfigError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    print(f"report: {folder / 'results.md'}")


if __name__ == "__main__":
    main()
