"""Driving a live batch through arrivals at chosen steps, as a server admits requests (continuous batching)."""

from __future__ import annotations

from collections.abc import Callable


def run_arrivals(live, arrivals, cancel: int | None = None, after_admit: Callable[[int], None] | None = None):
    """Step `live` until every arrival (prompt, step it joins at, token budget) has joined and finished (those of
    one step in their given order); at step `cancel` the batch's first row is cancelled. `after_admit(step)` runs
    after each step's admissions. Returns [(row, arrival)] and the cancelled row (or None)."""
    rows, step, waiting, cancelled = [], 0, sorted(arrivals, key=lambda a: a[1]), None
    while waiting or live.rows:
        joining = [a for a in waiting if a[1] <= step]
        waiting = waiting[len(joining) :]
        if joining:
            rows += list(zip(live.add([p for p, _, _ in joining], [n for _, _, n in joining]), joining))
        if after_admit is not None:
            after_admit(step)
        if cancel is not None and cancelled is None and step == cancel and live.rows:
            cancelled = live.remove([live.rows[0]])[0]
        if live.rows:
            live.step()
        step += 1
    return rows, cancelled
