"""A training run's folder, which this module alone lays out, and what reads and writes it.

    <output_dir>/
      checkpoints/step-NNNNNNN/   DeepSpeed checkpoints; `jf_complete.json` once every rank has saved one
      exports/step-NNNNNNN/       plain HF checkpoints at TrainConfig.export_steps
      final/                      the exported model: a plain HF checkpoint, its tokenizer, jacobi_forcing.json
      export.json                 checksums of final/'s files (the training stage writes them once it is done)
      metrics.jsonl               one record per optimizer step
      acceptance.jsonl            one record per acceptance measurement on the held-out prompts
      deepspeed_config.json       the DeepSpeed config the engine ran with
      failure-rank<N>.txt         why a training process stopped

Checkpoints carry the model, optimizer, scheduler, data position and RNG. Resuming takes the newest complete
checkpoint that loads (an unreadable one is skipped for the one before) and refuses one written under other
settings. Every write is atomic and synced before a marker names it.
"""

from __future__ import annotations

import json
import os
import shutil
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from jfcore.atomic import atomic_write, fsync_dir, fsync_tree
from jfcore.contracts import (
    ACCEPTANCE,
    CHECKPOINTS,
    COMPLETE,
    DEEPSPEED_CONFIG,
    EXPORT_METADATA,
    EXPORT_SUMS,
    EXPORTS,
    FINAL,
    METRICS,
)
from jfcore.shards import file_sha256
from jfcore.training.lora import is_lora, merged_state_dict


class ResumeError(RuntimeError):
    """A checkpoint exists but cannot continue this run."""


class MetricsError(RuntimeError):
    """metrics.jsonl holds a broken record that a crash mid-write cannot explain."""


def complete_checkpoints(folder: Path) -> list[str]:
    """Tags of checkpoints every rank finished saving, oldest first."""
    if not folder.is_dir():
        return []
    return sorted(p.parent.name for p in folder.glob(f"*/{COMPLETE}"))


def export_dir(out: Path, step: int) -> Path:
    return out / EXPORTS / f"step-{step:07d}"


def start_over(out: Path) -> None:
    """Remove a previous run's checkpoints and export (rank 0): older checkpoints would outrank the new ones."""
    for stale in (out / CHECKPOINTS, out / FINAL):
        shutil.rmtree(stale, ignore_errors=True)


def begin(out: Path, deepspeed_config: dict, start: int) -> None:
    """Rank 0, once the starting step is known: the engine's config, and the metrics up to `start`."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / DEEPSPEED_CONFIG, lambda tmp: tmp.write_text(json.dumps(deepspeed_config, indent=2)))
    _truncate_metrics(out / METRICS, start)
    _truncate_metrics(out / ACCEPTANCE, start)


def append_metrics(out: Path, step: int, metrics: dict, name: str = METRICS) -> None:
    with open(out / name, "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")


def resume(engine, out: Path, schedule: dict) -> int:
    """Load the newest complete checkpoint that every rank can read; an unreadable one (a truncated or
    missing file) is skipped with a warning, and the next older one tried. Every rank tries the same list
    in the same order and they agree after each try, so all continue from the same step. Returns the step."""
    folder = out / CHECKPOINTS
    tags = complete_checkpoints(folder)
    for newer, tag in enumerate(reversed(tags)):
        saved = json.loads((folder / tag / COMPLETE).read_text()).get("schedule")
        if saved is not None:  # before loading: DeepSpeed fails on some changes (ZeRO's world size) as if unreadable
            _check_schedule(folder / tag, saved, schedule)
        then = "falling back to the previous complete one" if newer < len(tags) - 1 else "no older one is left"
        client = _load(engine, folder / tag, then)
        if client is None:
            continue
        _check_schedule(folder / tag, client["schedule"], schedule)
        if dist.get_rank() == 0:
            for skipped in tags[len(tags) - newer :]:  # unreadable: not complete any more, not tried again
                (folder / skipped / COMPLETE).unlink(missing_ok=True)
            print(f"resumed from step {client['step']} (checkpoint {folder / tag})", flush=True)
        torch.set_rng_state(client["rng"])
        return client["step"]
    if tags:  # the weights may be half-loaded from one of them: training on from step 0 would be wrong
        raise ResumeError(
            f"none of the complete checkpoints in {folder} ({', '.join(tags)}) could be loaded (see the warnings "
            "above); move the folder away, or set resume: false, to start over"
        )
    return 0


def _load(engine, path: Path, then: str) -> dict | None:
    """The checkpoint's client state if every rank loaded it, else None (after a warning from rank 0
    that ends with `then`)."""
    try:
        loaded, client = engine.load_checkpoint(str(path.parent), tag=path.name)
        error = None if loaded is not None else "DeepSpeed found no model states in it"
    except Exception as err:  # noqa: BLE001 (any failure to read it means: try an older one)
        error = _reason(err)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # a rank that loaded it must not go on alone
    failed = {rank: e for rank, e in enumerate(errors) if e is not None}
    if not failed:
        return client
    if dist.get_rank() == 0:
        where = "" if len(failed) == len(errors) else f" on rank {', '.join(map(str, failed))}"
        reasons = "; ".join(dict.fromkeys(failed.values()))  # once each, though every rank may give it
        print(f"warning: checkpoint {path} is unreadable{where} ({reasons}); {then}", flush=True)
    return None


def _reason(err: Exception) -> str:
    """One line: the error's first line, or where it was raised if it has no message (DeepSpeed's asserts)."""
    lines = str(err).strip().splitlines()
    if lines:
        text = lines[0] if len(lines[0]) <= 200 else lines[0][:200] + "..."
    else:
        frame = traceback.extract_tb(err.__traceback__)[-1]
        text = f"raised at {Path(frame.filename).name}:{frame.lineno}"
    return f"{type(err).__name__}: {text}"


def _check_schedule(path: Path, saved: dict, schedule: dict) -> None:
    changed = {k: (saved.get(k), v) for k, v in schedule.items() if saved.get(k) != v}
    if changed:
        detail = ", ".join(f"{k}: {old} -> {new}" for k, (old, new) in changed.items())
        raise ResumeError(
            f"{path} belongs to a run with other settings ({detail}); resuming would not continue "
            "it. Use a fresh output_dir, or set resume: false to start over"
        )


def save(engine, out: Path, step: int, schedule: dict, keep: int) -> None:
    """Checkpoint `step` on every rank, mark it complete once all have synced it, keep the newest `keep`."""
    folder, tag = out / CHECKPOINTS, f"step-{step:07d}"
    # A marker must never name a folder being rewritten (after a fallback, its steps are redone). No rank
    # writes into it before save_checkpoint's first barrier, so rank 0 removing it here is in time.
    if dist.get_rank() == 0:
        (folder / tag / COMPLETE).unlink(missing_ok=True)
    engine.save_checkpoint(
        str(folder), tag=tag, client_state={"step": step, "schedule": schedule, "rng": torch.get_rng_state()}
    )
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one per node: each node flushes its own page cache
        fsync_tree(folder / tag)
        fsync_dir(folder)
    dist.barrier()  # the marker below must not name data still in some node's page cache
    if dist.get_rank() == 0:
        marker = {"step": step, "schedule": schedule}
        atomic_write(folder / tag / COMPLETE, lambda tmp: tmp.write_text(json.dumps(marker)))
        for old in complete_checkpoints(folder)[:-keep]:
            shutil.rmtree(folder / old, ignore_errors=True)
    dist.barrier()


def _truncate_metrics(path: Path, start: int) -> None:
    """Keep the records up to the step training resumes from; later ones are about to be redone."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r["step"] <= start] if start else []
    atomic_write(path, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in kept)))


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, oldest first. A crash mid-write can tear only the last line: that
    one is dropped with a warning (its step is redone on resume); a broken line before it is an error."""
    if not path.is_file():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    records = []
    for i, (number, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i < len(lines) - 1:
                raise MetricsError(
                    f"{path} line {number} is not a JSON record ({err}): {line[:80]!r}. Only a last line can be "
                    "torn by a crash, so the file was changed by hand or the disk is failing; delete that line"
                ) from err
            print(
                f"warning: {path} line {number} is torn (a crash while writing it): {line[:80]!r}; dropping it",
                flush=True,
            )
    return records


def export(engine, tokenizer, final: Path, metadata: dict) -> None:
    """Consolidated weights (gathered across ZeRO-3 shards; LoRA adapters merged in) saved as a plain HF
    checkpoint plus tokenizer."""
    import deepspeed

    model = engine.module
    params = list(model.parameters())
    gather = engine.zero_optimization_stage() == 3
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=gather):
        if dist.get_rank() == 0:
            if is_lora(model):  # adapters merged into the weights: a plain checkpoint all the same
                state, model = merged_state_dict(model), model.get_base_model()
            else:
                state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            model.config.use_cache = True
            staging = final.with_name(final.name + ".tmp")
            shutil.rmtree(staging, ignore_errors=True)
            model.save_pretrained(staging, state_dict=state)
            tokenizer.save_pretrained(staging)
            (staging / EXPORT_METADATA).write_text(json.dumps(metadata, indent=2, default=str))
            fsync_tree(staging)  # before the rename: `final` must never name data a power loss could take
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            fsync_dir(final.parent)
    dist.barrier()


def export_problem(out: Path) -> str | None:
    """Why `out`'s final export cannot be reused (None when it can): missing, or not what was exported."""
    final, sums = out / FINAL, out / EXPORT_SUMS
    if not (final / "config.json").is_file() or not sums.is_file():
        return f"{out} has no finished export"
    recorded = json.loads(sums.read_text())
    present = {p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file()}
    changed = [name for name, digest in recorded.items() if name not in present or file_sha256(final / name) != digest]
    return f"the export in {final} changed since training ({', '.join(sorted(changed))})" if changed else None


def write_export_sums(out: Path) -> None:
    final = out / FINAL
    sums = {p.relative_to(final).as_posix(): file_sha256(p) for p in sorted(final.rglob("*")) if p.is_file()}
    atomic_write(out / EXPORT_SUMS, lambda tmp: tmp.write_text(json.dumps(sums, indent=1)))
