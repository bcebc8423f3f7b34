"""How much a completion repeats itself: the share of its tokens that close an n-gram it already held.

Jacobi drafts of a loop are right by construction, and so are prompt lookup's, so a model whose text drifts into
loops decodes with a higher TPF without drafting any better. The evaluation reports this beside accuracy, and the
registry gate bounds how much more a trained model may repeat than the model it must beat
(docs/TRAINING.md, "What moves own-draft TPF": training's lower AR weights bought TPF exactly this way).
"""

from __future__ import annotations

from collections.abc import Sequence

NGRAM = 4


def repeated_share(tokens: Sequence[int], n: int = NGRAM) -> float:
    """Share of positions (from the n-th token on) whose n-gram ending there occurred earlier in `tokens`: fresh
    text scores near 0, a loop near 1, text shorter than n tokens 0."""
    seen, repeated = set(), 0
    for i in range(n, len(tokens) + 1):
        gram = tuple(tokens[i - n : i])
        repeated += gram in seen
        seen.add(gram)
    return repeated / max(len(tokens) - n + 1, 1)
