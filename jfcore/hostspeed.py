"""How much slower this host runs Python than the machine the project's time budgets were measured on.

Time budgets (the code sandbox's CPU seconds, the test suite's deadlines) are
measured on a 2-core development machine. A host that runs the same code N
times slower needs N times the CPU seconds, so budgets are multiplied by
`slowdown()`: the CPU time of a fixed pure-Python workload here, over the CPU
time it took there. CPU time, not wall time, so that a busy host (other
processes sharing the cores) does not look slow; load is what the wall-clock
backstops are generous for. Never below 1: a faster host keeps the budgets.

`JF_HOST_SLOWDOWN=<factor>` sets the factor instead of measuring it.
"""

from __future__ import annotations

import functools
import os
import time

# CPU seconds of `_workload()` on the reference machine (2-core x86_64 dev host, CPython 3.11), best of 5.
REFERENCE_CPU_S = 0.070
MAX_SLOWDOWN = 50.0


def _workload() -> int:
    """Interpreter-bound work of the kind sandboxed programs do: arithmetic, lists, dicts, strings."""
    total, table = 0, {}
    for i in range(250_000):
        total += (i * i) % 7
        table[i % 1000] = str(i)
        if i % 3 == 0:
            total += len([j for j in range(8)])
    return total + len(table)


def measure_cpu_seconds(repeats: int = 5) -> float:
    """Best-of-`repeats` CPU seconds of the workload on this host."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        _workload()
        best = min(best, time.process_time() - start)
    return best


@functools.cache
def slowdown() -> float:
    """This host's CPU time for the reference workload over the reference machine's, in [1, MAX_SLOWDOWN]."""
    override = os.environ.get("JF_HOST_SLOWDOWN")
    if override:
        try:
            factor = float(override)
        except ValueError:
            raise ValueError(f"JF_HOST_SLOWDOWN must be a number such as 2.5, got {override!r}") from None
        if factor <= 0:
            raise ValueError(f"JF_HOST_SLOWDOWN must be > 0, got {override!r}")
        return factor
    return min(max(measure_cpu_seconds() / REFERENCE_CPU_S, 1.0), MAX_SLOWDOWN)


def scaled(seconds: float) -> float:
    """`seconds` measured on the reference machine, as this host needs them."""
    return seconds * slowdown()
