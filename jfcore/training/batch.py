"""Packed training sequences as tensors: streams, AR targets and consistency pairs.

A packed row (jfcore.packing.PACKED_SCHEMA) is [prompt][k_0][l_0]...[k_{T-1}][l_{T-1}].
Every token gets a stream: PROMPT, NOISY (k_j), CLEAN (l_j) or PAD (block padding
past `valid_lengths`, and the right padding that makes a batch rectangular).
The mask (jfcore.training.mask) needs only the streams; the losses need index
pairs into the flattened [B * L] logits, computed here once on the host.

Which logits count (a logit at a position predicts the next token of its stream):
- AR: every clean-stream pair (in-block pairs, the bridge from l_j's last token
  to l_{j+1}'s first, the prompt's last token to l_0's first, and with
  `ar_prompt` the prompt's own pairs) whose target is not past the response's
  first EOS. EOS inside the prompt (chat templates end turns with it) is ordinary.
- Consistency: for block j with first mismatch d_j, offsets t in [d_j, m_j)
  (m_j its valid length) whose prediction is not past the first EOS either,
  pairing the noisy logit at k_j+t (student) with the clean one at l_j+t (teacher), and with the
  fixed point's token that clean logit predicts (none past the response's end). With `max_offset`
  k, only offsets t - d_j < k count: the student's input reaches at most k - 1 tokens past the
  block's first wrong one.
- Copyable pairs: those whose fixed-point token prompt lookup would propose from the clean text before it
  (jfcore.training.copies). Decoding gets those tokens without the model's drafts;
  `copy_pairs=False` leaves them out of L_pc (TrainConfig.consistency_copies), and acceptance counts them apart.
- Wrong copies: for each AR target in the response, the token prompt lookup would propose in its place when that is
  a different token: what a model biased to copy would say instead (TrainConfig.copy_unlikelihood).
- Recent tokens: for each AR target, the last `REPEAT_WINDOW` clean-stream tokens up to its scoring position that
  differ from it, each once: what a model caught in a short loop (newline after newline, ",,,,") would say instead
  (TrainConfig.repeat_unlikelihood).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from jfcore.training.copies import lookup_candidates

if TYPE_CHECKING:
    from jfcore.training.config import TrainConfig

PAD, PROMPT, NOISY, CLEAN = -1, 0, 1, 2
IGNORE = -100  # a pair target with no token: cross-entropy's ignore_index
# Loops of up to this many tokens are what the repeat penalty's candidates cover. The trained models' loops that
# were measured repeat one token (a newline, ",", "]") or two ("(" and a newline): docs/TRAINING.md, "Losses".
REPEAT_WINDOW = 4


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [B, L] long
    position_ids: torch.Tensor  # [B, L] long
    streams: torch.Tensor  # [B, L] int8: PAD / PROMPT / NOISY / CLEAN
    blocks: torch.Tensor  # [B, L] int32: j for k_j and l_j (their padding too), -1 for the prompt and row padding
    ar_positions: torch.Tensor  # [A] flat indices into B*L whose logits are scored ...
    ar_targets: torch.Tensor  # [A] ... against these tokens
    ar_wrong_copies: torch.Tensor  # [A] lookup's candidate where it differs from the target, else IGNORE
    ar_recent: torch.Tensor  # [A, REPEAT_WINDOW] recent tokens other than the target, newest first, then IGNORE
    student_positions: torch.Tensor  # [C] flat indices of noisy logits ...
    teacher_positions: torch.Tensor  # [C] ... and of the clean logits they learn from
    pair_weights: torch.Tensor  # [C] float: 1 / (kept pairs of its row * T of its row * B)
    pair_offsets: torch.Tensor  # [C] t - d_j: how far past its block's first wrong token the student's input reaches
    pair_targets: torch.Tensor  # [C] the fixed point's token the teacher's logit predicts (IGNORE: past the response)
    pair_copyable: torch.Tensor  # [C] bool: prompt lookup would propose that token from the clean text before it
    # The clean stream alone (prompt, then each l_j's valid tokens), right-padded: what a frozen teacher reads with
    # an ordinary causal mask (TrainConfig.teacher "frozen").
    clean_ids: torch.Tensor  # [B, Lc] long
    clean_position_ids: torch.Tensor  # [B, Lc] long
    clean_attention: torch.Tensor  # [B, Lc] long: 1 for a token, 0 for padding
    clean_index: torch.Tensor  # [B * L] long: a packed position's flat index into [B * Lc]; -1 off the clean stream
    tokens: int  # real (non-PAD) tokens: what tokens/s counts

    def to(self, device: torch.device | str) -> PackedBatch:
        moved = {
            k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()
        }
        return PackedBatch(**moved)


@dataclass
class _Row:
    streams: list[int]
    blocks: list[int]
    ar: list[tuple[int, int, int, list[int]]]  # (position, target token, wrong copy or IGNORE, recent tokens)
    pairs: list[tuple[int, int, int, int, bool]]  # (student position, teacher position, offset, target, copyable)
    clean: list[int]  # the clean stream's positions, in order


def recent_tokens(stream: Sequence[int], index: int) -> list[int]:
    """The last `REPEAT_WINDOW` tokens of `stream` up to `index`, newest first, each once, without the next token
    `stream[index + 1]`: what a short loop would say at `index` where the text goes on (L_repeat's candidates)."""
    window = (stream[k] for k in range(index, max(-1, index - REPEAT_WINDOW), -1))
    return list(dict.fromkeys(token for token in window if token != stream[index + 1]))


def _layout(
    row: dict, eos_token_id: int | None, ar_prompt: bool, max_offset: int | None, copy_pairs: bool = True
) -> _Row:
    """Streams and scored positions of one packed row (positions within the row)."""
    ids, P, n, T = row["input_ids"], row["prompt_length"], row["block_size"], row["num_blocks"]
    mismatch, valid = row["first_mismatch"], row["valid_lengths"]
    if len(ids) != P + 2 * T * n or len(mismatch) != T or len(valid) != T:
        raise ValueError(
            f"packed row {row.get('prompt_id')!r}: length {len(ids)} with P={P}, n={n}, T={T} "
            f"({len(mismatch)} mismatches, {len(valid)} valid lengths); the shard is not a packed shard, repack it"
        )
    streams, blocks = [PROMPT] * P, [-1] * P
    clean_positions = list(range(P))  # the clean stream, in order: prompt then each l_j's valid tokens
    response_start = P
    for j in range(T):
        m = valid[j]
        block = [NOISY] * m + [PAD] * (n - m)
        streams += block + [CLEAN if s == NOISY else PAD for s in block]
        blocks += [j] * (2 * n)
        clean_positions += range(P + (2 * j + 1) * n, P + (2 * j + 1) * n + m)
    stream = [ids[p] for p in clean_positions]
    # Response index of the first EOS: targets beyond it are ignored.
    response = stream[response_start:]
    eos_at = response.index(eos_token_id) if eos_token_id is not None and eos_token_id in response else len(response)
    last_target = response_start + eos_at  # index into clean_positions of the last scored target
    copies = lookup_candidates(ids[:P], response) if P else [-1] * len(response)  # by response index

    def wrong_copy(index: int) -> int:  # lookup's candidate for clean_positions[index]'s token, if another token
        candidate = copies[index - P] if index >= P else -1
        return candidate if candidate not in (-1, stream[index]) else IGNORE

    def recent(index: int) -> list[int]:  # recent_tokens at clean_positions[index], padded to REPEAT_WINDOW
        found = recent_tokens(stream, index)
        return found + [IGNORE] * (REPEAT_WINDOW - len(found))

    first = 0 if ar_prompt else P - 1  # P - 1: the prompt's last token, which predicts the response's first
    ar = [
        (clean_positions[i], stream[i + 1], wrong_copy(i + 1), recent(i))
        for i in range(first, min(len(clean_positions) - 1, last_target))
    ]
    pairs, seen = [], P  # `seen`: response tokens before block j
    for j in range(T):
        noisy, clean = P + 2 * j * n, P + (2 * j + 1) * n
        stop = valid[j] if max_offset is None else min(valid[j], mismatch[j] + max_offset)
        for t in range(mismatch[j], stop):
            if seen + t < last_target:  # logit at response index seen+t predicts index seen+t+1
                after = seen + t + 1
                target = stream[after] if after < len(clean_positions) else IGNORE
                copyable = target != IGNORE and copies[after - P] == target
                if copy_pairs or not copyable:
                    pairs.append((noisy + t, clean + t, t - mismatch[j], target, copyable))
        seen += valid[j]
    return _Row(streams, blocks, ar, pairs, clean_positions)


def collate_for(config: TrainConfig, rows: Sequence[dict], pad_token_id: int, eos_token_id: int | None) -> PackedBatch:
    """The batch a training step scores under `config`: which AR targets and consistency pairs count."""
    return collate(
        rows,
        pad_token_id,
        eos_token_id,
        config.ar_on_prompt,
        config.consistency_offsets,
        copy_pairs=config.consistency_copies == "keep",
    )


def clean_stream(row: dict) -> list[int]:
    """A packed row's clean stream: its prompt, then each fixed-point block's valid tokens."""
    return [row["input_ids"][p] for p in _layout(row, None, False, None).clean]


def collate(
    rows: Sequence[dict],
    pad_token_id: int,
    eos_token_id: int | None,
    ar_prompt: bool = True,
    max_offset: int | None = None,
    copy_pairs: bool = True,
) -> PackedBatch:
    """Right-pad packed rows into one batch with its loss indices (`ar_prompt`: score the prompt's own next-token
    pairs in L_AR too; `max_offset`: keep consistency pairs only that far past a block's first mismatch;
    `copy_pairs` false: leave out the pairs whose target prompt lookup would copy)."""
    layouts = [_layout(r, eos_token_id, ar_prompt, max_offset, copy_pairs) for r in rows]
    B, L = len(rows), max(len(r["input_ids"]) for r in rows)
    Lc = max(len(lay.clean) for lay in layouts)
    clean_ids = torch.full((B, Lc), pad_token_id, dtype=torch.long)
    clean_position_ids = torch.zeros((B, Lc), dtype=torch.long)
    clean_attention = torch.zeros((B, Lc), dtype=torch.long)
    clean_index = torch.full((B * L,), -1, dtype=torch.long)
    input_ids = torch.full((B, L), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((B, L), dtype=torch.long)
    streams = torch.full((B, L), PAD, dtype=torch.int8)
    blocks = torch.full((B, L), -1, dtype=torch.int32)
    ar_pos, ar_tgt, ar_wrong, ar_recent, student, teacher, weights, offsets, targets, copyable = ([] for _ in range(10))
    for b, (row, lay) in enumerate(zip(rows, layouts)):
        width = len(row["input_ids"])
        input_ids[b, :width] = torch.tensor(row["input_ids"])
        position_ids[b, :width] = torch.tensor(row["position_ids"])
        streams[b, :width] = torch.tensor(lay.streams, dtype=torch.int8)
        blocks[b, :width] = torch.tensor(lay.blocks, dtype=torch.int32)
        clean = torch.tensor(lay.clean, dtype=torch.long)
        clean_ids[b, : len(clean)] = input_ids[b, clean]
        clean_position_ids[b, : len(clean)] = position_ids[b, clean]
        clean_attention[b, : len(clean)] = 1
        clean_index[b * L + clean] = b * Lc + torch.arange(len(clean))
        ar_pos += [b * L + p for p, _, _, _ in lay.ar]
        ar_tgt += [t for _, t, _, _ in lay.ar]
        ar_wrong += [w for _, _, w, _ in lay.ar]
        ar_recent += [r for _, _, _, r in lay.ar]
        student += [b * L + pair[0] for pair in lay.pairs]
        teacher += [b * L + pair[1] for pair in lay.pairs]
        offsets += [pair[2] for pair in lay.pairs]
        targets += [pair[3] for pair in lay.pairs]
        copyable += [pair[4] for pair in lay.pairs]
        if lay.pairs:
            weights += [1.0 / (len(lay.pairs) * row["num_blocks"] * B)] * len(lay.pairs)
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        streams=streams,
        blocks=blocks,
        ar_positions=torch.tensor(ar_pos, dtype=torch.long),
        ar_targets=torch.tensor(ar_tgt, dtype=torch.long),
        ar_wrong_copies=torch.tensor(ar_wrong, dtype=torch.long),
        ar_recent=torch.tensor(ar_recent, dtype=torch.long).reshape(-1, REPEAT_WINDOW),
        student_positions=torch.tensor(student, dtype=torch.long),
        teacher_positions=torch.tensor(teacher, dtype=torch.long),
        pair_weights=torch.tensor(weights, dtype=torch.float32),
        pair_offsets=torch.tensor(offsets, dtype=torch.long),
        pair_targets=torch.tensor(targets, dtype=torch.long),
        pair_copyable=torch.tensor(copyable, dtype=torch.bool),
        clean_ids=clean_ids,
        clean_position_ids=clean_position_ids,
        clean_attention=clean_attention,
        clean_index=clean_index,
        tokens=int((streams != PAD).sum()),
    )


def scored_columns(batch: PackedBatch) -> tuple[torch.Tensor, PackedBatch]:
    """The sequence columns whose logits some loss reads, in any row, and `batch` with its flat logit indices aimed at
    logits computed there only ([B, K] instead of [B, L]; transformers' `logits_to_keep`). Most noisy positions are
    never scored (pairs start at a block's first wrong token), and the vocabulary-wide work of the LM head, its
    gradient and the logits' gradient shrinks with them."""
    B, L = batch.input_ids.shape
    flat = torch.cat([batch.ar_positions, batch.student_positions, batch.teacher_positions])
    device = flat.device
    columns = torch.unique(flat % L) if flat.numel() else torch.tensor([L - 1], device=device)  # keeps the graph whole
    where = torch.full((L,), -1, dtype=torch.long, device=device)
    where[columns] = torch.arange(len(columns), device=device)

    def aimed(positions: torch.Tensor) -> torch.Tensor:
        return positions // L * len(columns) + where[positions % L]

    scored = replace(
        batch,
        ar_positions=aimed(batch.ar_positions),
        student_positions=aimed(batch.student_positions),
        teacher_positions=aimed(batch.teacher_positions),
        clean_index=batch.clean_index.view(B, L)[:, columns].reshape(-1),
    )
    return columns, scored
