"""Every file one stage writes and another reads: the Parquet schemas, the file names and the selection record.

The stages and their folders under a recipe's `work_dir` (docs/DESIGN.md, "Stage contracts"):

    trajectories/<store>/            shard-NNNNN.parquet (TRAJECTORY_SCHEMA), manifest.json,
                                     sets/<prompt set>.json (a Selection: the stage's output)
    packing/<key>/                   packed-NNNNN.parquet (PACKED_SCHEMA), stats.json written last;
                                     heldout/: the held-out prompts, packed alike (HELDOUT);
                                     .arrow/<fingerprint>/: training's memory-mapped copies of the shards
    training/<key>[.<n>]/            launch.json, launch.log, checkpoints/, exports/, metrics.jsonl, acceptance.jsonl,
                                     final/ (HF checkpoint + jacobi_forcing.json), export.json (its sums)
    training/latest                  a link to the newest training run
    tuning/<key>/                    tune.json, tune.png (the tune itself goes into final/jacobi_forcing.json)
    evaluation/<key>/                shard-NNNNN.parquet (SAMPLE_SCHEMA), manifest.json, report/
    evaluation/summary.json          the newest evaluation's table and folders (SUMMARY; also in curve/, fp32-check/)
    curve/<key>/, fp32-check/<key>/  a recipe's learning curve and float32 check, laid out like evaluation/
    timings.jsonl                    one record per stage the flow ran: its name, seconds and output folder (TIMINGS)
    registry/<model>-v<version>/     the champion, downloaded once

A stage folder tracked in MLflow also holds mlflow_run.json: the run a resumed stage keeps logging to.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from jfcore.atomic import atomic_write

# Stage folders under work_dir (and under each curriculum stage's folder).
TRAJECTORIES, PACKING, TRAINING, TUNING, EVALUATION, REGISTRY = (
    "trajectories",
    "packing",
    "training",
    "tuning",
    "evaluation",
    "registry",
)
CURVE, FP32_CHECK = "curve", "fp32-check"  # the evaluation stage's optional extra evaluations (flows/recipe.py)
SUMMARY = "summary.json"  # in an evaluation folder: label -> the newest run's folder, report, table, exactness
TIMINGS = "timings.jsonl"  # in work_dir: {"stage": "trajectories/n16", "seconds": ..., "finished": ..., "output": folder} per stage run

MANIFEST = "manifest.json"  # a sharded run folder's shards, their checksums and settings
SETS = "sets"  # in a trajectory store: one selection file per prompt set
STATS = "stats.json"  # in a packed folder, written last: a packed folder without it is unfinished
HELDOUT = "heldout"  # in a packed folder: prompts kept out of training, packed alike (with a stats.json of their own)
RUN_FILE = "mlflow_run.json"  # in a stage's output folder: the MLflow run a resumed stage keeps logging to

# A training run's folder (jfcore.training.checkpoints reads and writes it).
LAUNCH_FILE = "launch.json"  # the training, DeepSpeed and tracking configs every process reads
LAUNCH_LOG = "launch.log"  # every line the training processes printed, across launches
CHECKPOINTS = "checkpoints"
COMPLETE = "jf_complete.json"  # in a checkpoint: every rank finished saving it
EXPORTS = "exports"
FINAL = "final"  # the trained model: a plain HF checkpoint with its tokenizer
EXPORT_METADATA = (
    "jacobi_forcing.json"  # in an export: training config, steps, block size; the tune (jfcore.jacobi_forcing_json)
)
EXPORT_SUMS = "export.json"  # beside final/: checksums of its files, so a changed export is never reused
METRICS = "metrics.jsonl"  # one record per optimizer step
ACCEPTANCE = "acceptance.jsonl"  # one record per acceptance measurement on the held-out prompts (and the decoded check)
DEEPSPEED_CONFIG = "deepspeed_config.json"  # the DeepSpeed config the engine ran with
FAILURE_PREFIX = "failure-"  # failure-rank<N>.txt: why a training process stopped
LATEST = "latest"  # in a training/ folder: a link to the newest run

REPORT = "report"  # in an evaluation run folder: results.md, results.json, samples.parquet, plots

# Labels on results: the pooled benchmark's name in results tables, metric names, MLflow tags.
ALL = "all"  # the benchmark label of the rows that pool every benchmark
TABLE_METRICS = (  # per row
    "accuracy",
    "timeouts",
    "tpf",
    "tps",
    "decode_tps",
    "speedup_vs_ar",
    "speedup",
    "repetition",
    "exact",
)
# A checkpoint's LoggedModel metrics (name -> table column), under its headline decoding method, per benchmark.
MODEL_METRICS = {
    "accuracy": "accuracy",
    "tpf": "tpf",
    "tokens_per_s": "tps",
    "speedup_vs_ar": "speedup_vs_ar",
    "speedup": "speedup",
    "repetition": "repetition",  # a rise inflates TPF: loops draft themselves (jfcore/evaluation/repetition.py)
}
TAG = "jacobi_forcing."  # every MLflow tag the pipeline sets starts with it
STAGE_TAG = TAG + "stage"  # a stage's run: its stage name
FLOW_RUN_TAG, STAGES_TAG = TAG + "flow_run_id", TAG + "stages"  # the parent run: its Prefect run, the stages run
RECIPE_TAG, RECIPE_DIGEST_TAG = TAG + "recipe", TAG + "recipe_digest"  # the parent run: the recipe and its digest
REGISTERED_VERSION_TAG, GATE_TAG = TAG + "registered_version", TAG + "gate"  # the parent run: what was registered
HEADLINE_METHOD_TAG = TAG + "headline_method"  # an evaluation run: the method its LoggedModel metrics are under
FINGERPRINT_TAG = TAG + "model_fingerprint"  # a checkpoint's LoggedModel that training did not log
GATE_DECISION_TAG, GATE_REASON_TAG = TAG + "gate.decision", TAG + "gate.reason"  # a registered model version
GATE_FIGURES_TAG = TAG + "eval."  # a registered model version: the figures the gate judged
TUNED_TAG = TAG + "tuned."  # a tuning run: the chosen configuration per batch-size bucket

TOKENS = pa.list_(pa.int32())

# Trajectory shards: one row per (prompt, block).
TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string()),  # stable id of the prompt within its prompt set
        pa.field("block_index", pa.int32()),  # k: 0 for the block right after the prompt
        pa.field("block_size", pa.int32()),  # n the trajectory was decoded with
        pa.field("prompt_length", pa.int32()),  # P: the first P context tokens are the prompt
        pa.field("context", TOKENS),  # prompt + fixed points of blocks < k
        pa.field("states", pa.list_(TOKENS)),  # initial draft ... fixed point, each len(fixed_point) long
        pa.field("fixed_point", TOKENS),  # the greedy continuation of `context`; n tokens except maybe the last block
        pa.field("first_mismatch", pa.list_(pa.int32())),  # per state: first index != fixed point (len when equal)
        pa.field("last_block", pa.bool_()),  # the prompt's final block (ended at EOS or max_new_tokens)
        pa.field("model_fingerprint", pa.string()),
        pa.field("tokenizer_fingerprint", pa.string()),
    ]
)

# Packed shards: one row per prompt.
PACKED_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string()),
        pa.field("input_ids", TOKENS),  # [prompt][k_0][l_0]...: length P + 2Tn
        pa.field("position_ids", TOKENS),  # prompt 0..P-1; k_j and l_j both P + j*n + t
        pa.field("prompt_length", pa.int32()),  # P
        pa.field("block_size", pa.int32()),  # n
        pa.field("num_blocks", pa.int32()),  # T (after any blocks dropped for max_length)
        pa.field("first_mismatch", TOKENS),  # per block: first index where k_j != l_j (valid length when equal)
        pa.field("noise_levels", pa.list_(pa.float32())),  # per block: noise level of k_j
        pa.field("valid_lengths", TOKENS),  # per block: tokens before padding (n except maybe the last block)
    ]
)

# Evaluation shards: one row per (problem, model, method).
SAMPLE_SCHEMA = pa.schema(
    [
        ("benchmark", pa.string()),
        ("problem_id", pa.string()),
        ("model", pa.string()),
        ("method", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("new_tokens", pa.int32()),
        ("decode_forwards", pa.int32()),
        ("prefill_seconds", pa.float64()),
        ("decode_seconds", pa.float64()),
        ("forward_seconds", pa.float64()),
        ("tpf", pa.float64()),
        ("tokens", pa.list_(pa.int32())),
        ("completion", pa.string()),
        ("round_seconds", pa.list_(pa.float64())),  # prefill + decode seconds of each timing round, the first included
        ("exact", pa.bool_()),  # tokens == the same model's HF greedy tokens, in every timing round
        ("first_divergence", pa.int32()),  # index of the first token that differs from them (the length if none)
        ("correct", pa.bool_()),
        ("verdict", pa.string()),  # code: passed, failed, timeout, load_error or error; math: correct or wrong
        ("detail", pa.string()),  # why a completion scored as it did ("passed", "failed: ...", "wrong answer")
    ]
)


@dataclass(frozen=True)
class Selection:
    """The trajectories stage's output (`<store>/sets/<prompt set>.json`): which shard of a store holds which
    prompt of one prompt set. Packing reads exactly these rows."""

    store: str
    prompts_fingerprint: str
    num_prompts: int
    skipped_too_long: int
    reused: int  # prompts another run had decoded already
    decoded: int
    shards: dict[str, list[str]]  # shard file name -> prompt ids
    settings: dict  # the store's model, fingerprints and trajectory settings
    complete: bool = True

    @classmethod
    def read(cls, path: str | Path) -> Selection:
        return cls(**json.loads(Path(path).read_text()))

    def write(self, path: Path) -> None:
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(asdict(self), indent=1)))

    def files(self) -> dict[str, list[str]]:
        """Shard path -> the prompt ids to read from it."""
        return {str(Path(self.store) / name): ids for name, ids in self.shards.items()}
