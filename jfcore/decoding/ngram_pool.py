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
        self.table: dict[int, list[tuple[int, ...]]] = {}

    def add(self, tokens: Sequence[int]) -> None:
        for i in range(len(tokens) - 1):
            gram = tuple(tokens[i + 1 : i + 1 + self.span])
            entries = self.table.setdefault(tokens[i], [])
            if gram in entries:
                entries.remove(gram)
            entries.insert(0, gram)
            del entries[self.size :]

    def candidates(self, first: int, max_len: int) -> list[tuple[int, ...]]:
        """Distinct continuations of `first`, at most `max_len` tokens each."""
        out: list[tuple[int, ...]] = []
        for gram in self.table.get(first, ()):
            gram = gram[:max_len]
            if gram and gram not in out:
                out.append(gram)
        return out
