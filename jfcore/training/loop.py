"""The distillation loop on a DeepSpeed engine: one process per GPU, or CPU processes over gloo.

Run it under a launcher (torchrun or deepspeed) that sets RANK, WORLD_SIZE and LOCAL_RANK;
`tasks.training` does that. `setup` builds the engine, `train_step` is one optimizer step
(the loss is docs/DESIGN.md, section 6, on the packed layout and mask of section 5), and
`train` runs them from the resumed step to the end, checkpointing and exporting through
`jfcore.training.checkpoints`, which owns the run folder.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup, get_wsd_schedule

from jfcore.config import ConfigError, replace_checked, to_dict
from jfcore.contracts import ACCEPTANCE, HELDOUT, METRICS
from jfcore.evaluation.repetition import repeated_share
from jfcore.models import load_model, tokenizer_fingerprint
from jfcore.training import acceptance, checkpoints
from jfcore.training.batch import PackedBatch, collate_for, scored_columns
from jfcore.training.config import TrainConfig
from jfcore.training.data import DataOrder, PackedData, TrainingDataError
from jfcore.training.lora import with_lora
from jfcore.training.losses import jacobi_forcing_loss
from jfcore.training.mask import attention_mask

PROGRESS_EVERY_S = 30.0  # rank 0 prints a progress line at most this often (and at the first and last step)
PROGRESS_LINE = re.compile(r"step (?P<done>\d+)/(?P<total>\d+): ")  # how the launcher recognises that line
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


@dataclass
class Trainer:
    """What every step needs: the engine, the data and its order, and this process's place in the job."""

    config: TrainConfig
    engine: object  # deepspeed.DeepSpeedEngine
    scheduler: object
    tokenizer: object
    data: PackedData
    order: DataOrder
    device: torch.device
    rank: int
    world: int
    attn: str
    bf16: bool
    total: int  # optimizer steps of the whole run
    deepspeed_config: dict
    heldout: list[dict]  # the held-out packed rows acceptance is measured on (empty: not measured)
    teacher: torch.nn.Module | None = None  # the frozen copy of the starting model (TrainConfig.teacher "frozen")
    keeps_logits: bool = False  # the model's forward takes `logits_to_keep`: logits only where a loss reads them

    @property
    def schedule(self) -> dict:
        """What a checkpoint must have been trained under to be resumed by this run."""
        return {
            "world_size": self.world,
            "data": self.data.fingerprint,
            "total_steps": self.total,
            "micro_batch_size": self.config.micro_batch_size,
            "seed": self.config.seed,
            "gradient_accumulation_steps": self.config.gradient_accumulation_steps,
        }

    def export_metadata(self, steps: int) -> dict:
        return {"training": to_dict(self.config), "steps": steps, "block_size": self.data.block_size}


def setup(config: TrainConfig, deepspeed_base: dict) -> Trainer:
    """Join the process group, load the model and the packed data, and build the DeepSpeed engine."""
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

    model, tokenizer = load_model(replace_checked(config.model, device=str(device), attn_implementation=attn))
    keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
    if config.lora is not None:
        model = with_lora(model, config.lora)
    data = PackedData(config.data, tokenizer_fingerprint(tokenizer))
    heldout = _heldout_rows(config, tokenizer_fingerprint(tokenizer))
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
        [p for p in model.parameters() if p.requires_grad],  # with LoRA: the adapters alone
        lr=config.learning_rate,
        betas=config.betas,
        weight_decay=config.weight_decay,
        fused=True,  # one kernel over all parameters; without it CPU steps loop over them one tensor at a time
    )
    scheduler = lr_scheduler(optimizer, config, total)
    ds_config = deepspeed_config(deepspeed_base, config, world, bf16)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    teacher = frozen_teacher(config, device, bf16) if config.teacher == "frozen" else None
    parts = (engine, scheduler, tokenizer, data, order, device, rank, world, attn, bf16, total, ds_config, heldout)
    return Trainer(config, *parts, teacher=teacher, keeps_logits=keeps_logits)


def frozen_teacher(config: TrainConfig, device: torch.device, bf16: bool) -> torch.nn.Module:
    """The starting model once more, frozen: it reads the clean stream alone, so the ordinary causal attention of
    the architecture serves (sdpa), whatever the trained model's packed mask needs."""
    model, _ = load_model(replace_checked(config.model, device=str(device), attn_implementation="sdpa"))
    model.requires_grad_(False).eval()
    return model.to(torch.bfloat16) if bf16 else model


def lr_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total: int):
    """The learning rate over `total` optimizer steps: linear warmup, then `config.lr_schedule`."""
    warmup = math.ceil(config.warmup_ratio * total)
    if config.lr_schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    if config.lr_schedule == "wsd":
        decay = min(math.ceil(config.decay_ratio * total), total - warmup)
        return get_wsd_schedule(optimizer, warmup, decay, num_training_steps=total, decay_type="linear")
    return get_cosine_schedule_with_warmup(optimizer, warmup, total)


def _heldout_rows(config: TrainConfig, tokenizer_fingerprint: str) -> list[dict]:
    """The first `acceptance.prompts` held-out packed rows (by prompt id), or none when not measured."""
    folder = Path(config.data) / HELDOUT
    if not config.acceptance.every or not folder.is_dir():
        return []
    heldout = PackedData(folder, tokenizer_fingerprint)
    return heldout.take(list(range(min(len(heldout), config.acceptance.prompts))))


def train_step(t: Trainer, step: int) -> dict:
    """One optimizer step (`gradient_accumulation_steps` micro batches); its figures, averaged over the job."""
    config, engine, device = t.config, t.engine, t.device
    began = time.perf_counter()
    lr = t.scheduler.get_last_lr()[0]  # the rate this step applies
    losses_sum = torch.zeros(5, device=device)  # total, ar, consistency, copy, repeat: summed on the device, read once
    tokens = 0
    for micro in range(config.gradient_accumulation_steps):
        rows = t.data.take(t.order.rows(step, micro, t.rank))
        batch = collate_for(config, rows, t.tokenizer.pad_token_id, t.tokenizer.eos_token_id).to(device)
        dtype = torch.bfloat16 if t.bf16 else torch.float32
        mask = attention_mask(batch.streams, t.attn, dtype, batch.blocks, config.noisy_context)
        logits, scored = forward_scored(engine, batch, mask, t.keeps_logits)
        frozen = _frozen_logits(t.teacher, batch) if t.teacher is not None else None
        margin = config.ar_margin if config.ar_loss == "margin" else None
        losses = jacobi_forcing_loss(
            logits,
            scored,
            config.ar_weight,
            config.temperature,
            config.consistency_target,
            frozen,
            margin,
            config.copy_unlikelihood,
            config.repeat_unlikelihood,
        )
        engine.backward(losses.total)
        if micro == config.gradient_accumulation_steps - 1:
            own_norm = _plain_grad_norm(engine)
        engine.step()
        measured = (losses.total.detach(), losses.ar, losses.consistency, losses.copy, losses.repeat)
        losses_sum += torch.stack(measured).float()
        tokens += batch.tokens
    # On the training device: NCCL reduces only CUDA tensors.
    sums = torch.cat([losses_sum.double(), torch.tensor([tokens], dtype=torch.float64, device=device)])
    dist.all_reduce(sums)
    sums = sums.cpu()
    parts = sums[:5] / (t.world * config.gradient_accumulation_steps)
    grad_norm = engine.get_global_grad_norm()
    grad_norm = own_norm if grad_norm is None else grad_norm
    return {
        "loss": parts[0].item(),
        "ar_loss": parts[1].item(),
        "consistency_loss": parts[2].item(),
        "copy_loss": parts[3].item(),
        "repeat_loss": parts[4].item(),
        "learning_rate": lr,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "tokens_per_second": sums[5].item() / (time.perf_counter() - began),
        "tokens": int(sums[5].item()),
    }


def forward_scored(
    model, batch: PackedBatch, mask: torch.Tensor, keeps_logits: bool
) -> tuple[torch.Tensor, PackedBatch]:
    """The training forward's logits and the batch whose indices point into them: at the scored columns only where
    the model's forward takes `logits_to_keep` (`scored_columns`), else at every position."""
    kept, scored = scored_columns(batch) if keeps_logits else (None, batch)
    logits = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        attention_mask=mask,
        use_cache=False,
        **({"logits_to_keep": kept} if kept is not None else {}),
    ).logits
    if kept is not None and logits.shape[1] != len(kept):  # read as positions, the losses would score wrong logits
        raise RuntimeError(
            f"{type(getattr(model, 'module', model)).__name__}'s forward takes logits_to_keep but returned logits "
            f"at {logits.shape[1]} positions for the {len(kept)} asked for; its architecture's code must keep a tensor "
            "of positions as transformers' own models do (transformers.modeling_utils.slice_logits_to_keep)"
        )
    return logits, scored


@torch.no_grad()
def _frozen_logits(teacher: torch.nn.Module, batch) -> torch.Tensor:
    return teacher(
        input_ids=batch.clean_ids,
        position_ids=batch.clean_position_ids,
        attention_mask=batch.clean_attention,
        use_cache=False,
    ).logits


def train(
    config: TrainConfig, deepspeed_base: dict, on_metrics: Callable[[int, dict], None] | None = None
) -> TrainResult:
    """Train from the newest complete checkpoint (or from the start) to the end, then export `final/`."""
    t = setup(config, deepspeed_base)
    out = Path(config.output_dir)
    if not config.resume and t.rank == 0:
        checkpoints.start_over(out)
    dist.barrier()
    start = checkpoints.resume(t.engine, out, t.schedule) if config.resume else 0
    if t.rank == 0:
        checkpoints.begin(out, t.deepspeed_config, start)

    metrics: dict = {}
    progress = _Progress(start, t.total) if t.rank == 0 else None
    seen = sum(r.get("tokens", 0) for r in checkpoints.read_metrics(out / METRICS)) if t.rank == 0 else 0
    measured: dict = {}  # the latest held-out figures
    if start == 0:
        measured = _measure_acceptance(t, 0, seen, on_metrics, progress)
    for step in range(start, t.total):
        metrics = train_step(t, step)
        done = step + 1
        if t.rank == 0:
            seen += metrics["tokens"]
            checkpoints.append_metrics(out, done, metrics)
            if on_metrics is not None:
                on_metrics(done, metrics)
            progress.report(done, metrics)
        if done == t.total or (config.acceptance.every and done % config.acceptance.every == 0):
            measured = _measure_acceptance(t, done, seen, on_metrics, progress)
        if done in config.export_steps:  # checkpointed too, so a resume never starts past a missing export
            checkpoints.export(t.engine, t.tokenizer, checkpoints.export_dir(out, done), t.export_metadata(done))
        if done % config.checkpoint_every == 0 or done == t.total or done in config.export_steps:
            checkpoints.save(t.engine, out, done, t.schedule, config.keep_checkpoints)

    final = out / checkpoints.FINAL
    exported = (final / "config.json").is_file()  # a rerun of a finished run leaves its export alone
    # Every rank looks before rank 0 may write it: a rank that looked after would skip the export's
    # collectives and leave the others waiting on a peer that has gone.
    if progress:
        progress.close()
    dist.barrier()
    if not exported:
        checkpoints.export(t.engine, t.tokenizer, final, t.export_metadata(t.total))
        if t.rank == 0 and t.heldout and config.acceptance.decode:
            _decoded_check(t, final, measured, on_metrics)
    dist.barrier()
    return TrainResult(final_dir=final, steps=t.total, resumed_from=start, last_metrics=metrics)


def _block_sizes(t: Trainer) -> tuple[int, ...]:
    return t.config.acceptance.block_sizes or (t.data.block_size,)


def _measure_acceptance(
    t: Trainer, step: int, tokens: int, on_metrics: Callable[[int, dict], None] | None, progress: _Progress | None
) -> dict:
    """Every rank measures its share of the held-out prompts together; rank 0 records the figures, prints them and
    keeps them for its progress lines. Returns them (empty when nothing is measured)."""
    if not t.heldout:
        return {}
    began = time.perf_counter()
    ranks = acceptance.Ranks(t.rank, t.world, t.device)
    figures = acceptance.measure(
        t.engine.module,
        t.heldout,
        _block_sizes(t),
        t.config.acceptance.tokens,
        t.tokenizer.pad_token_id,
        t.tokenizer.eos_token_id,
        t.attn,
        ranks,
        seed=t.config.seed,
        context=t.config.noisy_context,
    )
    if t.rank == 0:
        metrics = figures.metrics()
        record = {"tokens": tokens, "seconds": time.perf_counter() - began, **metrics}
        checkpoints.append_metrics(Path(t.config.output_dir), step, record, ACCEPTANCE)
        if on_metrics is not None:
            on_metrics(step, metrics)
        progress.acceptance = figures.summary()
        print(f"step {step}/{t.total}: held-out acceptance: {progress.acceptance}", flush=True)
    return figures.metrics()


# (method, rolling, metric name) of the held-out decoded check after the export
DECODED_CHECKS = (
    ("jacobi", False, "decoded_tpf"),
    ("jacobi", True, "decoded_rolling_tpf"),
    ("multiblock", False, "decoded_multiblock_tpf"),
)


def _decoded_check(t: Trainer, final: Path, simulated: dict, on_metrics: Callable[[int, dict], None] | None) -> None:
    """Rank 0, after the export: decode the measured held-out prompts with the exported model, prompt lookup off,
    and record its TPF: Jacobi beside the last simulated figure, so a run says how far the simulation is off; the
    rolling window, which never opens a fresh block of filler; and multiblock (2 blocks in flight, recycled n-grams),
    whose next block is already drafted when one ends."""
    from jfcore.decoding import DecodeConfig, decode
    from jfcore.models import ModelConfig

    model, _ = load_model(ModelConfig(name_or_path=str(final), device=str(t.device)))
    examples = acceptance.examples(t.heldout)
    prompts, tokens = [e.prompt for e in examples], t.config.acceptance.tokens
    metrics = {}
    for n in _block_sizes(t):
        for method, rolling, name in DECODED_CHECKS:
            config = DecodeConfig(
                method=method,
                block_size=n,
                rolling=rolling and n > 1,
                ngram_size=max(n, 2),
                max_new_tokens=tokens,
                seed=t.config.seed,
            )
            out = decode(model, prompts, config)
            metrics[f"heldout/{name}_n{n}"] = out.stats.tpf
    # Lossless decoding returns the model's greedy text: the share of prompts where it is still the text the model
    # was trained on (the trajectories' fixed points), a cheap sign of how far training moved the model's answers.
    same = sum(o == e.response[:tokens] for o, e in zip(out.sequences, examples))
    metrics["heldout/greedy_unchanged"] = same / len(examples)
    # Text that drifted into loops drafts itself: its repetition beside the trained-on text's says whether a higher
    # TPF came from drafting better or from repeating more (jfcore/evaluation/repetition.py).
    metrics["heldout/repetition"] = sum(map(repeated_share, out.sequences)) / len(examples)
    metrics["heldout/reference_repetition"] = sum(repeated_share(e.response[:tokens]) for e in examples) / len(examples)
    checkpoints.append_metrics(Path(t.config.output_dir), t.total, {"decoded": True, **metrics}, ACCEPTANCE)
    if on_metrics is not None:
        on_metrics(t.total, metrics)
    shown = ", ".join(f"{k.removeprefix('heldout/')} {v:.3f}" for k, v in metrics.items())
    print(f"step {t.total}/{t.total}: held-out, decoded by the exported model: {shown}", flush=True)
    for n in _block_sizes(t):
        guess, real = simulated.get(f"heldout/simulated_tpf_n{n}"), metrics[f"heldout/decoded_tpf_n{n}"]
        if guess:
            print(
                f"  n{n}: simulated TPF {guess:.3f}, decoded {real:.3f} ({100 * (guess / real - 1):+.1f}%)", flush=True
            )


class _Progress:
    """Rank 0's progress lines (the launcher relays them): at the first and last step and at most every
    PROGRESS_EVERY_S, the step's losses, throughput and time left. A step longer than that (a big model, a
    loaded host) gets a heartbeat line from a thread instead, so an operator never waits long for news."""

    def __init__(self, start: int, total: int):
        self.start, self.total, self.done = start, total, start
        self.acceptance: str | None = None  # the latest held-out measurement, repeated on each line
        self.began = self.last = time.perf_counter()
        self.lock, self.stopped = threading.Lock(), threading.Event()
        threading.Thread(target=self._heartbeat, name="progress-heartbeat", daemon=True).start()

    def report(self, step: int, metrics: dict) -> None:
        with self.lock:
            now, self.done = time.perf_counter(), step
            if step not in (self.start + 1, self.total) and now - self.last < PROGRESS_EVERY_S:
                return
            self.last = now
            print(
                f"step {step}/{self.total}: loss {metrics['loss']:.3f} (ar {metrics['ar_loss']:.3f}, consistency "
                f"{metrics['consistency_loss']:.3f}, copy {metrics['copy_loss']:.3f}, "
                f"repeat {metrics['repeat_loss']:.3f}), "
                f"lr {metrics['learning_rate']:.2e}, "
                f"{metrics['tokens_per_second']:.0f} tokens/s, ETA {self._eta(now) / 60:.1f} min"
                + (f"; held-out {self.acceptance}" if self.acceptance else ""),
                flush=True,
            )

    def close(self) -> None:
        self.stopped.set()

    def _eta(self, now: float) -> float:
        """Seconds left at the pace so far (counting the running step as half done, before the first ends)."""
        steps = max(self.done - self.start, 0.5)
        return (now - self.began) / steps * (self.total - self.done)

    def _heartbeat(self) -> None:
        while not self.stopped.wait(PROGRESS_EVERY_S / 6):
            with self.lock:
                now = time.perf_counter()
                if now - self.last < PROGRESS_EVERY_S or self.done >= self.total:
                    continue
                self.last = now
                print(
                    f"step {self.done + 1}/{self.total} still running ({now - self.began:.0f} s since the start), "
                    f"ETA {self._eta(now) / 60:.1f} min",
                    flush=True,
                )


def _plain_grad_norm(engine) -> float | None:
    """The gradient norm DeepSpeed computes but does not keep without ZeRO (stage 0, float32): None where it keeps
    one (ZeRO, and the mixed-precision wrappers, which report `_global_grad_norm`).

    Called after the boundary backward, where stage 0 has already all-reduced the gradients."""
    if engine.zero_optimization_stage() != 0 or hasattr(engine.optimizer, "_global_grad_norm"):
        return None
    norms = [p.grad.float().norm() for p in engine.module.parameters() if p.grad is not None]
    return torch.stack(norms).norm().item() if norms else None
