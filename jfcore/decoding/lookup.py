"""Prompt-lookup candidates: continuations copied from a row's own prompt and output (docs/DESIGN.md, section 7).

Code, quoted numbers and restated questions repeat text the row has already
seen. When the last few tokens (the committed text plus the known next token)
occurred earlier, the tokens that followed them there are a likely
continuation. The verifier checks such a candidate in the same forward as the
row's Jacobi draft, by greedy match, so the output stays exact whatever the
candidate says.

The candidate's length adapts per row: it grows by two after a fully accepted
candidate and shrinks by one after a rejected one, within [1, max_tokens].
`simulate` replays the same rule on a known greedy output, so the tuner gets a
row's exact prompt-lookup acceptance from one greedy pass instead of decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from jfcore.decoding.slots import host_tensor, widen


class PromptLookup:
    """An index from every n-gram (1..max_ngram tokens) of a growing text to where it last occurred."""

    def __init__(self, max_ngram: int, max_tokens: int, text: Sequence[int] = ()):
        self.max_ngram = max_ngram
        self.max_tokens = max_tokens
        self.length = max_tokens  # this row's current candidate length
        self.text: list[int] = []
        self._next: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        self.extend(text)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens. Each n-gram is indexed once a token follows it, so a match always has a
        continuation; a later occurrence replaces an earlier one (recent text predicts better)."""
        text, index = self.text, self._next
        for token in tokens:
            text.append(token)
            end = len(text) - 1  # the n-grams that end just before the new token now have it as continuation
            for g in range(1, min(self.max_ngram, end) + 1):
                index[g][tuple(text[end - g : end])] = end

    def propose(self, next_token: int, limit: int) -> list[int]:
        """A continuation of the text followed by `next_token`: at most min(limit, current length) tokens copied
        from after the latest earlier occurrence of the longest matching suffix (empty when none matches)."""
        size = min(limit, self.length)
        if size <= 0:
            return []
        text = self.text
        for g in range(min(self.max_ngram, len(text) + 1), 0, -1):
            start = self._next[g].get((*text[len(text) - g + 1 :], next_token))
            if start is not None:
                # Copy from text + [next_token] + the copy itself: a match close to the end runs on into the text
                # being written, so a repeating pattern still gets a full-length candidate.
                copied: list[int] = []
                while len(copied) < size:
                    at = start + len(copied)
                    copied.append(
                        text[at] if at < len(text) else next_token if at == len(text) else copied[at - len(text) - 1]
                    )
                return copied
        return []

    def update(self, proposed: int, accepted: int) -> None:
        """Adapt the candidate length to how much of a `proposed`-token candidate was accepted."""
        if proposed == 0:
            return
        if accepted == proposed:
            self.length = min(self.length + 2, self.max_tokens)
        else:
            self.length = max(self.length - 1, 1)


class BatchLookup:
    """`PromptLookup` for a batch of rows as tensors (jfcore/decoding/batch_rows.py): the same candidates and the
    same length rule, found by comparing every window of each row's text with its suffix instead of through an
    index, so a step has no per-row Python. Row b of every tensor is row b of the batch."""

    def __init__(self, max_ngram: int, max_tokens: int):
        self.max_ngram = max_ngram
        self.max_tokens = max_tokens
        self.text = torch.zeros(0, 0, dtype=torch.long)  # prompt and committed tokens, zero after them
        self.size = torch.zeros(0, dtype=torch.long)  # tokens of text per row
        self.length = torch.zeros(0, dtype=torch.long)  # candidate length per row

    def add(self, texts: Sequence[Sequence[int]], room: Sequence[int]) -> None:
        """Rows that join, each with its text so far and room for that many more tokens."""
        columns = max([self.text.shape[1], *(len(t) + r for t, r in zip(texts, room))])
        rows = host_tensor([[*t, *[0] * (columns - len(t))] for t in texts])
        self.text = torch.cat([widen(self.text, columns), rows])
        self.size = torch.cat([self.size, torch.tensor([len(t) for t in texts], dtype=torch.long)])
        self.length = torch.cat([self.length, torch.full((len(texts),), self.max_tokens, dtype=torch.long)])

    def select(self, index: torch.Tensor) -> None:
        self.text, self.size, self.length = self.text[index], self.size[index], self.length[index]

    def propose(self, next_token: torch.Tensor, limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's candidate [B, max_tokens] (zero after its count) and count [B]: `PromptLookup.propose`."""
        rows, columns = self.text.shape
        size, text, g = self.size, self.text, self.max_ngram
        # key[b, i]: the token i places back from the end of text + [next token]
        back = (size[:, None] - torch.arange(1, g)).clamp(min=0)
        key = torch.cat([next_token[:, None], text.gather(1, back)], dim=1)
        # seen[b, e, i]: text[b, e - 1 - i], the token i places back from end e (-1, no token, before the text)
        padded = torch.cat([text.new_full((rows, g), -1), text], dim=1)
        seen = padded.unfold(1, g, 1).flip(-1)  # [B, columns + 1, g]
        # the suffix length matched at each end (a key reaching before the text cannot match: an end is at most
        # size - 1, so what lies before the text is a -1 there)
        matched = (seen == key[:, None, :]).long().cumprod(-1).sum(-1)  # [B, columns + 1]
        # An n-gram counts once a token follows it (end <= size - 1): the longest match, then the latest, wins.
        ends = torch.arange(columns + 1)
        score = torch.where((ends < size[:, None]) & (matched > 0), matched * (columns + 1) + ends, -1).amax(1)
        found, start = score >= 0, score.clamp(min=0) % (columns + 1)
        count = torch.where(found, torch.minimum(limit, self.length).clamp(min=0), 0)
        # Copied from text + [next token] + the copy itself: past the text's end the copy repeats with the
        # period from the match to that end.
        k = torch.arange(self.max_tokens)
        at = start[:, None] + k % (size + 1 - start).clamp(min=1)[:, None]
        copied = torch.where(at == size[:, None], next_token[:, None], text.gather(1, at.clamp(max=columns - 1)))
        return copied.masked_fill(k >= count[:, None], 0), count

    def update(self, proposed: torch.Tensor, accepted: torch.Tensor) -> None:
        """`PromptLookup.update` for every row: `proposed` and `accepted` [B] candidate tokens."""
        adapted = torch.where(
            accepted == proposed, (self.length + 2).clamp(max=self.max_tokens), (self.length - 1).clamp(min=1)
        )
        self.length = torch.where(proposed > 0, adapted, self.length)

    def extend(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Append `tokens[b, :counts[b]]` to each row's text (what room is left takes)."""
        k = torch.arange(tokens.shape[1])
        at = self.size[:, None] + k
        keep = (k < counts[:, None]) & (at < self.text.shape[1])
        rows, cols = keep.nonzero(as_tuple=True)
        self.text[rows, at[rows, cols]] = tokens[rows, cols]
        self.size += keep.sum(1)


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


try:  # the same index and candidates in C (jfcore/decoding/_lookup.c), built at install where a compiler is at hand
    from jfcore.decoding._native import PromptLookup as CPromptLookup
except ImportError:  # installed without a C compiler
    CPromptLookup = None

# What a row's prompt lookup is: the C one lets the C step (jfcore/decoding/native_rows.py) propose and extend
# without Python.
RowLookup = CPromptLookup or PromptLookup
