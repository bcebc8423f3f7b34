"""Acceptance measured while training, from forwards alone (docs/TRAINING.md, "Acceptance during training").

Both figures are taken on the held-out prompts that packing kept out of training (`heldout_fraction`,
jfcore/packing.py), with the model as it stands:

- Noisy accuracy: one forward over the held-out packed rows under the training mask (with its noisy context). For
  every consistency pair (a noisy block's position t at or past its first mismatch d), is the student's argmax the
  fixed point's next token? Kept by offset t - d, with the run of correct predictions from offset 0 per block: the tokens past
  the correction that the next Jacobi forward would accept from that state. Kept apart too for the pairs whose token
  prompt lookup would copy from the text before it (copyable) and the rest: decoding with lookup gets the first
  kind without the drafts, so the second is what only the model's drafts can add (docs/TRAINING.md).
- Text kept: in the same forward, the share of the clean stream's next-token predictions (the held-out fixed points,
  teacher forced) whose argmax is still the fixed point's token. The starting model's greedy text is its own fixed
  point, so this starts at 1 in float32 (bfloat16 flips a few near-ties). Any weight change flips about half the
  near-ties too, so it has a floor that is not drift (about 0.90 on SmolLM2); its fall past that is the model's
  text drifting, the price of the drafts (docs/TRAINING.md).
- Simulated TPF: greedy Jacobi decoding of every block of the held-out reference responses at once, teacher
  forced. Block j (size n) sits on the clean context (prompt + the reference response before it, prefilled
  once into a KV cache); its draft starts as the decoder's does, the model's greedy next token and then seeded
  filler drawn from that context; each iteration is one forward of every unfinished block, and the Jacobi rule
  (accept 1 + the run where draft[i+1] == argmax(logits[i]); the rest becomes the model's fresh predictions)
  runs per block until its draft is its own fixed point. TPF = tokens / forwards, prefill excluded as in decoding.
  It needs the model alone, whatever decoder an evaluation would use, and it is close to what the decoder
  measures when the model's own text follows the reference (training.acceptance.decode compares the two).

Ranks split the prompts; every forward is taken by every rank together (a rank without work runs a one-token
forward), so a ZeRO-3 engine, whose forwards gather parameters collectively, measures like the others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from jfcore.teacher_forced import block_predictions, next_draft, opening_drafts, prefill, verified
from jfcore.training.batch import clean_stream, collate
from jfcore.training.mask import NoisyContext, attention_mask

OFFSETS = 4  # noisy accuracy is kept separately for offsets 0..OFFSETS-1 past the first mismatch


@dataclass(frozen=True)
class Ranks:
    """The processes that measure together (one, or a training job's ranks) and their reductions."""

    rank: int = 0
    world: int = 1
    device: str | torch.device = "cpu"  # where a reduction's tensor goes (NCCL reduces CUDA tensors only)

    def reduce(self, values: list[float], op: str = "sum") -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor.tolist()

    def any(self, flag: bool) -> bool:
        return self.reduce([float(flag)], "max")[0] > 0

    def turns(self, items: list) -> list:
        """`items`, padded with None to the longest rank's count, so every rank takes as many turns."""
        return items + [None] * (int(self.reduce([len(items)], "max")[0]) - len(items))


@dataclass(frozen=True)
class Example:
    """A held-out prompt and the reference response it was packed with (the clean blocks, in order)."""

    prompt: list[int]
    response: list[int]


@dataclass
class Acceptance:
    """One measurement; `metrics()` names its figures as training logs them."""

    noisy_correct: list[int] = field(default_factory=lambda: [0] * (OFFSETS + 1))  # by offset, then all offsets
    noisy_pairs: list[int] = field(default_factory=lambda: [0] * (OFFSETS + 1))
    copyable_correct: int = 0  # of all offsets' pairs, those whose fixed-point token prompt lookup would copy
    copyable_pairs: int = 0
    run_tokens: int = 0  # correct predictions from offset 0, summed over blocks with pairs
    run_blocks: int = 0
    text_kept: int = 0  # clean-stream predictions whose argmax is the fixed point's token ...
    text_tokens: int = 0  # ... of these
    simulated: dict[int, tuple[int, int]] = field(default_factory=dict)  # block size -> (tokens, forwards)

    def metrics(self) -> dict[str, float]:
        out = {}
        if self.noisy_pairs[-1]:
            out["heldout/noisy_accuracy"] = self.noisy_correct[-1] / self.noisy_pairs[-1]
            for k in range(OFFSETS):
                if self.noisy_pairs[k]:
                    out[f"heldout/noisy_accuracy_at_{k}"] = self.noisy_correct[k] / self.noisy_pairs[k]
            out["heldout/copyable_share"] = self.copyable_pairs / self.noisy_pairs[-1]
            if self.copyable_pairs:
                out["heldout/noisy_accuracy_copyable"] = self.copyable_correct / self.copyable_pairs
            if rest := self.noisy_pairs[-1] - self.copyable_pairs:
                out["heldout/noisy_accuracy_uncopyable"] = (self.noisy_correct[-1] - self.copyable_correct) / rest
        if self.run_blocks:
            out["heldout/noisy_run"] = self.run_tokens / self.run_blocks
        if self.text_tokens:
            out["heldout/text_kept"] = self.text_kept / self.text_tokens
        for n, (tokens, forwards) in sorted(self.simulated.items()):
            out[f"heldout/simulated_tpf_n{n}"] = tokens / forwards
        return out

    def summary(self) -> str:
        """One line for the progress log."""
        parts = [
            f"simulated TPF n{n} {tokens / forwards:.3f}" for n, (tokens, forwards) in sorted(self.simulated.items())
        ]
        if self.noisy_pairs[-1]:
            parts.append(
                f"noisy accuracy {self.noisy_correct[-1] / self.noisy_pairs[-1]:.3f} "
                f"(at offset 0: {self.noisy_correct[0] / max(self.noisy_pairs[0], 1):.3f})"
            )
        if self.text_tokens:
            parts.append(f"text kept {self.text_kept / self.text_tokens:.3f}")
        return ", ".join(parts)


def examples(rows: Sequence[dict]) -> list[Example]:
    """The prompt and reference response of each held-out packed row."""
    out = []
    for row in rows:
        clean, P = clean_stream(row), row["prompt_length"]
        out.append(Example(clean[:P], clean[P:]))
    return out


def measure(
    model: torch.nn.Module,
    rows: Sequence[dict],
    block_sizes: Sequence[int],
    tokens: int,
    pad_token_id: int,
    eos_token_id: int | None,
    attn: str,
    ranks: Ranks | None = None,
    seed: int = 0,
    context: NoisyContext = "noisy",
) -> Acceptance:
    """Noisy accuracy and simulated TPF at each block size on `rows` (held-out packed rows): this rank's share of
    them (every `world`-th row from `rank`), summed over `ranks`."""
    ranks = ranks or Ranks()
    mine = list(rows[ranks.rank :: ranks.world])
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            result = Acceptance()
            _noisy_accuracy(model, mine, pad_token_id, eos_token_id, attn, context, result, ranks)
            cut = [Example(e.prompt, e.response[:tokens]) for e in examples(mine)]
            result.simulated = simulated_tpf(model, cut, block_sizes, pad_token_id, ranks, seed)
    finally:
        model.train(was_training)
    return result


def _noisy_accuracy(model, rows, pad, eos, attn, context, result: Acceptance, ranks: Ranks) -> None:
    device, dtype = _device_dtype(model)
    # by offset: hits, pairs; then copyable hits, copyable pairs, text kept, text tokens, run, blocks
    counts = [0] * (2 * (OFFSETS + 1) + 6)
    for row in ranks.turns(rows):
        if row is None:
            _idle_forward(model, pad, device)
            continue
        batch = collate([row], pad, eos, ar_prompt=False).to(device)
        mask = attention_mask(batch.streams, attn, dtype, batch.blocks, context)
        logits = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask, use_cache=False
        ).logits
        flat = logits.reshape(-1, logits.shape[-1])
        targets = dict(zip(batch.ar_positions.tolist(), batch.ar_targets.tolist()))  # clean position -> next token
        counts[-4] += (flat[batch.ar_positions].argmax(-1) == batch.ar_targets).sum().item()
        counts[-3] += len(targets)
        choices = flat[batch.student_positions].argmax(-1).tolist()
        running = None  # the current block's run of correct predictions from offset 0, while unbroken
        pairs = zip(choices, *(x.tolist() for x in (batch.teacher_positions, batch.pair_offsets, batch.pair_copyable)))
        for choice, teacher, offset, copyable in pairs:
            if teacher not in targets:  # the response's last token (cut by the budget): no fixed point after it
                continue
            hit = choice == targets[teacher]
            if copyable:
                counts[-6] += hit
                counts[-5] += 1
            if offset == 0:
                counts[-1] += 1
                running = True
            running = running and hit
            counts[-2] += running
            for k in ((offset,) if offset < OFFSETS else ()) + (OFFSETS,):
                counts[k] += hit
                counts[OFFSETS + 1 + k] += 1
    counts = ranks.reduce(counts)
    result.noisy_correct = [int(x) for x in counts[: OFFSETS + 1]]
    result.noisy_pairs = [int(x) for x in counts[OFFSETS + 1 : 2 * (OFFSETS + 1)]]
    result.copyable_correct, result.copyable_pairs = int(counts[-6]), int(counts[-5])
    result.text_kept, result.text_tokens = int(counts[-4]), int(counts[-3])
    result.run_tokens, result.run_blocks = int(counts[-2]), int(counts[-1])


def simulated_tpf(
    model: torch.nn.Module,
    examples: Sequence[Example],
    block_sizes: Sequence[int],
    pad_token_id: int,
    ranks: Ranks | None = None,
    seed: int = 0,
) -> dict[int, tuple[int, int]]:
    """Block size -> (tokens, forwards) of teacher-forced Jacobi decoding over every block of every example (module
    docstring), summed over `ranks`."""
    ranks = ranks or Ranks()
    device, _ = _device_dtype(model)
    totals = {n: (0, 0) for n in block_sizes}
    with _takes_additive_masks(model):
        for example in ranks.turns(list(examples)):
            if example is None:  # another rank still decodes: take part in its prefill and iterations
                _idle_forward(model, pad_token_id, device)
                for _ in block_sizes:
                    while ranks.any(False):
                        _idle_forward(model, pad_token_id, device)
                continue
            for n, (tokens, forwards) in _simulate(model, example, block_sizes, pad_token_id, ranks, seed).items():
                totals[n] = (totals[n][0] + tokens, totals[n][1] + forwards)
    summed = ranks.reduce([x for n in block_sizes for x in totals[n]])
    return {n: (int(summed[2 * i]), int(summed[2 * i + 1])) for i, n in enumerate(block_sizes)}


def _simulate(model, example: Example, sizes: Sequence[int], pad: int, ranks: Ranks, seed: int) -> dict:
    """One example's blocks at each block size, decoded together on one prefill of its clean text."""
    prompt, response = example.prompt, example.response
    text = prompt + response
    cache, greedy = prefill(model, text)
    results = {}
    for n in sizes:
        # A last block of one token is its known first token: no forward.
        drafts = {s: d for s, d in opening_drafts(text, len(prompt), n, greedy, seed).items() if len(d) > 1}
        results[n] = (len(response), _iterate(model, cache, len(text), drafts, pad, ranks))
    return results


def _iterate(model, cache, length: int, drafts: dict[int, list[int]], pad: int, ranks: Ranks) -> int:
    """Jacobi iterations of every block in `drafts` (block start -> its draft) on the cached clean text of `length`
    tokens, until each is its own fixed point; returns the forwards each block took, summed."""
    forwards = 0
    while ranks.any(bool(drafts)):
        if not drafts:
            _idle_forward(model, pad, next(model.parameters()).device)
            continue
        for s, predictions in block_predictions(model, cache, length, drafts).items():
            draft = drafts[s]
            forwards += 1
            # The response's last token needs no forward once it is the correction (the decoder ends there).
            if verified(draft, predictions) >= len(draft) - (s + len(draft) == length):
                del drafts[s]
            else:
                drafts[s] = next_draft(draft, predictions)
    return forwards


@contextlib.contextmanager
def _takes_additive_masks(model) -> Iterator[None]:
    """The simulation's 4D additive masks need an attention that takes them: a flex-attention model (GPU training)
    runs it with SDPA, switched through the public API and back."""
    current = getattr(model.config, "_attn_implementation", None)
    if current != "flex_attention":
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def _idle_forward(model, pad: int, device) -> None:
    model(input_ids=torch.tensor([[pad]], device=device), use_cache=False)


def _device_dtype(model) -> tuple[torch.device, torch.dtype]:
    parameter = next(model.parameters())
    return parameter.device, parameter.dtype
