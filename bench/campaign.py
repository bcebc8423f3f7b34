"""The method end to end on one machine, phase by phase: trajectories -> packing -> training -> evaluation.

    python -m bench.campaign --profile smoke                 # tiny random model, about a minute (CI)
    python -m bench.campaign --profile cpu-long              # SmolLM2, CPU, float32, n=16: the learning curve
    python -m bench.campaign --profile gpu                   # SmolLM2, bf16, n=16 -> n=32 curriculum, one GPU
    python -m bench.campaign --profile gpu --phase training --stage n16    # one phase of one stage
    python -m bench.campaign --profile gpu --flow            # the same recipe through the Prefect flow first
    python -m bench.campaign --profile cpu-long --set work_dir=/data/run --set training.max_steps=100

A profile is a pipeline recipe (`flows/recipe.py`: model, prompts, trajectories, packing, training,
launch, evaluation, curriculum) plus a `campaign` section (see `CampaignSettings`);
`--profile NAME` reads `configs/campaign/NAME.yaml`, any other value is a file path.

Phases, in order; `--phase all` (the default) runs every one that is not finished:
- trajectories, packing, training: per curriculum stage, through the same stage functions the
  flow runs (`tasks.trajectories`, `tasks.packing`, `tasks.training` with the DeepSpeed
  launcher). Without Ray they run in this process; without Prefect or MLflow nothing changes.
- evaluation: the learning curve (the base model, every export the training wrote at
  `training.export_steps`, and each stage's final model, each decoded with its stage's block
  size, speedups against its own HF greedy), then the recipe's evaluation (base vs the last
  stage's model side by side) and the float32 exactness check.
- report: `report/results.{json,md}` and plots (TPF vs training tokens; speedup vs accuracy).

Every phase resumes from its own outputs: trajectory shards and evaluation shards in their
manifests, training from its newest checkpoint. Progress (shards and rows, steps, tokens/s,
ETA) goes to stdout and `campaign.log` in the work folder.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from flows.recipe import Recipe, load_recipe
from jfcore.config import ConfigError, apply_overrides, from_dict, replace_checked
from jfcore.contracts import (
    EXPORT_METADATA,
    EXPORTS,
    FINAL,
    MANIFEST,
    METRICS,
    PACKING,
    SETS,
    STATS,
    TRAINING,
    TRAJECTORIES,
)
from jfcore.evaluation.benchmarks import BenchmarkConfig
from jfcore.evaluation.config import EvalConfig, EvalModel
from jfcore.models import ModelLoadError, load_tokenizer
from tasks.plan import StagePlan

REPO = Path(__file__).resolve().parents[1]
PROFILES = REPO / "configs" / "campaign"
PHASES = ("trajectories", "packing", "training", "evaluation", "report")
STATE = "campaign.json"  # per phase: seconds spent, per invocation


@dataclass(frozen=True)
class CurveSettings:
    """The learning-curve evaluation: the same problems for every point."""

    benchmarks: tuple[BenchmarkConfig, ...]
    max_new_tokens: int = 128


@dataclass(frozen=True)
class CampaignSettings:
    tiny_model: bool = False  # build a tiny random model (bench.tiny_model) at model.name_or_path when missing
    curve: CurveSettings | None = None  # evaluate the base model, every export and each stage's final model
    final_evaluation: bool = True  # the recipe's evaluation: base vs the last stage's model, side by side
    fp32_check: int = 0  # problems decoded in float32 by the final model with every method (exact vs greedy)
    peak_flops: float | None = None  # the accelerator's dense bf16 FLOP/s for MFU; default: known GPUs


@dataclass(frozen=True)
class Campaign:
    recipe: Recipe
    settings: CampaignSettings
    source: str  # the profile file
    overrides: tuple[str, ...] = ()  # --set KEY=VALUE, in order

    @property
    def command(self) -> str:
        """The command line that reproduces this campaign."""
        sets = "".join(f" --set {shlex.quote(item)}" for item in self.overrides)
        return f"python -m bench.campaign --profile {self.source}{sets}"

    @property
    def work_dir(self) -> Path:
        return Path(self.recipe.work_dir).expanduser().resolve()


def load_campaign(profile: str, overrides: list[str] | None = None) -> Campaign:
    path = PROFILES / f"{profile}.yaml" if (PROFILES / f"{profile}.yaml").is_file() else Path(profile)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.yaml")))
        raise ConfigError(f"profile {profile!r}: no file {path}; use one of {known} or a YAML path")
    data = apply_overrides(yaml.safe_load(path.read_text()) or {}, overrides or [])
    settings = from_dict(CampaignSettings, data.pop("campaign", None) or {}, "campaign")
    shown = path.resolve().relative_to(REPO) if path.resolve().is_relative_to(REPO) else path
    return Campaign(load_recipe(data), settings, str(shown), tuple(overrides or ()))


class Log:
    """Lines to stdout and to campaign.log in the work folder, with paths as configured rather than as resolved
    on this machine (the log is published): the work folder as the profile names it, the repository's files
    relative to it, and the Python installation as `<python>`."""

    def __init__(self, folder: Path, configured: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.file = open(folder / "campaign.log", "a", buffering=1)  # noqa: SIM115 (lives as long as the run)
        self.paths = {str(folder): configured, f"{REPO}/": "", sys.base_prefix: "<python>"}

    def portable(self, line: str) -> str:
        for machine, configured in self.paths.items():
            line = line.replace(machine, configured)
        return line

    def __call__(self, line: str) -> None:
        stamped = f"{time.strftime('%H:%M:%S')} {self.portable(line)}"
        print(stamped, flush=True)
        self.file.write(stamped + "\n")


def _record(campaign: Campaign, phase: str, seconds: float, **figures) -> None:
    path = campaign.work_dir / STATE
    state = json.loads(path.read_text()) if path.is_file() else {}
    state.setdefault(phase, []).append({"seconds": seconds, "finished": time.strftime("%Y-%m-%d %H:%M:%S"), **figures})
    path.write_text(json.dumps(state, indent=1))


def run_trajectories(campaign: Campaign, plan: StagePlan, log: Log) -> str:
    from tasks.trajectories import generate_trajectories

    r = campaign.recipe
    selection = generate_trajectories(
        plan.model, plan.prompts, plan.trajectories, r.ray, plan.path(TRAJECTORIES), r.prompts_per_shard, log=log
    )
    return str(selection)


def latest_trajectories(plan: StagePlan) -> Path:
    """The newest trajectory selection file (or finished run folder, as older versions wrote them)."""
    folder = plan.path(TRAJECTORIES)
    done = list(folder.glob(f"*/{SETS}/*.json"))
    done += [p.parent for p in folder.glob(f"*/{MANIFEST}") if json.loads(p.read_text()).get("complete")]
    if not done:
        raise ConfigError(f"stage {plan.name}: no finished trajectories under {folder}; run --phase trajectories first")
    return max(done, key=lambda p: p.stat().st_mtime)


def run_packing(campaign: Campaign, plan: StagePlan, log: Log) -> dict:
    from tasks.packing import pack_trajectories

    trajectories, stats_file = latest_trajectories(plan), plan.path(PACKING) / STATS
    made = (trajectories if trajectories.is_file() else trajectories / MANIFEST).stat().st_mtime
    if stats_file.is_file() and stats_file.stat().st_mtime > made:
        log(f"packed already: {stats_file}")
        return json.loads(stats_file.read_text())
    pad = load_tokenizer(plan.model).pad_token_id
    stats = pack_trajectories(trajectories, plan.path(PACKING), replace_checked(plan.packing, pad_token_id=pad))
    log(
        f"packed {stats['sequences']} sequences, {stats['tokens']} tokens; "
        f"{100 * stats['consistency_share']:.0f}% of blocks carry consistency loss"
    )
    return stats


def run_training_phase(campaign: Campaign, plan: StagePlan, log: Log) -> None:
    from tasks.training import run_training

    train = replace_checked(plan.training, data=str(plan.path(PACKING)))
    if (Path(train.output_dir) / FINAL / EXPORT_METADATA).is_file():
        log(f"trained already: {Path(train.output_dir) / FINAL} (delete it to train again)")
        return
    run_training(train, campaign.recipe.launch, log=log)


def curve_points(campaign: Campaign) -> list[dict]:
    """Every model on the learning curve, in training order: base, then each stage's exports and final model."""
    r = campaign.recipe
    plans = r.stages()
    points = [
        {
            "label": "base",
            "stage": plans[0].name,
            "step": 0,
            "model": r.model,
            "block_size": plans[0].trajectories.block_size,
        }
    ]
    for plan in plans:
        train = plan.path(TRAINING)
        exports = sorted((train / EXPORTS).glob("step-*/config.json")) if (train / EXPORTS).is_dir() else []
        final_steps = None
        if (train / FINAL / EXPORT_METADATA).is_file():
            final_steps = json.loads((train / FINAL / EXPORT_METADATA).read_text())["steps"]
        for folder in [e.parent for e in exports] + ([train / FINAL] if final_steps else []):
            step = final_steps if folder.name == FINAL else int(folder.name.removeprefix("step-"))
            if folder.name != FINAL and step == final_steps:
                continue  # the final model is this export
            points.append(
                {
                    "label": f"{plan.name}@{step}",
                    "stage": plan.name,
                    "step": step,
                    "model": replace_checked(r.model, name_or_path=str(folder), gguf_file=None),
                    "block_size": plan.trajectories.block_size,
                }
            )
    return points


def run_evaluate(campaign: Campaign, log: Log) -> dict:
    from tasks.evaluation import run_evaluation

    r, s = campaign.recipe, campaign.settings
    results: dict = {"curve": {}, "final": None, "fp32_check": None}
    if s.curve:
        for point in curve_points(campaign):
            n = point["block_size"]
            decoding = replace_checked(
                r.evaluation.decoding, block_size=n, ngram_size=n, max_new_tokens=s.curve.max_new_tokens
            )
            config = EvalConfig(
                str(campaign.work_dir / "curve"),
                {point["label"]: EvalModel(point["model"])},
                s.curve.benchmarks,
                point["label"],
                decoding,
                r.evaluation.problems_per_shard,
                r.evaluation.data_dir,
                r.evaluation.unsafe_no_isolation,
            )
            log(f"learning curve: {point['label']} (block size {n})")
            results["curve"][point["label"]] = _summary(run_evaluation(config, r.ray, log=log))
    final = r.final_model()
    if s.final_evaluation:
        log(f"final evaluation: base vs {final}")
        results["final"] = _summary(run_evaluation(r.eval_config(final), r.ray, log=log))
    if s.fp32_check:
        model = replace_checked(r.model, name_or_path=final, gguf_file=None, dtype="float32")
        benchmarks = tuple(replace_checked(b, limit=s.fp32_check) for b in r.evaluation.benchmarks[:1])
        decoding = replace_checked(r.evaluation.decoding, max_new_tokens=min(r.evaluation.decoding.max_new_tokens, 128))
        config = EvalConfig(
            str(campaign.work_dir / "fp32-check"),
            {"trained-fp32": EvalModel(model)},
            benchmarks,
            "trained-fp32",
            decoding,
            r.evaluation.problems_per_shard,
            r.evaluation.data_dir,
            r.evaluation.unsafe_no_isolation,
        )
        log(f"float32 exactness check: {s.fp32_check} problems")
        results["fp32_check"] = _summary(run_evaluation(config, r.ray, log=log))
    return results


def _summary(result) -> dict:
    return {"folder": result.folder, "report": result.report, "table": result.table, "exact": result.exact}


def environment() -> dict:
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cores": _cores(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run_report(campaign: Campaign, evaluation: dict, log: Log) -> Path:
    from bench.campaign_report import write_report

    folder = campaign.work_dir / "report"
    state = json.loads((campaign.work_dir / STATE).read_text()) if (campaign.work_dir / STATE).is_file() else {}
    training = {plan.name: _training_figures(campaign, plan) for plan in campaign.recipe.stages()}
    write_report(folder, campaign, evaluation, training, state, environment())
    log(f"report: {folder / 'results.md'}")
    return folder


def _training_figures(campaign: Campaign, plan: StagePlan) -> dict:
    """Tokens per step and throughput from metrics.jsonl; model FLOPs utilisation on a known accelerator."""
    path = plan.path(TRAINING) / METRICS
    rows = [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []
    figures: dict = {
        "steps": len(rows),
        "tokens_by_step": [r["tokens"] for r in rows],
        "loss": [[r["step"], r["loss"], r["ar_loss"], r["consistency_loss"]] for r in rows],
    }
    if rows:
        rates = sorted(r["tokens_per_second"] for r in rows[1:] or rows)
        figures["tokens_per_second"] = rates[len(rates) // 2]  # median, the first step's warm-up left out
        figures["tokens"] = sum(r["tokens"] for r in rows)
        params, peak = _parameter_count(plan), campaign.settings.peak_flops or _peak_flops()
        if params and peak:  # 6 N FLOPs per trained token (forward + backward), attention left out
            figures["mfu"] = 6 * params * figures["tokens_per_second"] / peak
            figures["parameters"] = params
    return figures


def _parameter_count(plan: StagePlan) -> int | None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    final = plan.path(TRAINING) / FINAL
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


def run(campaign: Campaign, phase: str, stage: str | None, log: Log) -> None:
    r = campaign.recipe
    plans = [p for p in r.stages() if stage in (None, p.name)]
    if not plans:
        raise ConfigError(f"--stage {stage!r}: the profile's stages are {', '.join(p.name for p in r.stages())}")
    if campaign.settings.tiny_model and not Path(r.model.name_or_path).expanduser().is_dir():
        from bench.tiny_model import make_tiny_model

        log(f"building the tiny model at {make_tiny_model(Path(r.model.name_or_path).expanduser())}")
    steps = {"trajectories": run_trajectories, "packing": run_packing, "training": run_training_phase}
    chosen = [p for p in PHASES if phase in ("all", p)]
    for plan in plans:  # stage by stage: a curriculum stage starts from the previous stage's model
        for name in (n for n in chosen if n in steps):
            _timed(campaign, f"{name}/{plan.name}", log, steps[name], campaign, plan, log)
    if "evaluation" in chosen:
        evaluation = _timed(campaign, "evaluation", log, run_evaluate, campaign, log)
        (campaign.work_dir / "evaluation.json").write_text(json.dumps(evaluation, indent=1, default=str))
    if "report" in chosen:
        path = campaign.work_dir / "evaluation.json"
        if not path.is_file():
            raise ConfigError(f"no evaluation results at {path}; run --phase evaluation first")
        run_report(campaign, json.loads(path.read_text()), log)


def _timed(campaign: Campaign, phase: str, log: Log, work, *args):
    log(f"== {phase}")
    began = time.perf_counter()
    result = work(*args)
    seconds = time.perf_counter() - began
    _record(campaign, phase, seconds)
    log(f"== {phase} done in {seconds:.0f} s")
    return result


def run_flow(campaign: Campaign, log: Log) -> None:
    """The recipe's stages through the Prefect flow (orchestrated, tracked when the recipe has a tracking URI)."""
    from flows.jacobi_forcing import jacobi_forcing

    recipe = yaml.safe_load((REPO / campaign.source).read_text())  # source is relative to the repository
    recipe.pop("campaign", None)
    recipe["work_dir"] = str(campaign.work_dir)
    log("running the recipe's stages through the Prefect flow")
    jacobi_forcing(recipe, stages=["trajectories", "packing", "training"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", required=True, help="smoke, cpu-long, gpu, or a YAML path")
    parser.add_argument("--phase", default="all", choices=("all", *PHASES))
    parser.add_argument("--stage", help="only this curriculum stage (trajectories, packing, training)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a profile value")
    parser.add_argument(
        "--flow",
        action="store_true",
        help="run trajectories, packing and training through the Prefect flow first (needs prefect, ray, deepspeed)",
    )
    args = parser.parse_args(argv)
    try:
        campaign = load_campaign(args.profile, args.set)
        log = Log(campaign.work_dir, campaign.recipe.work_dir)
        log(f"campaign {campaign.source}: phase {args.phase}, work dir {campaign.work_dir}")
        if args.flow:
            run_flow(campaign, log)
        run(campaign, args.phase, args.stage, log)
    except (ConfigError, ModelLoadError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
