"""What an evaluation runs: which models, which benchmarks, which decoding methods."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from jfcore.config import ConfigError, check
from jfcore.decoding.config import DecodeConfig
from jfcore.evaluation.benchmarks import BenchmarkConfig
from jfcore.models import ModelConfig

# hf_greedy: the reference; hf_prompt_lookup: HF's prompt-lookup decoding (the untrained baseline to beat);
# jacobi, multiblock: the fixed settings below; tuned: the model's tuned decoding for this machine (jfcore.jacobi_forcing_json).
MethodName = Literal["hf_greedy", "hf_prompt_lookup", "ar", "jacobi", "multiblock", "tuned"]
REFERENCE = "hf_greedy"  # every other method's output is compared with this one's, model by model
SAME_ENGINE_AR = "ar"  # the project's own AR: the same-engine baseline of every method's speedup_vs_ar


@dataclass(frozen=True, kw_only=True)
class EvalModel:
    model: ModelConfig
    # The MLflow model this checkpoint was logged as ("models:/name/3", "models:/name@champion", "models:/m-...");
    # its metrics are then logged against it as well as against the evaluation run.
    model_uri: str | None = None


@dataclass(frozen=True, kw_only=True)
class DecodingSettings:
    """Every method is greedy; `jacobi` and `multiblock` share the DecodeConfig settings below (the fixed
    configuration); `tuned` reads each model's own tune (jfcore.jacobi_forcing_json)."""

    methods: tuple[MethodName, ...] = ("hf_greedy", "ar", "jacobi", "multiblock", "tuned")
    max_new_tokens: int = DecodeConfig.max_new_tokens
    block_size: int = DecodeConfig.block_size
    num_blocks: int = DecodeConfig.num_blocks  # multiblock: blocks in flight
    pool_size: int = DecodeConfig.pool_size  # multiblock: recycled n-grams verified per forward
    spawn_ratio: float = DecodeConfig.spawn_ratio
    ngram_size: int = DecodeConfig.ngram_size
    rolling: bool = False  # jacobi: a rolling window (DecodeConfig.rolling) instead of fixed blocks
    warmup_tokens: int = 16  # each worker decodes this many tokens per model and method before timing
    prompt_lookup_tokens: int = 10  # hf_prompt_lookup: candidate tokens per step (HF's own default)
    # Each problem is decoded `timing_rounds` times by the `timed_methods`, every round in its own interleaved order
    # across models, so a comparison of two models' speeds carries its noise (the spread over rounds; the registry
    # gate needs it). A later round must reproduce the first round's tokens, or the sample is not exact.
    timing_rounds: int = 1
    timed_methods: tuple[MethodName, ...] = ("tuned",)

    def __post_init__(self) -> None:
        check(
            REFERENCE in self.methods,
            f"decoding.methods: must include {REFERENCE!r} (exactness and speedups are measured against it)",
        )
        check(len(set(self.methods)) == len(self.methods), f"decoding.methods: listed twice in {list(self.methods)}")
        check(self.max_new_tokens >= 1, f"decoding.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        check(self.warmup_tokens >= 0, f"decoding.warmup_tokens: must be >= 0, got {self.warmup_tokens}")
        check(self.timing_rounds >= 1, f"decoding.timing_rounds: must be >= 1, got {self.timing_rounds}")
        missing = [m for m in self.timed_methods if m not in self.methods]
        check(
            self.timing_rounds == 1 or not missing,
            f"decoding.timed_methods: {missing} are not in decoding.methods {list(self.methods)}",
        )
        for method in ("jacobi", "multiblock"):
            self.decode_config(method)  # DecodeConfig checks the values (block_size >= 1, ...)

    def decode_config(self, method: str) -> dict:
        """Keyword arguments of `DecodeConfig` for a fixed method (the token budget aside); "ar" is the project's own
        one-token-per-forward decoding, the baseline a parallel method's speedup is over in the same engine."""
        if method == "ar":
            return {"method": "ar"}
        shared = {"method": method, "block_size": self.block_size}
        if method == "multiblock":
            shared |= {k: getattr(self, k) for k in ("num_blocks", "pool_size", "spawn_ratio", "ngram_size")}
        elif self.rolling:
            shared["rolling"] = True
        try:
            DecodeConfig(**shared)
        except ConfigError as err:
            raise ConfigError(f"decoding: {err}") from None
        return shared


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    output_dir: str  # results, per-sample shards and plots go under a folder named by the settings
    models: dict[str, EvalModel]  # label -> model, e.g. {"base": ..., "trained": ...}
    benchmarks: tuple[BenchmarkConfig, ...]
    baseline: str = "base"  # the label whose HF greedy speed every speedup is relative to
    decoding: DecodingSettings = field(default_factory=DecodingSettings)
    problems_per_shard: int = 4  # the unit of work for a worker and of resuming
    data_dir: str | None = None  # the shared data folder; default $JF_SHARED_DATA or ../shared/data
    # Run model-written programs without operating-system isolation (jfcore.evaluation.isolation), on a host that
    # cannot provide it, and only for trusted programs; logged, and recorded with the results.
    unsafe_no_isolation: bool = False

    def __post_init__(self) -> None:
        check(
            bool(self.models), "EvalConfig.models: name at least one model, e.g. {base: {model: {name_or_path: ...}}}"
        )
        check(
            self.baseline in self.models,
            f"EvalConfig.baseline: {self.baseline!r} is not one of the models ({', '.join(self.models)})",
        )
        check(bool(self.benchmarks), "EvalConfig.benchmarks: list at least one, e.g. [{name: gsm8k, limit: 20}]")
        names = [b.name for b in self.benchmarks]
        check(len(set(names)) == len(names), f"EvalConfig.benchmarks: a benchmark is listed twice in {names}")
        check(
            self.problems_per_shard >= 1, f"EvalConfig.problems_per_shard: must be >= 1, got {self.problems_per_shard}"
        )
