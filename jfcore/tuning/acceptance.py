"""What a model accepts on the tuning prompts: greedy outputs, and how far its own drafts run.

Prompt-lookup acceptance needs no model: which candidate is proposed and how
much of it holds depend only on the text, and greedy decoding fixes the text
(jfcore/tuning/replay.py). So one greedy pass gives it for every
candidate length. Jacobi and multiblock drafts do need the model: one decode
per family records, for every forward, how many tokens the row's own draft
committed and how many positions it verified. All runs are batched (rows
decode independently, so acceptance does not depend on the batch); the
decoder's own time per step is measured separately at batch 1, where it
matters most.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from jfcore.decoding import DecodeConfig, StepEvent
from jfcore.decoding.decoder import Decoder


@dataclass(frozen=True)
class DraftSteps:
    """Every forward of one drafting configuration over the tuning prompts."""

    config: DecodeConfig  # method, block size, blocks, pool (no prompt lookup)
    accepted: tuple[int, ...]  # tokens committed by each row-forward (>= 1)
    widths: tuple[int, ...]  # positions each row-forward verified
    host_seconds: float  # the decoder's own time per step at batch 1 (outside the forward)

    @property
    def tpf(self) -> float:
        return sum(self.accepted) / max(len(self.accepted), 1)

    def as_dict(self) -> dict:
        counts: dict[int, int] = {}
        for a in self.accepted:
            counts[a] = counts.get(a, 0) + 1
        return {
            "method": self.config.method,
            "block_size": self.config.block_size,
            "num_blocks": self.config.num_blocks,
            "pool_size": self.config.pool_size,
            "tpf": round(self.tpf, 4),
            "mean_width": round(sum(self.widths) / max(len(self.widths), 1), 3),
            "accepted_histogram": {str(k): counts[k] for k in sorted(counts)},
            "host_seconds": self.host_seconds,
        }


@dataclass(frozen=True)
class Acceptance:
    prompts: list[list[int]]
    greedy: list[list[int]]  # each prompt's greedy continuation
    prefill_seconds: list[float]  # each prompt's prefill at batch 1
    ar_host_seconds: float  # AR's own time per step at batch 1
    # By family ("jacobi", "rolling", "multiblock") at the recorded n; "<family>@<n>" at another n.
    drafts: dict[str, DraftSteps] = field(default_factory=dict)

    def steps_for(self, kind: str, block_size: int) -> DraftSteps:
        """The record a configuration of family `kind` at `block_size` draws its runs from: of that family's
        records, the narrowest at least as wide (a window's runs depend on its width, so the nearest is the best
        stand-in), else the widest."""
        records = [d for name, d in self.drafts.items() if name.split("@")[0] == kind]
        if not records:
            raise KeyError(f"no {kind} drafts were recorded")
        wide = [d for d in records if d.config.block_size >= block_size]
        if wide:
            return min(wide, key=lambda d: d.config.block_size)
        return max(records, key=lambda d: d.config.block_size)

    def subset(self, indices: Sequence[int]) -> Acceptance:
        """The same measurements restricted to some prompts (the draft records stay pooled)."""
        pick = lambda items: [items[i] for i in indices]
        return Acceptance(
            pick(self.prompts), pick(self.greedy), pick(self.prefill_seconds), self.ar_host_seconds, self.drafts
        )

    def as_dict(self) -> dict:
        return {
            "prompts": len(self.prompts),
            "greedy_tokens": sum(map(len, self.greedy)),
            "prefill_seconds_mean": sum(self.prefill_seconds) / max(len(self.prefill_seconds), 1),
            "ar_host_seconds": self.ar_host_seconds,
            "drafts": {name: d.as_dict() for name, d in self.drafts.items()},
        }


def _run(decoder: Decoder, prompts: Sequence[list[int]]):
    return decoder.decode([list(p) for p in prompts])


@torch.inference_mode()
def greedy_pass(
    model: torch.nn.Module,
    prompts: Sequence[list[int]],
    eos: Sequence[int],
    pad: int,
    max_new_tokens: int,
    batch_size: int = 8,
    host_probe_tokens: int = 24,
    log=print,
) -> Acceptance:
    """Greedy outputs of `prompts` (batched), and at batch 1 each prompt's prefill and AR's own time per step."""
    greedy: list[list[int]] = []
    ar = DecodeConfig(method="ar", max_new_tokens=max_new_tokens)
    for start in range(0, len(prompts), batch_size):
        greedy += _run(Decoder(model, ar, eos, pad), prompts[start : start + batch_size]).sequences
    log(f"greedy pass: {sum(map(len, greedy))} tokens over {len(prompts)} prompts")
    prefill, host = [], []
    probe = DecodeConfig(method="ar", max_new_tokens=host_probe_tokens)
    for p in prompts:
        out = _run(Decoder(model, probe, eos, pad), [p])
        prefill.append(out.stats.prefill_seconds)
        host.append(_host_per_step(out.stats))
    return Acceptance(list(map(list, prompts)), greedy, prefill, _median(host))


@torch.inference_mode()
def record_drafts(
    model: torch.nn.Module,
    prompts: Sequence[list[int]],
    config: DecodeConfig,
    eos: Sequence[int],
    pad: int,
    max_new_tokens: int,
    batch_size: int = 8,
    host_probe_tokens: int = 24,
    log=print,
) -> DraftSteps:
    """Every forward of `config` (its own drafts, no prompt lookup) over `prompts`, and its own time per step."""
    accepted: list[int] = []
    widths: list[int] = []

    def record(event: StepEvent) -> None:
        accepted.extend(event.accepted)
        widths.extend(event.widths)

    config = replace(config, max_new_tokens=max_new_tokens, lookup_tokens=0)
    for start in range(0, len(prompts), batch_size):
        _run(Decoder(model, config, eos, pad, on_step=record), prompts[start : start + batch_size])
    probe = replace(config, max_new_tokens=host_probe_tokens)
    hosts = [_host_per_step(_run(Decoder(model, probe, eos, pad), [p]).stats) for p in prompts[:4]]
    steps = DraftSteps(config, tuple(accepted), tuple(widths), _median(hosts))
    log(f"{config.describe()}: TPF {steps.tpf:.2f} over {len(accepted)} row-forwards")
    return steps


def _host_per_step(stats) -> float:
    return max(stats.decode_seconds - stats.forward_seconds, 0.0) / max(stats.forward_calls, 1)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0
