"""Shared test setup: offline, quiet, and the path of the shared real data."""

from __future__ import annotations

import os

# Before transformers is imported: never wait on a hub that cannot be reached.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

# Tiny models gain nothing from a second thread, and two test processes (or a test and a
# benchmark) each running two threads on a 2-core host slow each other down tenfold.
torch.set_num_threads(int(os.environ.get("JF_TEST_THREADS", "1")))
