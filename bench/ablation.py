"""What moves own-draft TPF: one training run per variant of a recipe, side by side, each with the acceptance its
training stage measured on held-out prompts as it trained (docs/TRAINING.md, "Acceptance during training").

    python -m bench.ablation configs/campaign/cpu-ablation.yaml                       # every variant, in order
    python -m bench.ablation configs/campaign/cpu-ablation.yaml --variants base lr-3e-4
    python -m bench.ablation configs/campaign/cpu-ablation.yaml --report-only         # tabulate what has run

A variant is a list of `--set` overrides of the recipe. Every variant runs in the recipe's work_dir through the
flow (trajectories -> packing -> training), so variants with the same trajectory settings share one trajectory
store, and a finished variant is reused: a rerun runs only what is missing. `--set` applies to every variant.
Writes `<out>/ablation.json`, `ablation.md` (one row per variant: training tokens and minutes, the final simulated
and decoded TPF at each block size, noisy accuracy, the share of held-out answers left unchanged, their repetition
beside the trajectories') and `ablation.png` (simulated TPF against training tokens, one line per variant).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from jfcore.config import apply_overrides, load_file
from jfcore.contracts import ACCEPTANCE, LAUNCH_FILE, METRICS
from jfcore.training.checkpoints import read_metrics

# The memorise-32 diagnosis's settings, which its variants change one at a time.
MEMORISE = [
    "prompts.limit=32",
    "packing.heldout_fraction=0.25",
    "training.max_steps=240",
    "training.learning_rate=3.0e-4",
    "training.lr_schedule=constant",
]
# name -> (overrides, what it varies). The recipe's own settings are `base`.
RECIPE_2H = [  # the ablation's variant recipe-2h; recipe-72m and RECIPE_600 override its amounts (later win)
    "training.ar_weight=0.1",
    "training.consistency_offsets=2",
    "packing.max_noise=0.5",
    "packing.samples_per_prompt=6",
    "training.lr_schedule=constant",
    "training.max_steps=1400",
    "training.checkpoint_every=100",
    "training.acceptance.every=100",
]
# recipe-2h on 512 prompts, 9 states per block, for 600 steps with the repeat penalty: the penalty runs' common part.
RECIPE_600 = [
    *RECIPE_2H,
    "prompts.limit=512",
    "packing.samples_per_prompt=9",
    "training.max_steps=600",
    "training.repeat_unlikelihood=2.0",
]
# recipe-2h's objective on a quarter of the prompts for 200 steps: the block-size variants below change only n.
RECIPE_256 = [*RECIPE_2H, "prompts.limit=256", "training.max_steps=200", "training.acceptance.every=50"]
VARIANTS: dict[str, tuple[list[str], str]] = {
    "base": ([], "the recipe"),
    "ar-10": (["training.ar_weight=10"], "AR weight lambda 10"),
    "ar-0.1": (["training.ar_weight=0.1"], "AR weight lambda 0.1"),
    "ar-0.01": (["training.ar_weight=0.01"], "AR weight lambda 0.01"),
    "ar-prompt": (["training.ar_on_prompt=true"], "L_AR also on the prompt"),
    "lr-3e-5": (["training.learning_rate=3.0e-5"], "learning rate 3e-5"),
    "lr-3e-4": (["training.learning_rate=3.0e-4"], "learning rate 3e-4"),
    "lr-constant": (["training.lr_schedule=constant"], "constant rate after warmup"),
    "lr-3e-4-constant": (
        ["training.learning_rate=3.0e-4", "training.lr_schedule=constant"],
        "learning rate 3e-4, held after warmup",
    ),
    "context-clean": (["training.noisy_context=clean"], "noisy blocks see the fixed points before them"),
    "noise-random": (["packing.strategy=random"], "noise targets drawn at random"),
    "window-16": (["packing.window=16"], "one progressive ramp over 16 blocks"),
    "noise-max-0.5": (["packing.max_noise=0.5"], "noise levels up to 0.5 only"),
    "lora-16": (["training.lora={rank: 16, alpha: 32}", "training.learning_rate=1.0e-3"], "LoRA rank 16, lr 1e-3"),
    "data-256": (["prompts.limit=256"], "a quarter of the prompts, so 4x the epochs"),
    "math-256": (
        ["prompts.path=../shared/data/prompts/gsm8k_train.jsonl", "prompts.limit=256"],
        "GSM8K prompts only (against data-256: mixed)",
    ),
    "block-4": (["trajectories.block_size=4", "packing.window=4", "prompts.limit=256"], "n = 4 (256 prompts)"),
    "block-16": (["trajectories.block_size=16", "packing.window=16", "prompts.limit=256"], "n = 16 (256 prompts)"),
    "fixed-point": (["training.consistency_target=fixed_point"], "noisy logits learn the fixed point's tokens"),
    "offsets-2": (
        ["training.consistency_offsets=2"],
        "consistency pairs at offsets 0 and 1 past the first mismatch only",
    ),
    # Combinations of the single changes that helped, towards a recipe.
    "ar-0.01+fixed-point": (
        ["training.ar_weight=0.01", "training.consistency_target=fixed_point"],
        "AR weight 0.01, fixed-point targets",
    ),
    "ar-0.01+noise-random": (
        ["training.ar_weight=0.01", "packing.strategy=random"],
        "AR weight 0.01 and random noise targets",
    ),
    "ar-0.01+lr-3e-4": (["training.ar_weight=0.01", "training.learning_rate=3.0e-4"], "AR weight 0.01 and lr 3e-4"),
    "ar-0.01+offsets-2": (
        ["training.ar_weight=0.01", "training.consistency_offsets=2"],
        "AR weight 0.01, pairs at offsets 0 and 1 only",
    ),
    "ar-0.1+noise-random": (["training.ar_weight=0.1", "packing.strategy=random"], "AR weight 0.1 and random noise"),
    "ar-0.01+noise-random-400": (
        ["training.ar_weight=0.01", "packing.strategy=random", "training.max_steps=400"],
        "AR weight 0.01, random noise, 400 steps (1.7 epochs)",
    ),
    # A diagnosis, not a recipe: can the objective teach long drafts on text the model has seen many times? If
    # not even there, the objective, mask or data has a defect; if so, what is missing is generalisation.
    "memorise-32": (
        MEMORISE,
        "32 prompts, a quarter held out (9), 45 epochs over the other 21 (constant lr 3e-4)",
    ),
    "memorise-32-samples-8": (
        [*MEMORISE, "packing.samples_per_prompt=8"],
        "memorise-32 with 8 sequences per prompt, each with other noisy states (5.7 epochs over them)",
    ),
    "memorise-32-context-clean": (
        [*MEMORISE, "training.noisy_context=clean"],
        "memorise-32 with noisy blocks on the fixed points before them, as single-block decoding sees them",
    ),
    "samples-4": (
        ["prompts.limit=256", "packing.samples_per_prompt=4"],
        "256 prompts, 4 sequences each with other noisy states (against data-256: one, 3.2 epochs)",
    ),
    "samples-4+offsets-2+lr-3e-4-constant": (
        [
            "prompts.limit=256",
            "packing.samples_per_prompt=4",
            "training.consistency_offsets=2",
            "training.learning_rate=3.0e-4",
            "training.lr_schedule=constant",
        ],
        "samples-4, pairs at offsets 0 and 1 only, lr 3e-4 held after warmup",
    ),
    # The single changes that helped at lambda 0.1, together, for the 2-hour budget: 6 passes over the trained
    # prompts, each pass with other noisy states (memorise-32-samples-8: a repeated state is learnt, not drafted).
    "recipe-2h": (
        RECIPE_2H,
        "lambda 0.1, offsets 0-1, noise <= 0.5, 6 states per block, constant lr 1e-4, 1400 steps (about 2 h)",
    ),
    # recipe-2h on half the prompts, each in 9 noisy states, for 1000 steps: 72 minutes instead of 98, drafts a little
    # below recipe-2h's (held out, Jacobi n = 8: 1.55 against 1.65), measured beside the base model
    # (bench/published/recipe-cpu-2026-12-01), and its text repeats itself past the registry gate.
    "recipe-72m": (
        [*RECIPE_2H, "prompts.limit=512", "packing.samples_per_prompt=9", "training.max_steps=1000"],
        "recipe-2h on 512 prompts, 9 states per block, 1000 steps (72 min)",
    ),
    # recipe-72m for 600 steps with the copy and repeat penalties, the first to draft at its level inside the gate
    # (bench/published/repeat-penalty-cpu-2026-12-06); the shipped recipe until recipe-repeat-penalty.
    "recipe-penalties": (
        [*RECIPE_600, "training.copy_unlikelihood=1.0"],
        "recipe-72m for 600 steps with the copy (beta 1) and repeat (beta 2) penalties",
    ),
    # The shipped recipe (configs/campaign/cpu-2h.yaml): recipe-penalties without the copy penalty, which cost the
    # drafts and the text both (bench/published/repeat-only-cpu-2026-12-06).
    "recipe-repeat-penalty": (
        RECIPE_600,
        "recipe-penalties without the copy penalty (the repeat penalty alone, beta 2): configs/campaign/cpu-2h.yaml",
    ),
    # The block size again, with the recipe's objective instead of the base's.
    "block-8-recipe": (RECIPE_256, "recipe-2h's objective at n = 8 (256 prompts), 200 steps"),
    "block-16-recipe": (
        [*RECIPE_256, "trajectories.block_size=16", "packing.window=16"],
        "recipe-2h's objective at n = 16 (256 prompts), 200 steps",
    ),
    # The objective's teacher: a frozen copy of the starting model instead of the model's own clean logits, with
    # L_AR as KL to it (training.teacher). Meant to hold the text; it did not
    # (bench/published/frozen-teacher-cpu-2026-12-05). The lambda 0.1 one has not run.
    "block-8-recipe+frozen": (
        [*RECIPE_256, "training.teacher=frozen", "training.ar_weight=1"],
        "block-8-recipe with a frozen teacher, L_AR = KL to it, lambda 1",
    ),
    "block-8-recipe+frozen-0.1": (
        [*RECIPE_256, "training.teacher=frozen"],
        "block-8-recipe with a frozen teacher, L_AR = KL to it, lambda 0.1",
    ),
    # Can a firmer hold on the frozen teacher keep the text, and what do the drafts pay for it?
    "block-8-recipe+frozen-10": (
        [*RECIPE_256, "training.teacher=frozen", "training.ar_weight=10"],
        "block-8-recipe with a frozen teacher, L_AR = KL to it, lambda 10",
    ),
    # Keep the greedy text and nothing more: the frozen teacher's targets, L_AR a hinge that holds each fixed point's
    # token as the argmax by 1 logit (training.ar_loss margin), which leaves the rest of the distribution free.
    "block-8-recipe+frozen-margin": (
        [*RECIPE_256, "training.teacher=frozen", "training.ar_loss=margin", "training.ar_weight=1"],
        "block-8-recipe with a frozen teacher, L_AR = argmax hinge (margin 1 logit), lambda 1",
    ),
    "block-8-recipe+margin": (
        [*RECIPE_256, "training.ar_loss=margin", "training.ar_weight=1"],
        "block-8-recipe with its own teacher, L_AR = argmax hinge (margin 1 logit), lambda 1",
    ),
    # The drafts learn copies that prompt lookup gives the decoder anyway, and copying shows in the text
    # (bench.confidence_probe). Leave those pairs out of L_pc (training.consistency_copies).
    "block-8-recipe+skip-copies": (
        [*RECIPE_256, "training.consistency_copies=skip"],
        "block-8-recipe without the consistency pairs whose token prompt lookup would copy",
    ),
    # The drafts' gain comes with a bias to copy earlier text wrongly, which the text then shows as repetition
    # (bench.confidence_probe); ask the clean stream not to (training.copy_unlikelihood).
    "block-8-recipe+copy-penalty": (
        [*RECIPE_256, "training.copy_unlikelihood=1.0"],
        "block-8-recipe with the copy penalty (beta 1) on the clean stream",
    ),
    # With the copy penalty, the text still falls into short loops (a newline after a newline) on prompts unlike the
    # training ones; ask the clean stream not to repeat its last few tokens where it goes on (training.repeat_unlikelihood).
    "block-8-recipe+copy-and-repeat-penalties": (
        [*RECIPE_256, "training.copy_unlikelihood=1.0", "training.repeat_unlikelihood=2.0"],
        "block-8-recipe with the copy penalty (beta 1) and the repeat penalty (beta 2) on the clean stream",
    ),
    "on-policy": (
        ["model.name_or_path={base}/final", "prompts.limit=256"],
        "base, then a second round on trajectories its model made (256 prompts)",
    ),
}
TARGET = 1.6  # the own-draft TPF the recipe is after (n <= 8)
# A variant that continues another: `{name}` in its overrides is that variant's (last) training folder, and its
# curve follows that variant's.
CONTINUES = {"on-policy": "base"}


def run_variant(source: str, name: str, overrides: list[str], folders: dict[str, list[str]]) -> list[str]:
    """Run one variant through the flow (reused when finished); the training run folders of its curve."""
    from flows.jacobi_forcing import jacobi_forcing

    before = folders[CONTINUES[name]] if name in CONTINUES else []
    own = [o.format(**{CONTINUES[name]: before[-1]}) if before else o for o in VARIANTS[name][0]]
    recipe = apply_overrides(load_file(source), [*own, *overrides])
    result = jacobi_forcing(recipe, stages=["trajectories", "packing", "training"])
    return before + [stage.training.folder for stage in result.stages.values()]


def figures(folders: list[str]) -> dict:
    """A variant's curve (its stages one after another) and final figures, from the files its training wrote."""
    curve, tokens_before, seconds, final = [], 0, 0.0, {}
    for folder in map(Path, folders):
        steps = read_metrics(folder / METRICS)
        for record in read_metrics(folder / ACCEPTANCE):
            if record.get("decoded"):
                final |= {k: v for k, v in record.items() if k.startswith("heldout/")}
            else:
                curve.append({**record, "tokens": tokens_before + record["tokens"]})
                final |= {k: v for k, v in record.items() if k.startswith("heldout/")}
        tokens_before += sum(r["tokens"] for r in steps)
        seconds += sum(r["tokens"] / r["tokens_per_second"] for r in steps)
        training = json.loads((folder / LAUNCH_FILE).read_text())["training"]
    return {"curve": curve, "final": final, "tokens": tokens_before, "minutes": seconds / 60, "training": training}


def tokens_to_reach(curve: list[dict], n: int, target: float) -> float | None:
    """Training tokens at which a least-squares line through (log10 tokens, simulated TPF at n) of the curve's
    trained points reaches `target`: a crude extrapolation, None where the line does not rise. (The table calls a
    reach past 1e12 tokens flat: no CPU run gets near it.)"""
    points = [(math.log10(p["tokens"]), p[f"heldout/simulated_tpf_n{n}"]) for p in curve if p["tokens"] > 0]
    if len(points) < 2:
        return None
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return 10 ** (mx + (target - my) / slope) if slope > 0 else None


def markdown(results: dict, block_sizes: list[int]) -> str:
    head = ["variant", "what", "training tokens", "minutes"]
    head += [f"simulated n{n}" for n in block_sizes] + [f"decoded n{n}" for n in block_sizes]
    head += [f"rolling n{n}" for n in block_sizes] + [f"multiblock n{n}" for n in block_sizes]
    head += ["noisy accuracy", "at offset 0", "uncopyable", "text kept", "answers unchanged"]
    head += ["repetition (trajectories')"]
    head += [f"tokens to TPF {TARGET} at n8 (fit)"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for name, r in results.items():
        f = r["final"]

        def cell(key: str, f=f) -> str:
            return f"{f[key]:.3f}" if key in f else "-"

        cells = [name, VARIANTS[name][1], f"{r['tokens']:,}", f"{r['minutes']:.0f}"]
        cells += [cell(f"heldout/simulated_tpf_n{n}") for n in block_sizes]
        cells += [cell(f"heldout/decoded_tpf_n{n}") for n in block_sizes]
        cells += [cell(f"heldout/decoded_{kind}_tpf_n{n}") for kind in ("rolling", "multiblock") for n in block_sizes]
        kept = ("noisy_accuracy", "noisy_accuracy_at_0", "noisy_accuracy_uncopyable", "text_kept", "greedy_unchanged")
        cells += [cell(f"heldout/{k}") for k in kept]
        both = "heldout/repetition" in f and "heldout/reference_repetition" in f
        cells.append(f"{cell('heldout/repetition')} ({cell('heldout/reference_repetition')})" if both else "-")
        reach = tokens_to_reach(r["curve"], 8, TARGET) if 8 in block_sizes else None
        cells.append("- (flat)" if reach is None or reach > 1e12 else f"{reach:.2g}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, block_sizes: list[int], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * len(block_sizes), 4.2), layout="constrained")
    axes = fig.subplots(1, len(block_sizes), squeeze=False)[0]
    for ax, n in zip(axes, block_sizes):
        for i, (name, r) in enumerate(results.items()):
            points = [
                (p["tokens"], p[f"heldout/simulated_tpf_n{n}"])
                for p in r["curve"]
                if f"heldout/simulated_tpf_n{n}" in p
            ]
            if points:
                ax.plot(*zip(*points), marker=".", color=f"C{i % 10}", ls=("-", "--")[i // 10 % 2], label=name)
        ax.set(title=f"held-out simulated Jacobi TPF, n = {n}", xlabel="training tokens", ylabel="tokens per forward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="e.g. configs/campaign/cpu-ablation.yaml")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="NAME")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override every variant")
    parser.add_argument("--report-only", action="store_true", help="tabulate finished variants, run nothing")
    parser.add_argument("--out", type=Path, default=Path("bench/results/ablation"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    index = args.out / "folders.json"  # variant -> its training run folders, kept across invocations
    folders = json.loads(index.read_text()) if index.is_file() else {}
    for name in args.variants:
        if not args.report_only:
            folders[name] = run_variant(args.recipe, name, args.set, folders)
            index.write_text(json.dumps(folders, indent=1))
    results = {name: figures(folders[name]) for name in VARIANTS if name in folders}
    if not results:
        raise SystemExit(f"no variant has run yet (none in {index})")
    block_sizes = sorted(
        {int(k.rsplit("_n", 1)[1]) for r in results.values() for k in r["final"] if "simulated_tpf_n" in k}
    )
    (args.out / "ablation.json").write_text(json.dumps({"recipe": args.recipe, "variants": results}, indent=1))
    table = markdown(results, block_sizes)
    (args.out / "ablation.md").write_text(table)
    plot(results, block_sizes, args.out / "ablation.png")
    print(table)
    print(f"wrote {args.out}/ablation.{{json,md,png}}")


if __name__ == "__main__":
    main()
