"""Rejection recycling: n-grams from rejected drafts, offered again as candidates."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

_END = -1  # closes each tail in `tokens`: an n-gram stops there (token ids are >= 0)
_NONE = -1  # no (older) place


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
    A token's occurrences are a chain through two flat records, its newest place
    and each place's previous one: no container per token, so a decode's pools
    are a few lists that the cyclic collector walks at once, not one list per
    distinct token. The record keeps every tail added, a token and a link each:
    overlapping n-grams share it, so it stays smaller than eager lists of
    tuples unless a decode repeats the same few n-grams for very long, and even
    then it is tens of bytes a token where SmolLM2-135M's KV cache holds 46 KB.

    This class is the reference; the C rules' rows use the same pool in C (jfcore/decoding/rules/_ngram.c).
    """

    def __init__(self, size: int, ngram_size: int):
        self.size = size
        self.span = ngram_size - 1  # continuation length after the first token
        self.tokens: list[int] = []  # every tail added, each closed by _END
        self.newest: dict[int, int] = {}  # first token -> its newest place in `tokens`
        self.older: list[int] = []  # place -> the same token's previous place (_NONE: none, or not a first token)

    def add(self, tokens: Sequence[int]) -> None:
        start, newest, older = len(self.tokens), self.newest, self.older
        self.tokens += tokens
        self.tokens.append(_END)
        before = newest.get
        for place, token in enumerate(tokens[:-1], start):
            older.append(before(token, _NONE))
            newest[token] = place
        older += [_NONE] * (len(self.tokens) - len(older))  # a tail's last token and its _END start no n-gram

    def candidates(self, first: int, max_len: int) -> list[tuple[int, ...]]:
        """Distinct continuations of `first` in its pool, newest first, cut to at most `max_len` tokens each."""
        place = self.newest.get(first, _NONE)
        if place == _NONE or self.size == 0:
            return []
        tokens, span, older = self.tokens, self.span, self.older
        pool: list[tuple[int, ...]] = []
        kept: list[int] = []  # the newest place of each continuation in the pool
        while place != _NONE:
            gram = tuple(tokens[place + 1 : place + 1 + span])
            if _END in gram:
                gram = gram[: gram.index(_END)]
            if gram not in pool:
                pool.append(gram)
                kept.append(place)
                if len(pool) == self.size:
                    break
            place = older[place]
        self.newest[first] = kept[0]  # the chain is the kept places from now on
        for newer, previous in pairwise(kept):
            older[newer] = previous
        older[kept[-1]] = _NONE
        out: list[tuple[int, ...]] = []
        for gram in pool:
            gram = gram[:max_len]
            if gram and gram not in out:
                out.append(gram)
        return out
