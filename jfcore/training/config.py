"""The training recipe: one typed config, checked when loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from jfcore.config import check
from jfcore.models import ModelConfig

ConsistencyTarget = Literal["clean", "fixed_point"]  # what a noisy logit learns from (TrainConfig)


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters instead of full fine-tuning: only the adapters train (and hold optimizer state), with
    the same losses; the export merges them into the weights, so the result is still a plain checkpoint."""

    rank: int = 16
    alpha: float = 32.0  # the adapters' update is scaled by alpha / rank
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"  # module names, or every linear layer but the output head

    def __post_init__(self) -> None:
        check(self.rank >= 1, f"LoraConfig.rank: must be >= 1, got {self.rank}")
        check(self.alpha > 0, f"LoraConfig.alpha: must be > 0, got {self.alpha}")
        check(0 <= self.dropout < 1, f"LoraConfig.dropout: must be in [0, 1), got {self.dropout}")
        check(bool(self.target_modules), "LoraConfig.target_modules: name at least one module, or 'all-linear'")


@dataclass(frozen=True, kw_only=True)
class AcceptanceConfig:
    """Acceptance measured on the packed data's held-out prompts while training (jfcore/training/acceptance.py):
    before the first step, every `every` steps and after the last. Nothing is measured when packing held out no
    prompts (packing.heldout_fraction)."""

    every: int = 50  # optimizer steps between measurements; 0: never
    block_sizes: tuple[int, ...] = ()  # block sizes of the simulated Jacobi decoding; empty: the trained one
    prompts: int = 16  # held-out prompts measured (the first ones by id)
    tokens: int = 64  # reference response tokens per prompt that the simulation decodes
    decode: bool = True  # after the last step, decode the same prompts with the trained model and compare

    def __post_init__(self) -> None:
        check(self.every >= 0, f"AcceptanceConfig.every: must be >= 0, got {self.every}")
        check(
            all(n >= 2 for n in self.block_sizes),
            f"AcceptanceConfig.block_sizes: Jacobi blocks are >= 2 tokens, got {self.block_sizes}",
        )
        check(self.prompts >= 1, f"AcceptanceConfig.prompts: must be >= 1, got {self.prompts}")
        check(self.tokens >= 2, f"AcceptanceConfig.tokens: must be >= 2, got {self.tokens}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    data: str  # a packing output folder (packed-*.parquet + stats.json)
    output_dir: str  # checkpoints/, metrics.jsonl and the exported final/ model
    model: ModelConfig = field(default_factory=ModelConfig)  # the model to distill (a previous stage's final/ works)
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; stops early when set (otherwise epochs decide)
    micro_batch_size: int = 1  # packed sequences per process per forward
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_ratio: float = 0.03  # of all optimizer steps, linear from 0
    # After warmup: cosine decay to 0, the rate held, or held and then decayed linearly to 0 over the last
    # `decay_ratio` of the steps ("wsd": warmup, stable, decay).
    lr_schedule: Literal["cosine", "constant", "wsd"] = "cosine"
    decay_ratio: float = 0.2  # of all optimizer steps; only "wsd" reads it
    max_grad_norm: float = 1.0  # 0 disables clipping
    ar_weight: float = 10.0  # lambda in L = L_pc + lambda * L_AR
    # L_AR scores the response (the model's own greedy text) alone by default; true adds the prompt's next-token
    # pairs, which teach the model its prompts rather than keep its own text (docs/TRAINING.md, "Losses").
    ar_on_prompt: bool = False
    # What a noisy block sees of the blocks before it (jfcore/training/mask.py): their noisy states ("noisy", the
    # published mask, as a later block of multiblock decoding sees the drafts before it) or their fixed points
    # ("clean", as a single Jacobi block sees its committed text).
    noisy_context: Literal["noisy", "clean"] = "noisy"
    temperature: float = 1.0  # tau of the consistency loss
    # What a noisy logit learns from: the clean logit of the same forward, detached ("clean", the published
    # objective; it moves with the model), or the fixed point's token, fixed by the trajectories ("fixed_point":
    # hard cross-entropy, tau unused), which a model cannot meet by caring less about its context.
    consistency_target: ConsistencyTarget = "clean"
    # Whose clean logits the soft targets are: this forward's own ("self", the published objective: L_AR is
    # cross-entropy on the fixed points' tokens), or a frozen copy of the starting model reading the clean stream
    # ("frozen": it is L_pc's teacher and L_AR becomes KL(frozen || model), 0 until the model drifts; one more
    # forward per micro batch, no backward). Measured, the text still drifts through L_pc (docs/TRAINING.md).
    teacher: Literal["self", "frozen"] = "self"
    # What L_AR asks of the clean stream: its likelihood (cross-entropy on the fixed points' tokens with its own
    # teacher, KL to the frozen one), or only that each fixed point's token stay the argmax by `ar_margin` logits
    # ("margin": mean hinge max(0, margin - (z_token - max other z)), 0 once it holds). The greedy text is what a
    # user keeps; the rest of the distribution is left free for the drafts (docs/TRAINING.md, "Losses").
    ar_loss: Literal["likelihood", "margin"] = "likelihood"
    ar_margin: float = 1.0  # logits; only "margin" reads it
    # Score only consistency pairs at offsets 0 .. k-1 past a block's first wrong token (None: all). The far ones
    # ask for a token after several wrong ones, which natural text rarely allows, and they are most of the pairs.
    consistency_offsets: int | None = None
    # Score the consistency pairs whose fixed-point token prompt lookup would copy from the text before it ("keep"),
    # or leave them out ("skip"). Decoding with lookup gets those tokens without the drafts, and learning to predict
    # them from a noisy block teaches the model to copy, which its greedy text then does more (docs/TRAINING.md).
    consistency_copies: Literal["keep", "skip"] = "keep"
    # beta of the copy penalty L_copy: -log(1 - p) of the token prompt lookup would copy where the text goes on
    # otherwise, on the clean stream (jfcore/training/losses.py). The drafts' gain comes with a bias to copy
    # earlier text, which makes the greedy text repeat itself; 0 leaves it free (docs/TRAINING.md, "Losses").
    copy_unlikelihood: float = 0.0
    # beta_r of the repeat penalty L_repeat: -log(1 - p) of the last few tokens (other than the next one) on the
    # clean stream. Trained models fall into short loops, a newline after a newline, where their text goes on, most
    # on prompts unlike their training ones; 0 leaves it free (docs/TRAINING.md, "Losses").
    repeat_unlikelihood: float = 0.0
    precision: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    attention: Literal["auto", "flex", "sdpa", "eager"] = "auto"  # auto: flex on GPU, sdpa on CPU
    gradient_checkpointing: bool = False
    checkpoint_every: int = 50  # optimizer steps between checkpoints (and one at the end)
    keep_checkpoints: int = 2  # older checkpoints are deleted
    export_steps: tuple[
        int, ...
    ] = ()  # also export a plain checkpoint to exports/step-N/ at these steps (learning curves)
    resume: bool = True  # continue from the newest complete checkpoint in output_dir; false discards them
    lora: LoraConfig | None = None  # train low-rank adapters only (needs peft); None: full fine-tuning
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        check(bool(self.data), "TrainConfig.data: name the packing output folder")
        check(bool(self.output_dir), "TrainConfig.output_dir: must not be empty")
        for name in (
            "epochs",
            "micro_batch_size",
            "gradient_accumulation_steps",
            "checkpoint_every",
            "keep_checkpoints",
        ):
            check(getattr(self, name) >= 1, f"TrainConfig.{name}: must be >= 1, got {getattr(self, name)}")
        check(
            self.max_steps is None or self.max_steps >= 1, f"TrainConfig.max_steps: must be >= 1, got {self.max_steps}"
        )
        check(
            self.consistency_offsets is None or self.consistency_offsets >= 1,
            f"TrainConfig.consistency_offsets: must be >= 1 (or null: every offset), got {self.consistency_offsets}",
        )
        check(
            all(step >= 1 for step in self.export_steps),
            f"TrainConfig.export_steps: must be >= 1, got {self.export_steps}",
        )
        check(self.learning_rate > 0, f"TrainConfig.learning_rate: must be > 0, got {self.learning_rate}")
        check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"TrainConfig.betas: {self.betas} are not two values in [0, 1)",
        )
        check(0 <= self.warmup_ratio < 1, f"TrainConfig.warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
        check(
            self.lr_schedule != "wsd" or 0 < self.decay_ratio <= 1 - self.warmup_ratio,
            f"TrainConfig.decay_ratio: must be in (0, 1 - warmup_ratio = {1 - self.warmup_ratio:g}], "
            f"got {self.decay_ratio}",
        )
        check(self.max_grad_norm >= 0, f"TrainConfig.max_grad_norm: must be >= 0, got {self.max_grad_norm}")
        check(self.ar_weight >= 0, f"TrainConfig.ar_weight: must be >= 0, got {self.ar_weight}")
        check(self.copy_unlikelihood >= 0, f"TrainConfig.copy_unlikelihood: must be >= 0, got {self.copy_unlikelihood}")
        check(
            self.repeat_unlikelihood >= 0,
            f"TrainConfig.repeat_unlikelihood: must be >= 0, got {self.repeat_unlikelihood}",
        )
        check(self.ar_margin > 0, f"TrainConfig.ar_margin: must be > 0 (logits), got {self.ar_margin}")
        check(self.temperature > 0, f"TrainConfig.temperature: must be > 0, got {self.temperature}")
        check(
            self.model.dtype == "float32",
            f"TrainConfig.model.dtype: training keeps float32 master weights, got {self.model.dtype!r}; "
            "set the compute precision with TrainConfig.precision instead",
        )
