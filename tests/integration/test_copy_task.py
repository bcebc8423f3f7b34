"""The sanity case whose answer is known (bench/copy_task.py): a fluent copying model whose drafts fail at the
first wrong word, distilled by the pipeline's own stages (trajectories -> Parquet -> packing -> DeepSpeed), must
learn to draft: its own-draft TPF, measured on held-out prompts while it trains and decoded after, climbs toward
what a block allows. A defect in the objective, the mask or the data (it happened: a noise schedule that never
reached noisy states) leaves it near 1."""

from __future__ import annotations

import pytest

from bench.copy_task import run


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory):
    return run(tmp_path_factory.mktemp("copy-task"), prompts=4096, steps=1000, block_size=8, overrides=[])


def test_distillation_makes_the_copying_models_own_drafts_long(copy_run):
    measured = [r for r in copy_run["curve"] if not r.get("decoded")]
    decoded = next(r for r in copy_run["curve"] if r.get("decoded"))
    first, last = measured[0], measured[-1]
    # Before training: the fluent AR model's drafts fail at the first wrong word.
    assert first["step"] == 0 and first["heldout/simulated_tpf_n8"] < 1.3
    assert first["heldout/noisy_accuracy_at_0"] < 0.3
    # After: the words after a wrong one are right, and whole runs of the draft are accepted. A single Jacobi
    # block's first forward over fresh filler commits one token, so n/2 (2 at n=4, 4 at n=8) bounds Jacobi here.
    assert last["heldout/noisy_accuracy_at_0"] > 0.7
    assert decoded["heldout/decoded_tpf_n4"] > 1.6 and decoded["heldout/decoded_tpf_n8"] > 2.3
    assert decoded["heldout/decoded_multiblock_tpf_n8"] > 2.3
    # The rolling window opens no fresh block of filler, so it is not held to n/2.
    assert decoded["heldout/decoded_rolling_tpf_n8"] > decoded["heldout/decoded_tpf_n8"]
    # The curve climbs (measured along the way, not only at the ends), and the simulation is what decoding finds.
    assert sum(r["heldout/simulated_tpf_n8"] > 2 for r in measured) >= 2
    for n in (4, 8):
        assert last[f"heldout/simulated_tpf_n{n}"] == pytest.approx(decoded[f"heldout/decoded_tpf_n{n}"], rel=0.05)
