"""Prompt lookup replayed on a known greedy output (no model): what decoding with it alone would do, so the tuner
gets a row's exact prompt-lookup acceptance from one greedy pass instead of decoding (docs/DESIGN.md, section 12).
The rule replayed is jfcore/decoding/candidates/lookup.py's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jfcore.decoding.candidates.lookup import PromptLookup


@dataclass(frozen=True)
class LookupReplay:
    """Prompt lookup replayed on a known greedy output (no model): what decoding with it alone would do."""

    tokens: int  # output tokens
    forwards: int  # decode forwards (the first output token comes from the prefill)
    widths: tuple[int, ...]  # query positions of each forward: 1 + candidate length

    @property
    def tpf(self) -> float:
        return self.tokens / max(self.forwards, 1)


def simulate(prompt: Sequence[int], output: Sequence[int], max_ngram: int, max_tokens: int) -> LookupReplay:
    """Replay AR decoding with prompt-lookup candidates on `output`, the greedy continuation of `prompt`.

    Exact for a row that drafts nothing else (block size 1): which candidate is proposed and how much of it the
    verifier accepts depend only on the text, which greedy decoding fixes. The prefill gives output[0]; each
    forward then verifies [known token, candidate] and commits the known token plus the matching prefix.
    """
    lookup = PromptLookup(max_ngram, max_tokens, prompt)
    widths = []
    done = 1 if output else 0  # output[0] is known after the prefill
    while done < len(output):
        known = output[done - 1]
        candidate = lookup.propose(known, len(output) - done)
        accepted = 0
        while accepted < len(candidate) and candidate[accepted] == output[done + accepted]:
            accepted += 1
        lookup.update(len(candidate), accepted)
        lookup.extend(output[done - 1 : done + accepted])
        widths.append(1 + len(candidate))
        done += 1 + accepted
    return LookupReplay(len(output), len(widths), tuple(widths))
