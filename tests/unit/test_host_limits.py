"""Time limits scale with the host, and a hanging test fails with a stack instead of hanging the suite."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jfcore import hostspeed
from jfcore.evaluation.benchmarks import BenchmarkConfig, load_benchmark
from jfcore.evaluation.code import CPU_BUDGET_S
from tests.support import REPO


def test_slowdown_is_measured_in_cpu_time_and_can_be_set(monkeypatch):
    monkeypatch.delenv("JF_HOST_SLOWDOWN", raising=False)
    hostspeed.slowdown.cache_clear()
    try:
        assert 1.0 <= hostspeed.slowdown() <= hostspeed.MAX_SLOWDOWN
        monkeypatch.setenv("JF_HOST_SLOWDOWN", "3.5")
        hostspeed.slowdown.cache_clear()
        assert hostspeed.slowdown() == 3.5 and hostspeed.scaled(10) == 35
        for bad in ("fast", "0", "-2"):
            monkeypatch.setenv("JF_HOST_SLOWDOWN", bad)
            hostspeed.slowdown.cache_clear()
            with pytest.raises(ValueError, match="JF_HOST_SLOWDOWN must be"):
                hostspeed.slowdown()
    finally:
        hostspeed.slowdown.cache_clear()


def test_code_problems_get_their_benchmark_budget_scaled_to_the_host(monkeypatch):
    for name in CPU_BUDGET_S:
        assert load_benchmark(BenchmarkConfig(name=name, limit=1))[0].code.cpu_budget_s == CPU_BUDGET_S[name]
    monkeypatch.setenv("JF_HOST_SLOWDOWN", "0.2")  # a host 5x faster: 1 CPU second for HumanEval's 5
    hostspeed.slowdown.cache_clear()
    try:
        problem = load_benchmark(BenchmarkConfig(name="humaneval", limit=1))[0]
        score = problem.score("while True:\n    pass\n")
        assert score.verdict == "timeout" and "its 1 s CPU budget" in score.detail, score
    finally:
        hostspeed.slowdown.cache_clear()


def test_a_hanging_test_fails_with_its_stack(tmp_path):
    hang = tmp_path / "test_hang.py"
    hang.write_text("import threading\n\ndef test_hangs():\n    threading.Event().wait()\n")
    # The suite's own conftest as a plugin, with a host so "fast" that its limit is about 2 seconds.
    env = dict(os.environ, JF_HOST_SLOWDOWN="0.002", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(hang),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=hostspeed.scaled(120),
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "Timeout" in out and "test_hangs" in out and "threading.Event().wait()" in out, out
