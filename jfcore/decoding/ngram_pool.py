"""Rejection recycling: n-grams from rejected drafts, offered again as candidates."""

from __future__ import annotations

from collections.abc import Sequence


class NgramPool:
    """Up to `size` recent continuations for every first token.

    Jacobi drafts often hold a right phrase at a wrong offset; the rejected
    tail of a draft is remembered here and, when a later correction token
    matches its first token, the continuation is verified in the same forward.
    """

    def __init__(self, size: int, ngram_size: int):
        self.size = size
        self.span = ngram_size - 1  # continuation length after the first token
        # first token -> its continuations, oldest first (a dict keeps insertion order: moving an entry to the
        # newest end and dropping the oldest are O(1), which matters as every step adds a whole rejected tail)
        self.table: dict[int, dict[tuple[int, ...], None]] = {}

    def add(self, tokens: Sequence[int]) -> None:
        table, span, size = self.table, self.span, self.size
        for i in range(len(tokens) - 1):
            gram = tuple(tokens[i + 1 : i + 1 + span])
            entries = table.get(tokens[i])
            if entries is None:
                table[tokens[i]] = {gram: None}
                continue
            if gram in entries:
                del entries[gram]
            elif len(entries) >= size:
                del entries[next(iter(entries))]
            entries[gram] = None

    def candidates(self, first: int, max_len: int) -> list[tuple[int, ...]]:
        """Distinct continuations of `first`, newest first, at most `max_len` tokens each."""
        out: list[tuple[int, ...]] = []
        for gram in reversed(self.table.get(first, ())):
            gram = gram[:max_len]
            if gram and gram not in out:
                out.append(gram)
        return out
