"""Rank 0's progress lines: a line at the first and last step, and a heartbeat while one step runs long."""

from __future__ import annotations

import re
import time

from jfcore.training import loop

METRICS = {
    "loss": 2.0,
    "ar_loss": 1.5,
    "consistency_loss": 0.5,
    "copy_loss": 0.25,
    "repeat_loss": 0.125,
    "learning_rate": 1e-4,
    "tokens_per_second": 99.0,
}


def test_a_long_step_gets_heartbeats_with_an_eta_and_the_launcher_reads_only_finished_steps(monkeypatch, capsys):
    monkeypatch.setattr(loop, "PROGRESS_EVERY_S", 0.3)
    progress = loop._Progress(start=4, total=10)
    time.sleep(1.0)  # the first step (step 5) runs long: heartbeats, no step line
    progress.report(5, METRICS)
    progress.report(6, METRICS)  # too soon after the last line: quiet
    time.sleep(0.5)
    progress.report(10, METRICS)  # the last step always reports
    progress.close()
    time.sleep(0.5)  # closed: no heartbeat after the end
    lines = capsys.readouterr().out.splitlines()
    beats = [line for line in lines if "still running" in line]
    steps = [line for line in lines if "still running" not in line]
    assert beats and all(
        re.fullmatch(r"step (5|7)/10 still running \(\d+ s since the start\), ETA [\d.]+ min", b) for b in beats
    )
    assert [int(loop.PROGRESS_LINE.match(line)["done"]) for line in steps] == [5, 10]
    assert not any(loop.PROGRESS_LINE.match(b) for b in beats)  # the progress artifact counts finished steps only
    first = (
        r"step 5/10: loss 2\.000 \(ar 1\.500, consistency 0\.500, copy 0\.250, repeat 0\.125\), lr 1\.00e-04, "
        r"99 tokens/s, ETA [\d.]+ min"
    )
    assert re.fullmatch(first, steps[0]), steps[0]
    assert lines[-1] == steps[-1] and steps[-1].endswith("ETA 0.0 min")
