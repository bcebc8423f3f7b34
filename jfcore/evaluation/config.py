"""What an evaluation runs: which models, which benchmarks, which decoding methods."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from jfcore.config import check
from jfcore.evaluation.benchmarks import BenchmarkConfig
from jfcore.models import ModelConfig

MethodName = Literal["hf_greedy", "jacobi", "multiblock"]
REFERENCE = "hf_greedy"  # every other method's output is compared with this one's, model by model


@dataclass(frozen=True)
class EvalModel:
    model: ModelConfig
    # The MLflow model this checkpoint was logged as ("models:/name/3", "models:/name@champion", "models:/m-...");
    # its metrics are then logged against it as well as against the evaluation run.
    model_uri: str | None = None


@dataclass(frozen=True)
class DecodingSettings:
    """Every method is greedy; `jacobi` and `multiblock` share `block_size`."""

    methods: tuple[MethodName, ...] = ("hf_greedy", "jacobi", "multiblock")
    max_new_tokens: int = 256
    block_size: int = 16
    num_blocks: int = 2  # multiblock: blocks in flight
    pool_size: int = 4  # multiblock: recycled n-grams verified per forward
    spawn_ratio: float = 0.85
    ngram_size: int = 8
    warmup_tokens: int = 16  # each worker decodes this many tokens per model and method before timing

    def __post_init__(self) -> None:
        check(
            REFERENCE in self.methods,
            f"decoding.methods: must include {REFERENCE!r} (exactness and speedups are measured against it)",
        )
        check(len(set(self.methods)) == len(self.methods), f"decoding.methods: listed twice in {list(self.methods)}")
        check(self.max_new_tokens >= 1, f"decoding.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        check(self.block_size >= 1, f"decoding.block_size: must be >= 1, got {self.block_size}")
        check(self.warmup_tokens >= 0, f"decoding.warmup_tokens: must be >= 0, got {self.warmup_tokens}")

    def decode_config(self, method: str) -> dict:
        """Keyword arguments of `DecodeConfig` for a project method (the token budget aside)."""
        if method == "jacobi":
            return {"method": "jacobi", "block_size": self.block_size}
        return {
            "method": "multiblock",
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "pool_size": self.pool_size,
            "spawn_ratio": self.spawn_ratio,
            "ngram_size": self.ngram_size,
        }


@dataclass(frozen=True)
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
