"""The pipeline recipe: one file that says what every stage does, checked in full before any stage runs.

The flow fills in what links the stages (each stage's input is the previous
stage's output under `work_dir`), so a recipe names only choices:

    work_dir: runs/smollm2
    model: {name_or_path: smollm2-135m-instruct}
    prompts: {path: builtin, limit: 64}
    trajectories: {block_size: 16, max_new_tokens: 64}
    packing: {strategy: progressive, window: 8}
    training: {epochs: 2, learning_rate: 1.0e-4}   # TrainConfig keys but data, output_dir and model
    tuning: {batch_sizes: [1], max_new_tokens: 96}  # jfcore.tuning.TuneConfig: the trained model's decoding for this machine
    launch: {processes: 2, deepspeed_config: zero2}
    evaluation: {benchmarks: [{name: gsm8k, limit: 20}], decoding: {max_new_tokens: 96}}
    # optional, in evaluation: learning_curve: {benchmarks: [...], max_new_tokens: 96}; fp32_check: 4
    tracking: {uri: http://127.0.0.1:5000, registered_model: jacobi-forcing-smollm2}
    registry: {max_accuracy_drop_problems: 0, min_speedup_gain: 0.0, rounds: 3, require_exact: true, max_repetition_gain: 0.1}
    schedule: {cron: "0 3 * * 0"}
    retrain_from: base                             # or champion: retraining starts from the registry's champion

A block-size curriculum lists stages; each one generates trajectories with the previous
stage's trained model (the first with `model`) at its block size, packs them with its
window and trains from that model, under `work_dir/<stage name>/`:

    curriculum:
      - {name: n16, block_size: 16, window: 16}
      - {name: n32, block_size: 32, window: 16, training: {learning_rate: 5.0e-6}}

Without `curriculum` there is one stage, with `trajectories`, `packing` and `training` as given,
under `work_dir/` itself. Evaluation compares the base model with the last stage's model
(`evaluation.base_vs_trained`); it can also evaluate a learning curve (`evaluation.learning_curve`:
the base model, every training export and each stage's final model, each decoded with its stage's
block size, under `work_dir/curve/`) and check the trained model's float32 decoding against greedy
(`evaluation.fp32_check` problems, under `work_dir/fp32-check/`). The campaign profiles in
configs/campaign/ are such recipes (docs/BENCHMARKS.md, "Campaigns").

Each stage has one name everywhere: its recipe key, its `tasks` module, its Prefect task, its MLflow
run and its folder under `work_dir` (jfcore.contracts).
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from jfcore.config import ConfigError, check, from_dict, load_file, replace_checked, to_dict
from jfcore.contracts import CURVE, EVALUATION, EXPORT_METADATA, EXPORTS, FINAL, FP32_CHECK, LATEST, TRAINING
from jfcore.evaluation.benchmarks import BenchmarkConfig
from jfcore.evaluation.config import DecodingSettings, EvalConfig, EvalModel
from jfcore.models import ModelConfig
from jfcore.packing import PackingConfig
from jfcore.prompts import PromptSource
from jfcore.training.config import TrainConfig
from jfcore.trajectories import TrajectoryConfig
from jfcore.tuning.tuner import TuneConfig
from tasks.plan import StagePlan, training_model
from tasks.ray_workers import RayConfig
from tasks.registry import GateConfig
from tasks.tracking import TrackingConfig
from tasks.training import LaunchConfig

Stage = Literal["trajectories", "packing", "training", "tuning", "evaluation", "registry"]
STAGES: tuple[Stage, ...] = typing.get_args(Stage)
FLOW_LINKED = ("data", "output_dir", "model")  # training keys the flow sets from the other stages
# names of earlier releases: recipe sections and stages
RENAMED = {
    "trajectory": "trajectories",
    "train": "training",
    "gate": "registry",
    "evaluate": "evaluation",
    "register": "registry",
}


@dataclass(frozen=True, kw_only=True)
class LearningCurve:
    """The same problems for every point of the learning curve."""

    benchmarks: tuple[BenchmarkConfig, ...]
    max_new_tokens: int = 128


@dataclass(frozen=True, kw_only=True)
class CurvePoint:
    """One model on the learning curve."""

    label: str  # base, or <stage>@<training step>
    stage: str  # the curriculum stage it belongs to (the first one for the base model)
    step: int  # optimizer steps of its stage behind it (0: the base model)
    model: ModelConfig
    block_size: int  # its stage's block size: the one it is decoded with


@dataclass(frozen=True, kw_only=True)
class EvaluationSection:
    benchmarks: tuple[BenchmarkConfig, ...] = (BenchmarkConfig(name="gsm8k", limit=20, seed=0),)
    decoding: DecodingSettings = field(default_factory=DecodingSettings)
    problems_per_shard: int = 4
    data_dir: str | None = None
    unsafe_no_isolation: bool = False  # model-written programs without OS isolation (README: the sandbox)
    base_vs_trained: bool = True  # the side-by-side evaluation the registry judges; off where the curve covers both
    learning_curve: LearningCurve | None = None  # also evaluate the base model, every export and each stage's final
    fp32_check: int = 0  # problems of the first benchmark the trained model decodes in float32 with every method

    def __post_init__(self) -> None:
        check(self.fp32_check >= 0, f"evaluation.fp32_check: must be >= 0, got {self.fp32_check}")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    cron: str = "0 3 * * 0"  # retraining: Sundays at 03:00
    timezone: str = "UTC"

    def __post_init__(self) -> None:
        check(len(self.cron.split()) == 5, f"schedule.cron: {self.cron!r} is not a 5-field cron expression")


@dataclass(frozen=True, kw_only=True)
class CurriculumStage:
    """One stage of a block-size curriculum: `block_size` and `window` over the recipe's trajectories and packing
    settings, `training` keys over the recipe's training keys."""

    name: str  # its folder under work_dir (and its label in logs and MLflow), e.g. n16
    block_size: int
    window: int | None = None  # packing window; default packing.window
    cut_loops: bool | None = None  # packing.cut_loops for this stage (an on-policy round's own trajectories)
    loop_period: int | None = None  # packing.loop_period for this stage
    max_new_tokens: int | None = None  # trajectory length; default trajectories.max_new_tokens
    prompts_limit: int | None = None  # the first this many prompts of the (shuffled) set; default prompts.limit
    # PromptSource keys over the recipe's `prompts` for this stage's trajectories, e.g. {path: .../mbpp_train.jsonl}
    # for a round on one domain; the held-out slice and the acceptance measured while it trains come from them too.
    prompts: dict[str, Any] = field(default_factory=dict)
    # An earlier stage, decoded on the same prompts, whose text gives this stage's fixed points: its model's own
    # Jacobi iterates run on that text instead of writing its own (docs/TRAINING.md, "Anchored rounds").
    anchor: str | None = None
    training: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check(bool(self.name) and "/" not in self.name, f"name: {self.name!r} must be a plain folder name")
        check(
            self.prompts_limit is None or self.prompts_limit >= 1,
            f"prompts_limit: must be >= 1, got {self.prompts_limit}",
        )
        check(
            self.prompts_limit is None or "limit" not in self.prompts,
            f"curriculum[{self.name}]: prompts_limit and prompts.limit both set; keep one",
        )


@dataclass(frozen=True, kw_only=True)
class Recipe:
    work_dir: str  # every stage writes under it, in a folder named after the stage (jfcore.contracts)
    model: ModelConfig = field(default_factory=ModelConfig)
    prompts: PromptSource = field(default_factory=PromptSource)
    trajectories: TrajectoryConfig = field(default_factory=TrajectoryConfig)
    prompts_per_shard: int = 64
    ray: RayConfig = field(default_factory=RayConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    training: dict[str, Any] = field(default_factory=dict)  # TrainConfig keys but data, output_dir and model
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    tuning: TuneConfig = field(default_factory=TuneConfig)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    registry: GateConfig = field(default_factory=GateConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    curriculum: tuple[CurriculumStage, ...] = ()  # empty: one stage with trajectories, packing and training as given
    retrain_from: Literal["base", "champion"] = "base"  # champion: start from the registry's champion when there is one
    lock_wait_s: float = 3600.0  # a second flow run on this work_dir waits this long for the first, then refuses

    def __post_init__(self) -> None:
        check(bool(self.work_dir), "work_dir: must not be empty")
        for where, keys in [("training", self.training)] + [
            (f"curriculum[{s.name}].training", s.training) for s in self.curriculum
        ]:
            linked = sorted(set(keys) & set(FLOW_LINKED))
            check(
                not linked, f"{where}.{linked[0] if linked else ''}: set by the flow from the other stages; remove it"
            )
        check(self.prompts_per_shard >= 1, f"prompts_per_shard: must be >= 1, got {self.prompts_per_shard}")
        names = [s.name for s in self.curriculum]
        check(len(set(names)) == len(names), f"curriculum: stage names must differ, got {names}")
        for i, stage in enumerate(self.curriculum):
            check(
                stage.anchor is None or stage.anchor in names[:i],
                f"curriculum[{stage.name}].anchor: {stage.anchor!r} is not an earlier stage (earlier: {names[:i]})",
            )
        self.stages()  # unknown or invalid training keys (and stage values) fail here, at load
        methods = self.evaluation.decoding.methods
        check(
            self.registry.method in methods,
            f"registry.method: {self.registry.method!r} is not evaluated; add it to evaluation.decoding.methods "
            f"({', '.join(methods)}) or choose one of those",
        )
        self.eval_config("trained")

    def path(self, stage: str) -> Path:
        return Path(self.work_dir).expanduser().resolve() / stage

    def stages(self) -> list[StagePlan]:
        """The training stages in order: the curriculum's, or the one the recipe describes."""
        root, model = Path(self.work_dir).expanduser().resolve(), self.model
        if not self.curriculum:
            return [self._plan("training", root, model, self.prompts, self.trajectories, self.packing, self.training)]
        plans = []
        for stage in self.curriculum:
            trajectories = replace(
                self.trajectories,
                block_size=stage.block_size,
                max_new_tokens=stage.max_new_tokens or self.trajectories.max_new_tokens,
            )
            packing = replace(
                self.packing,
                window=stage.window or self.packing.window,
                cut_loops=self.packing.cut_loops if stage.cut_loops is None else stage.cut_loops,
                loop_period=self.packing.loop_period if stage.loop_period is None else stage.loop_period,
            )
            limit = {"limit": stage.prompts_limit} if stage.prompts_limit else {}
            prompts = replace_checked(self.prompts, f"curriculum[{stage.name}].prompts", **stage.prompts, **limit)
            training = self.training | stage.training
            plan = self._plan(stage.name, root / stage.name, model, prompts, trajectories, packing, training)
            plans.append(replace(plan, anchor=stage.anchor))
            # the next stage starts from this one's trained model
            model = replace(self.model, name_or_path=str(root / stage.name / TRAINING / LATEST / FINAL), gguf_file=None)
        return plans

    def _plan(self, name, folder, model, prompts, trajectories, packing, training: dict) -> StagePlan:
        values = {**training, "data": "-", "output_dir": str(folder / TRAINING), "model": training_model(model)}
        config = from_dict(TrainConfig, values, f"training ({name})" if self.curriculum else "training")
        return StagePlan(name, name if self.curriculum else "", folder, model, prompts, trajectories, packing, config)

    def final_model(self) -> str:
        """Where the last stage's newest training run exports its trained model."""
        return str(self.stages()[-1].path(TRAINING) / LATEST / FINAL)

    def eval_config(
        self, trained: str, model_uri: str | None = None, champion: tuple[str, str] | None = None
    ) -> EvalConfig:
        """Base and trained model, and the champion (checkpoint folder, model URI) when given, side by side."""
        models = {
            "base": EvalModel(model=self.model),
            "trained": EvalModel(model=self._checkpoint(trained), model_uri=model_uri),
        }
        if champion:
            models["champion"] = EvalModel(model=self._checkpoint(champion[0]), model_uri=champion[1])
        # The gate's method is timed in repeated interleaved rounds: its verdict needs the spread.
        decoding = replace_checked(
            self.evaluation.decoding,
            timing_rounds=max(self.evaluation.decoding.timing_rounds, self.registry.rounds),
            timed_methods=(self.registry.method,),
        )
        return self._evaluation(EVALUATION, models, "base", decoding=decoding)

    def curve_points(self) -> list[CurvePoint]:
        """Every model on the learning curve, in training order: the base model, then each stage's exports and
        final model, as its newest training run (`training/latest`) wrote them."""
        plans = self.stages()
        points = [
            CurvePoint(
                label="base", stage=plans[0].name, step=0, model=self.model, block_size=plans[0].trajectories.block_size
            )
        ]
        for plan in plans:
            run = (plan.path(TRAINING) / LATEST).resolve()
            final = run / FINAL / EXPORT_METADATA
            final_steps = json.loads(final.read_text())["steps"] if final.is_file() else None
            steps = {
                int(p.parent.name.removeprefix("step-")): p.parent for p in run.glob(f"{EXPORTS}/step-*/config.json")
            }
            if final_steps:
                steps[final_steps] = run / FINAL  # an export at the last step is the final model
            points += [
                CurvePoint(
                    label=f"{plan.name}@{step}",
                    stage=plan.name,
                    step=step,
                    model=self._checkpoint(str(folder)),
                    block_size=plan.trajectories.block_size,
                )
                for step, folder in sorted(steps.items())
            ]
        return points

    def curve_configs(self) -> dict[str, EvalConfig]:
        """Each learning-curve point's evaluation: its model alone, decoded with its stage's block size."""
        curve = self.evaluation.learning_curve
        check(curve is not None, "evaluation.learning_curve: not set")
        configs = {}
        for point in self.curve_points():
            n = point.block_size
            decoding = replace_checked(
                self.evaluation.decoding, block_size=n, ngram_size=n, max_new_tokens=curve.max_new_tokens
            )
            configs[point.label] = self._evaluation(
                CURVE, {point.label: EvalModel(model=point.model)}, point.label, curve.benchmarks, decoding
            )
        return configs

    def fp32_config(self, trained: str) -> EvalConfig:
        """The trained model in float32 on the first `fp32_check` problems of the first benchmark, every method."""
        e = self.evaluation
        check(e.fp32_check >= 1, "evaluation.fp32_check: not set")
        model = replace(self._checkpoint(trained), dtype="float32")
        benchmarks = (replace_checked(e.benchmarks[0], limit=e.fp32_check),)
        decoding = replace_checked(e.decoding, max_new_tokens=min(e.decoding.max_new_tokens, 128))
        return self._evaluation(
            FP32_CHECK, {"trained-fp32": EvalModel(model=model)}, "trained-fp32", benchmarks, decoding
        )

    def _checkpoint(self, folder: str) -> ModelConfig:
        return replace(self.model, name_or_path=folder, gguf_file=None)

    def _evaluation(self, folder: str, models: dict, baseline: str, benchmarks=None, decoding=None) -> EvalConfig:
        e = self.evaluation
        return EvalConfig(
            output_dir=str(self.path(folder)),
            models=models,
            benchmarks=benchmarks or e.benchmarks,
            baseline=baseline,
            decoding=decoding or e.decoding,
            problems_per_shard=e.problems_per_shard,
            data_dir=e.data_dir,
            unsafe_no_isolation=e.unsafe_no_isolation,
        )


def chosen_stages(stages: list[str] | None) -> list[Stage]:
    """The stages to run, in pipeline order (default all); an unknown name is an error."""
    chosen = list(stages or STAGES)
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        hint = "".join(f"; {s!r} is now {RENAMED[s]!r}" for s in unknown if s in RENAMED)
        raise ConfigError(f"stages: unknown {unknown}; choose from {list(STAGES)}{hint}")
    return [s for s in STAGES if s in chosen]


def load_recipe(source: str | Path | dict | Recipe, overrides: dict | None = None) -> Recipe:
    """A recipe from a YAML/JSON path, plain data or a Recipe, with optional top-level overrides; relative
    paths in a file resolve against the working folder."""
    if isinstance(source, Recipe):
        source = to_dict(source)  # checked again, like any other source
    data = dict(load_file(source) if isinstance(source, (str, Path)) else source)
    data |= overrides or {}
    if "work_dir" not in data:
        raise ConfigError("recipe: work_dir is required (the folder every stage writes under)")
    for old, new in RENAMED.items():
        if old in data:
            raise ConfigError(f"recipe: the section {old!r} is now called {new!r}; rename it")
    return from_dict(Recipe, data, "recipe")
