"""How much a completion repeats itself: the share of its tokens that close an n-gram it already held.

Jacobi drafts of a loop are right by construction, and so are prompt lookup's, so a model whose text drifts into
loops decodes with a higher TPF without drafting any better. The evaluation reports this beside accuracy, and the
registry gate bounds how much more a trained model may repeat than the model it must beat
(docs/TRAINING.md, "What moves own-draft TPF": training's lower AR weights bought TPF exactly this way).
"""

from __future__ import annotations

from collections.abc import Sequence

NGRAM = 4
# A completion "ends in a short loop" when its last LOOP_RUN tokens repeat with a period of at most LOOP_PERIOD: a
# newline after a newline, ",,,,", "(" and a newline by turns. That is how the trained models' code answers end when
# they stop closing their code block (docs/TRAINING.md, "Losses"); the 4-gram share counts it only as part of the rest.
# A longer period (packing.loop_period) finds a repeated line or sentence; its tail counts only once it holds two
# whole periods, so that a phrase recurring once at the end is not a loop.
LOOP_PERIOD = 2
LOOP_RUN = 8
LINE_PERIOD = 48  # the longest period counted as a repeated line (packing.loop_period's setting for it)


def repeated_share(tokens: Sequence[int], n: int = NGRAM) -> float:
    """Share of positions (from the n-th token on) whose n-gram ending there occurred earlier in `tokens`: fresh
    text scores near 0, a loop near 1, text shorter than n tokens 0."""
    seen, repeated = set(), 0
    for i in range(n, len(tokens) + 1):
        gram = tuple(tokens[i - n : i])
        repeated += gram in seen
        seen.add(gram)
    return repeated / max(len(tokens) - n + 1, 1)


def short_loop_start(tokens: Sequence[int], period: int = LOOP_PERIOD, run: int = LOOP_RUN) -> int | None:
    """Where the loop that `tokens` ends in begins (the first token of its longest periodic tail), or None when no
    tail of max(`run` + LOOP_PERIOD, 2p) tokens repeats with a period p of at most `period`."""
    tokens = list(tokens)
    if len(tokens) < run + LOOP_PERIOD:
        return None
    starts = []
    for p in range(1, period + 1):
        start = len(tokens) - p  # the tail tokens[start:] repeats with period p
        while start > 0 and tokens[start - 1] == tokens[start - 1 + p]:
            start -= 1
        if len(tokens) - start >= max(run + LOOP_PERIOD, 2 * p):
            starts.append(start)
    return min(starts, default=None)


def ends_in_short_loop(tokens: Sequence[int], period: int = LOOP_PERIOD, run: int = LOOP_RUN) -> bool:
    """Whether the last `run` tokens (and `period` more) repeat with some period of at most `period`."""
    return short_loop_start(tokens, period, run) is not None
