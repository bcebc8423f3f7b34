"""Training losses (docs/DESIGN.md, section 6): L = L_pc + lambda * L_AR.

Reductions, made explicit because they change the effective weights:
- L_AR: per row, the mean cross-entropy over its scored clean-stream targets; then the mean over the B rows
  (a row with none adds 0). The penalties below reduce the same way.
- L_pc: per row, the mean over its kept (student, teacher) pairs of the soft
  cross-entropy tau^2 * H(softmax(teacher / tau), softmax(student / tau)),
  divided once more by the row's number of blocks T; then the mean over rows.
  A row with no kept pair (every noisy block equal to its clean block) adds 0.
  `collate` folds all of this into per-pair weights.
Every term is thus a mean of per-row means, which is what gradient accumulation over one-row micro batches gives:
a step's loss and gradient do not depend on how its rows are split into micro batches (micro_batch_size 4 with no
accumulation trains as micro_batch_size 1 with 4 accumulation steps does, in fewer and wider forwards).
The teacher is the same forward's clean stream, detached: no gradient reaches it. With
consistency_target "fixed_point" the student learns instead the fixed point's token that teacher
logit predicts (hard cross-entropy, same pair weights; a pair past the response's end adds 0).

With a frozen teacher (TrainConfig.teacher "frozen", docs/TRAINING.md "Losses") the soft targets are the logits of a
frozen copy of the starting model reading the clean stream (`frozen`, flat over [B * Lc]) instead: L_pc's teacher
logits, and L_AR becomes KL(frozen || model) over the same positions, which is 0 where the model still predicts
what it did and, unlike cross-entropy on the greedy tokens, never rewards sharpening its own text.

With a margin (TrainConfig.ar_loss "margin", either teacher) L_AR asks only that each scored clean position's argmax
stay the fixed point's token, by `margin` logits over the next best: the mean over those positions of
max(0, margin - (z_target - max_{v != target} z_v)). It is 0 wherever that holds, so it keeps the greedy text and
leaves the rest of the distribution to the consistency term.

With a copy penalty (TrainConfig.copy_unlikelihood, beta) L gains beta * L_copy: over the scored clean positions
whose target differs from the token prompt lookup would propose there (a wrong copy of earlier text), the mean of
-log(1 - p(wrong copy)). Trained models learn to put probability on such copies, and their greedy text repeats
itself (docs/TRAINING.md); this unlikelihood term asks the clean stream not to, and nothing of the noisy one.

With a repeat penalty (TrainConfig.repeat_unlikelihood, beta_r) L gains beta_r * L_repeat: over the scored clean
positions, the mean of -log(1 - p(C)), C the last few tokens up to the position other than its target (batch.py,
REPEAT_WINDOW). Trained models fall into short loops (a newline after a newline, ",,,,") where the text goes on;
this asks the clean stream not to loop where its text does not, and nothing of the noisy one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jfcore.training.batch import IGNORE, PackedBatch
from jfcore.training.config import ConsistencyTarget


@dataclass
class Losses:
    total: torch.Tensor
    ar: torch.Tensor
    consistency: torch.Tensor
    copy: torch.Tensor
    repeat: torch.Tensor


@dataclass
class _Scored:
    """The clean-stream logits that L_AR and both penalties read, in float32, with their log-partition: gathered and
    computed once per batch, since these vocabulary-wide passes are a large share of a small model's step."""

    z: torch.Tensor  # [A, V]
    lse: torch.Tensor  # [A]
    flat: torch.Tensor  # all the logits, [B * L, V]
    rows: torch.Tensor  # [A] each scored position's row
    num_rows: int  # B

    def nothing(self) -> torch.Tensor:
        """A zero that depends on the logits: an empty term keeps the graph (and DeepSpeed's hooks) intact."""
        return self.flat.sum() * 0.0

    def row_mean(self, values: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The mean of `values` within each row (`rows`, default every scored position's), then over all B rows."""
        rows = self.rows if rows is None else rows
        counts = torch.bincount(rows, minlength=self.num_rows).to(values.dtype)
        return (values / counts[rows]).sum() / self.num_rows


def _scored(logits: torch.Tensor, batch: PackedBatch) -> _Scored:
    flat = logits.reshape(-1, logits.shape[-1])
    positions, B = batch.ar_positions.to(flat.device), batch.input_ids.shape[0]
    z = flat[positions].float()
    rows = positions // (flat.shape[0] // B)  # flat indices run row by row
    return _Scored(z, torch.logsumexp(z, dim=-1), flat, rows, B)


def _ar(s: _Scored, batch: PackedBatch, frozen: torch.Tensor | None, margin: float | None) -> torch.Tensor:
    if s.z.shape[0] == 0:
        return s.nothing()
    target = batch.ar_targets.to(s.z.device)[:, None]
    chosen = s.z.gather(1, target)[:, 0]
    if margin is not None:
        best_other = s.z.scatter(1, target, float("-inf")).max(-1).values
        return s.row_mean(F.relu(margin - (chosen - best_other)))
    if frozen is None:
        return s.row_mean(s.lse - chosen)  # cross-entropy
    teacher = F.log_softmax(frozen[batch.clean_index[batch.ar_positions]].detach().float(), dim=-1)
    return s.row_mean(F.kl_div(s.z - s.lse[:, None], teacher, log_target=True, reduction="none").sum(-1))


def _unlikelihood(s: _Scored, candidates: torch.Tensor) -> torch.Tensor:
    """Mean -log(1 - p(C)) over the scored clean positions, C the row of `candidates` ([A, K], IGNORE-padded after
    the real ones) at each, per row and then over rows; positions with no candidate are left out (a row with none
    adds 0)."""
    candidates = candidates.to(s.z.device)
    has = candidates[:, 0] != IGNORE
    if not bool(has.any()):
        return s.nothing()
    z, lse, rows, chosen = s.z, s.lse, s.rows, candidates
    if not bool(has.all()):
        z, lse, rows, chosen = z[has], lse[has], rows[has], chosen[has]
    chosen = torch.where(chosen == IGNORE, chosen[:, :1], chosen)  # padding repeats the first: the same set
    # log(1 - p(C)) = logsumexp over the tokens outside C - logsumexp over all: exact where p(C) is near 1.
    rest = torch.logsumexp(z.scatter(1, chosen, float("-inf")), dim=-1)
    return s.row_mean(lse - rest, rows)


def ar_loss(
    logits: torch.Tensor, batch: PackedBatch, frozen: torch.Tensor | None = None, margin: float | None = None
) -> torch.Tensor:
    if frozen is not None:
        frozen = frozen.reshape(-1, frozen.shape[-1])
    return _ar(_scored(logits, batch), batch, frozen, margin)


def copy_loss(logits: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Mean -log(1 - p(wrong copy)) over the scored clean positions that have one (0 where none has)."""
    return _unlikelihood(_scored(logits, batch), batch.ar_wrong_copies[:, None])


def repeat_loss(logits: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Mean -log(1 - p(recent tokens other than the target)) over the scored clean positions."""
    return _unlikelihood(_scored(logits, batch), batch.ar_recent)


def consistency_loss(
    logits: torch.Tensor,
    batch: PackedBatch,
    temperature: float,
    target: ConsistencyTarget = "clean",
    frozen: torch.Tensor | None = None,
) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1])
    if batch.student_positions.numel() == 0:
        return flat.sum() * 0.0
    student = flat[batch.student_positions].float()
    if target == "fixed_point":
        targets = batch.pair_targets.to(flat.device)
        per_pair = F.cross_entropy(student, targets, ignore_index=IGNORE, reduction="none")
    else:
        source = flat[batch.teacher_positions] if frozen is None else frozen[batch.clean_index[batch.teacher_positions]]
        teacher = F.softmax(source.detach().float() / temperature, dim=-1)
        per_pair = -(teacher * F.log_softmax(student / temperature, dim=-1)).sum(-1) * temperature**2
    return (per_pair * batch.pair_weights.to(per_pair.device)).sum()


def jacobi_forcing_loss(
    logits: torch.Tensor,
    batch: PackedBatch,
    ar_weight: float,
    temperature: float,
    target: ConsistencyTarget = "clean",
    frozen: torch.Tensor | None = None,
    margin: float | None = None,
    copy_weight: float = 0.0,
    repeat_weight: float = 0.0,
) -> Losses:
    """`frozen`: a frozen teacher's logits over the clean stream ([B, Lc, V] or flat), or None: the model's own.
    `margin`: L_AR as the argmax hinge with that margin instead of the likelihood. `copy_weight`: beta of L_copy;
    `repeat_weight`: beta_r of L_repeat. Both penalties are measured whatever their weights, for the logs."""
    if frozen is not None:
        frozen = frozen.reshape(-1, frozen.shape[-1])
    scored = _scored(logits, batch)
    ar = _ar(scored, batch, frozen, margin)
    pc = consistency_loss(logits, batch, temperature, target, frozen)
    copy, repeat = _unlikelihood(scored, batch.ar_wrong_copies[:, None]), _unlikelihood(scored, batch.ar_recent)
    total = pc + ar_weight * ar + (copy_weight * copy if copy_weight else 0.0)
    total = total + (repeat_weight * repeat if repeat_weight else 0.0)
    return Losses(total=total, ar=ar.detach(), consistency=pc.detach(), copy=copy.detach(), repeat=repeat.detach())
