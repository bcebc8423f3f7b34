"""Rejection recycling: n-grams from rejected drafts, offered again as candidates."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

_END = -1  # closes each tail in `tokens`: an n-gram stops there (token ids are >= 0)


class NgramPool:
    """Up to `size` recent continuations for every first token.

    Jacobi drafts often hold a right phrase at a wrong offset; the rejected
    tail of a draft is remembered here and, when a later correction token
    matches its first token, the continuation is verified in the same forward.

    The pool of a first token is its `size` most recently added distinct
    continuations (the `ngram_size - 1` tokens after it, fewer at a tail's
    end), newest first. A step adds a whole tail (every token but its last is a
    first token) and reads one first token's pool, so adding only records where
    each token occurred, and reading builds that one pool from the newest
    occurrences; occurrences it passes over can never be read again (older
    copies of a kept continuation, or continuations pushed out) and are dropped.
    The record keeps every tail added, a token and at most one place each:
    overlapping n-grams share it, so it stays smaller than eager lists of
    tuples unless a decode repeats the same few n-grams for very long, and even
    then it is tens of bytes a token where SmolLM2-135M's KV cache holds 46 KB.
    """

    def __init__(self, size: int, ngram_size: int):
        self.size = size
        self.span = ngram_size - 1  # continuation length after the first token
        self.tokens: list[int] = []  # every tail added, each closed by _END
        self.seen: defaultdict[int, list[int]] = defaultdict(list)  # first token -> its places in `tokens`, ascending

    def add(self, tokens: Sequence[int]) -> None:
        start, seen = len(self.tokens), self.seen
        self.tokens += tokens
        self.tokens.append(_END)
        for place, token in enumerate(tokens[:-1], start):
            seen[token].append(place)

    def candidates(self, first: int, max_len: int) -> list[tuple[int, ...]]:
        """Distinct continuations of `first` in its pool, newest first, cut to at most `max_len` tokens each."""
        places = self.seen.get(first)
        if not places or self.size == 0:
            return []
        tokens, span = self.tokens, self.span
        pool: list[tuple[int, ...]] = []
        kept: list[int] = []  # the newest place of each continuation in the pool
        for place in reversed(places):
            gram = tuple(tokens[place + 1 : place + 1 + span])
            if _END in gram:
                gram = gram[: gram.index(_END)]
            if gram not in pool:
                pool.append(gram)
                kept.append(place)
                if len(pool) == self.size:
                    break
        places[:] = kept[::-1]
        out: list[tuple[int, ...]] = []
        for gram in pool:
            gram = gram[:max_len]
            if gram and gram not in out:
                out.append(gram)
        return out
