"""Shared test setup: offline, quiet, and the path of the shared real data."""

from __future__ import annotations

import os
import tempfile

from jfcore.environment import apply_defaults

# Before transformers is imported: never wait on a hub that cannot be reached; no telemetry, no Ray token auth.
apply_defaults(offline=True)
# Prefect's own state in a throwaway home, and only its warnings.
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="jf-prefect-"))

import pytest
import torch

from jfcore.hostspeed import scaled

# Every test's time limit (pytest-timeout; setup and teardown count, so a module fixture's work counts toward
# the test that first uses it), scaled to this host's speed. With two CPU-bound processes beside the suite on
# the 2-core reference machine the slowest test took 10.5 minutes (tests/integration/test_training_smollm2.py), and over
# 20 with a second whole suite running beside it as well (the limit scales with the host's speed, not its
# load); 30 lets a loaded host pass, and a hang still fails with every thread's stack well inside CI's
# 90 minutes. A test may set its own with @pytest.mark.timeout(seconds).
TEST_TIMEOUT_S = 1800

# Tiny models gain nothing from a second thread, and two test processes (or a test and a
# benchmark) each running two threads on a 2-core host slow each other down tenfold.
torch.set_num_threads(int(os.environ.get("JF_TEST_THREADS", "1")))


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(scaled(TEST_TIMEOUT_S)))
