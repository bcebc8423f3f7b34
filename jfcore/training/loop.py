"""The distillation loop on a DeepSpeed engine: one process per GPU, or CPU processes over gloo.

Run it under a launcher (torchrun or deepspeed) that sets RANK, WORLD_SIZE and
LOCAL_RANK; `tasks.training` does that. It trains, checkpoints every
`checkpoint_every` optimizer steps (model, optimizer, scheduler, data position,
RNG), resumes from the newest complete checkpoint that loads (an unreadable one
is skipped for the one before), and exports the final model as a plain HF
checkpoint with its tokenizer.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import get_cosine_schedule_with_warmup

from jfcore.atomic import atomic_write, fsync_dir, fsync_tree
from jfcore.config import ConfigError, replace, to_dict
from jfcore.models import load_model, tokenizer_fingerprint
from jfcore.training.batch import collate
from jfcore.training.config import TrainConfig
from jfcore.training.data import DataOrder, PackedData, TrainingDataError
from jfcore.training.losses import jacobi_forcing_loss
from jfcore.training.mask import attention_mask

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
FINAL = "final"
EXPORTS = "exports"  # exports/step-NNNNNNN/: plain checkpoints at TrainConfig.export_steps
PROGRESS_EVERY_S = 30.0  # rank 0 prints a progress line at most this often (and at the first and last step)
PROGRESS_LINE = re.compile(r"step (?P<done>\d+)/(?P<total>\d+): ")  # how the launcher recognises that line
DEEPSPEED_CONFIG = "deepspeed_config.json"
FAILURE_PREFIX = "failure-"  # failure-rank<N>.txt: why a training process stopped
COMPLETE = "jf_complete.json"  # written into a checkpoint folder once every rank has saved it
# Keys the training config owns; a DeepSpeed file may not set them to something else.
OWNED_KEYS = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "optimizer",
    "scheduler",
    "bf16",
    "fp16",
)


class ResumeError(RuntimeError):
    """A checkpoint exists but cannot continue this run."""


class MetricsError(RuntimeError):
    """metrics.jsonl holds a broken record that a crash mid-write cannot explain."""


@dataclass
class TrainResult:
    final_dir: Path
    steps: int
    resumed_from: int  # 0 for a fresh run
    last_metrics: dict


def deepspeed_config(base: dict, config: TrainConfig, world_size: int, bf16: bool) -> dict:
    """The DeepSpeed config file's ZeRO/offload settings plus what the training config decides."""
    clashes = [k for k in OWNED_KEYS if k in base]
    if clashes:
        raise ConfigError(
            f"DeepSpeed config sets {', '.join(clashes)}: the training config decides these "
            "(micro_batch_size, gradient_accumulation_steps, max_grad_norm, precision, learning_rate); remove them"
        )
    return {
        **base,
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "train_batch_size": config.micro_batch_size * config.gradient_accumulation_steps * world_size,
        "gradient_clipping": config.max_grad_norm,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,  # we log ourselves
        "wall_clock_breakdown": False,
    }


def complete_checkpoints(folder: Path) -> list[str]:
    """Tags of checkpoints every rank finished saving, oldest first."""
    if not folder.is_dir():
        return []
    return sorted(p.parent.name for p in folder.glob(f"*/{COMPLETE}"))


def train(
    config: TrainConfig, deepspeed_base: dict, on_metrics: Callable[[int, dict], None] | None = None
) -> TrainResult:
    import deepspeed  # here, so the rest of jfcore works without it

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    bf16 = config.precision == "bfloat16" or (config.precision == "auto" and cuda)
    attn = {"auto": "flex_attention" if cuda else "sdpa", "flex": "flex_attention"}.get(
        config.attention, config.attention
    )
    torch.manual_seed(config.seed)

    model, tokenizer = load_model(replace(config.model, device=str(device), attn_implementation=attn))
    data = PackedData(config.data, tokenizer_fingerprint(tokenizer))
    order = DataOrder(len(data), config.micro_batch_size, world, config.gradient_accumulation_steps, config.seed)
    if order.steps_per_epoch == 0:
        raise TrainingDataError(
            f"{config.data} holds {len(data)} packed sequences, fewer than one global batch of {order.global_batch} "
            f"(micro_batch_size x processes x gradient_accumulation_steps); lower those or pack more prompts"
        )
    total = config.max_steps or config.epochs * order.steps_per_epoch
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, betas=config.betas, weight_decay=config.weight_decay
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(config.warmup_ratio * total), total)
    ds_config = deepspeed_config(deepspeed_base, config, world, bf16)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)

    out = Path(config.output_dir)
    checkpoints = out / CHECKPOINTS
    schedule = {
        "world_size": world,
        "data": data.fingerprint,
        "total_steps": total,
        "micro_batch_size": config.micro_batch_size,
        "seed": config.seed,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
    }
    if not config.resume and rank == 0:  # starting over: older checkpoints would outrank the new ones
        for stale in (checkpoints, out / FINAL):
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    start = _resume(engine, checkpoints, schedule) if config.resume else 0
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / DEEPSPEED_CONFIG, lambda tmp: tmp.write_text(json.dumps(ds_config, indent=2)))
        _truncate_metrics(out / METRICS, start)

    metrics: dict = {}
    progress = _Progress(start, total) if rank == 0 else None
    for step in range(start, total):
        began = time.perf_counter()
        lr = scheduler.get_last_lr()[0]  # the rate this step applies
        losses_sum = torch.zeros(3, device=device)  # total, ar, consistency: summed on the device, read once
        tokens = 0
        for micro in range(config.gradient_accumulation_steps):
            rows = [data.rows[i] for i in order.rows(step, micro, rank)]
            batch = collate(rows, tokenizer.pad_token_id, tokenizer.eos_token_id).to(device)
            mask = attention_mask(batch.streams, attn, torch.bfloat16 if bf16 else torch.float32)
            logits = engine(
                input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask, use_cache=False
            ).logits
            losses = jacobi_forcing_loss(logits, batch, config.ar_weight, config.temperature)
            engine.backward(losses.total)
            if micro == config.gradient_accumulation_steps - 1:
                own_norm = _plain_grad_norm(engine)
            engine.step()
            losses_sum += torch.stack([losses.total.detach(), losses.ar, losses.consistency]).float()
            tokens += batch.tokens
        # On the training device: NCCL reduces only CUDA tensors.
        sums = torch.cat([losses_sum.double(), torch.tensor([tokens], dtype=torch.float64, device=device)])
        dist.all_reduce(sums)
        sums = sums.cpu()
        parts = sums[:3] / (world * config.gradient_accumulation_steps)
        grad_norm = engine.get_global_grad_norm()
        grad_norm = own_norm if grad_norm is None else grad_norm
        metrics = {
            "loss": parts[0].item(),
            "ar_loss": parts[1].item(),
            "consistency_loss": parts[2].item(),
            "learning_rate": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "tokens_per_second": sums[3].item() / (time.perf_counter() - began),
            "tokens": int(sums[3].item()),
        }
        if rank == 0:
            with open(out / METRICS, "a") as f:
                f.write(json.dumps({"step": step + 1, **metrics}) + "\n")
            if on_metrics is not None:
                on_metrics(step + 1, metrics)
            progress.report(step + 1, metrics)
        if step + 1 in config.export_steps:  # checkpointed too, so a resume never starts past a missing export
            metadata = {"training": to_dict(config), "steps": step + 1, "block_size": data.block_size}
            _export(engine, tokenizer, out / EXPORTS / f"step-{step + 1:07d}", metadata)
        if (step + 1) % config.checkpoint_every == 0 or step + 1 == total or step + 1 in config.export_steps:
            _save(engine, checkpoints, step + 1, schedule, config.keep_checkpoints)

    final = out / FINAL
    exported = (final / "config.json").is_file()  # a rerun of a finished run leaves its export alone
    # Every rank looks before rank 0 may write it: a rank that looked after would skip the export's
    # collectives and leave the others waiting on a peer that has gone.
    dist.barrier()
    if not exported:
        _export(engine, tokenizer, final, {"training": to_dict(config), "steps": total, "block_size": data.block_size})
    dist.barrier()
    return TrainResult(final_dir=final, steps=total, resumed_from=start, last_metrics=metrics)


class _Progress:
    """One line per PROGRESS_EVERY_S on rank 0: step, losses, throughput and time left (the launcher relays it)."""

    def __init__(self, start: int, total: int):
        self.start, self.total = start, total
        self.began = self.last = time.perf_counter()

    def report(self, step: int, metrics: dict) -> None:
        now = time.perf_counter()
        if step not in (self.start + 1, self.total) and now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        eta = (now - self.began) / (step - self.start) * (self.total - step)
        print(
            f"step {step}/{self.total}: loss {metrics['loss']:.3f} (ar {metrics['ar_loss']:.3f}, consistency "
            f"{metrics['consistency_loss']:.3f}), lr {metrics['learning_rate']:.2e}, "
            f"{metrics['tokens_per_second']:.0f} tokens/s, ETA {eta / 60:.1f} min",
            flush=True,
        )


def _plain_grad_norm(engine) -> float | None:
    """The gradient norm DeepSpeed computes but does not keep without ZeRO (stage 0, float32).

    Called after the boundary backward, where stage 0 has already all-reduced the gradients."""
    if engine.zero_optimization_stage() != 0:
        return None
    norms = [p.grad.float().norm() for p in engine.module.parameters() if p.grad is not None]
    return torch.stack(norms).norm().item() if norms else None


def _resume(engine, folder: Path, schedule: dict) -> int:
    """Load the newest complete checkpoint that every rank can read; an unreadable one (a truncated or
    missing file) is skipped with a warning, and the next older one tried. Every rank tries the same list
    in the same order and they agree after each try, so all continue from the same step."""
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


def _save(engine, folder: Path, step: int, schedule: dict, keep: int) -> None:
    tag = f"step-{step:07d}"
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


def _export(engine, tokenizer, final: Path, metadata: dict) -> None:
    """Consolidated weights (gathered across ZeRO-3 shards) saved as a plain HF checkpoint plus tokenizer."""
    import deepspeed

    model = engine.module
    params = list(model.parameters())
    gather = engine.zero_optimization_stage() == 3
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=gather):
        if dist.get_rank() == 0:
            state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            model.config.use_cache = True
            staging = final.with_name(final.name + ".tmp")
            shutil.rmtree(staging, ignore_errors=True)
            model.save_pretrained(staging, state_dict=state)
            tokenizer.save_pretrained(staging)
            (staging / "jacobi_forcing.json").write_text(json.dumps(metadata, indent=2, default=str))
            fsync_tree(staging)  # before the rename: `final` must never name data a power loss could take
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            fsync_dir(final.parent)
    dist.barrier()
