"""The decoding rules in C (jfcore/decoding/rules/_step.c; docs/DESIGN.md, "Rows in C").

`PythonRules` (rules/python.py) is the reference: the same layout of every row's draft and pool candidates, the
greedy choice at every query, and the same acceptance and draft update, which leave every `Row` as the Python
rules would. Here a row's pool and prompt lookup are the C ones (_ngram.c, _lookup.c), so the step proposes and
records without Python. The contract with the C code is explicit: it reads and writes the `Row` fields named in
`_native.ROW_FIELDS` and calls back only the public methods named in `_native.CALLBACKS` (`filler`, `close_block`)
of this object; tests/unit/test_native_rules.py holds both to `Row` and `PythonRules`.

The choice is made in C where every row is greedy and the logits are few and float32 on the CPU, otherwise by
`sampling.choose` as in Python. The step's arrays are bytearrays filled in C, which torch reads in place.
"""

from __future__ import annotations

import torch

from jfcore.decoding.config import DecodeConfig
from jfcore.decoding.row import Row
from jfcore.decoding.rules.layout import Kept, StepInput
from jfcore.decoding.rules.python import PythonRules
from jfcore.decoding.sampling import TWO_PASS_LOGITS

try:  # built at install where a C compiler is at hand (pyproject.toml; infra/setup.sh says which rules run)
    from jfcore.decoding.rules import _native
except ImportError:
    _native = None

# Greedy choices over at most this many float32 logits are made in C (one thread, no tensor operations); over more,
# torch's two-pass choice (`sampling.greedy_argmax`, from the same size on), on every intra-op thread, is faster
# (docs/DESIGN.md, "Rows in C").
C_CHOICE_LOGITS = TWO_PASS_LOGITS


def available() -> bool:
    """Whether the C rules were built at install."""
    return _native is not None


class NativeRules(PythonRules):
    """`PythonRules` with `layout` and `commit` in C, and rows whose candidates are the C pool and lookup."""

    pool_type = _native.NgramPool if _native is not None else None
    lookup_type = _native.PromptLookup if _native is not None else None

    def __init__(self, config: DecodeConfig, eos_token_ids, pad_token_id: int):
        if _native is None:
            raise RuntimeError(
                "the C decoding rules were not built (jfcore/decoding/rules/_step.c): install a C compiler, then "
                "`pip install -e .` again; or decode with rules='python'"
            )
        super().__init__(config, eos_token_ids, pad_token_id)
        copied_beside = config.lookup_tokens > 0 and not config.lookup_within  # the copy is a candidate of its own
        self.max_candidates = (config.pool_size if config.recycling else 0) + int(copied_beside)
        self._verify_rules = (
            tuple(self.eos),
            self.block_size,
            config.blocks_in_flight,
            config.spawn_ratio,
            config.rolling,
        )

    def layout(self, rows: list[Row]) -> StepInput:
        tokens, positions, offsets, valid, meta, width, tree = _native.layout(
            rows, self.pad, self.max_candidates, self.config.lookup_within, self.record
        )
        shape = (len(rows), width)
        return StepInput(
            torch.frombuffer(tokens, dtype=torch.long).view(shape),
            torch.frombuffer(valid, dtype=torch.bool).view(shape),
            torch.frombuffer(positions, dtype=torch.long).view(shape),
            torch.frombuffer(offsets, dtype=torch.long).view(shape) if tree else None,  # read only for the mask
            tree,
            (tokens, valid, offsets, meta, width),
        )

    def commit(self, rows: list[Row], step: StepInput, logits: torch.Tensor) -> Kept:
        tokens, valid, offsets, meta, width = step.state
        cpu_float32 = logits.device.type == "cpu" and logits.dtype == torch.float32
        if cpu_float32 and logits.numel() <= C_CHOICE_LOGITS and all(r.sampling.greedy for r in rows):
            packed = logits.dim() == 2
            choices = _native.greedy(
                logits.contiguous().numpy(), valid if packed else None, len(rows), width, logits.shape[-1]
            )
        else:  # many logits, sampled rows, a GPU (the step's one host sync) or another dtype: as in Python

            def generated() -> torch.Tensor:
                ahead = torch.tensor([len(r.out) + 1 for r in rows])[:, None]
                return torch.frombuffer(offsets, dtype=torch.long).view(len(rows), width) + ahead

            choices = self.choose(logits, rows, generated, step.valid).numpy()
        kept, moved = _native.verify(rows, tokens, choices, meta, width, *self._verify_rules, self.record, self)
        counts = torch.frombuffer(kept, dtype=torch.long)
        moves = torch.frombuffer(moved, dtype=torch.long).view(-1, 3) if moved else None
        return Kept(counts, moves)
