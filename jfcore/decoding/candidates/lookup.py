"""Prompt-lookup candidates: continuations copied from a row's own prompt and output (docs/DESIGN.md, section 7).

Code, quoted numbers and restated questions repeat text the row has already
seen. When the last few tokens (the committed text plus the known next token)
occurred earlier, the tokens that followed them there are a likely
continuation. The verifier checks such a candidate in the same forward as the
row's Jacobi draft, by greedy match, so the output stays exact whatever the
candidate says.

The candidate's length adapts per row: it grows by two after a fully accepted
candidate and shrinks by one after a rejected one, within [1, max_tokens].
jfcore/tuning/replay.py replays the same rule on a known greedy output, so the tuner gets a row's exact
prompt-lookup acceptance from one greedy pass instead of decoding. This class is the reference; the C rules'
rows use the same lookup in C (jfcore/decoding/rules/_lookup.c).
"""

from __future__ import annotations

from collections.abc import Sequence


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
