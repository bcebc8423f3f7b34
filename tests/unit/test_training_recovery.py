"""Crash recovery without a training run: durable writes, metrics files a crash left torn, what a failure shows.

The training runs that resume from such files are in tests/integration/test_training_run.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from jfcore.atomic import atomic_write, fsync_tree
from jfcore.training.checkpoints import MetricsError, _reason, _truncate_metrics, read_metrics
from tasks.training import POST_MORTEM, ErrorTail, _last_metrics


@pytest.fixture
def fsyncs(monkeypatch) -> list[tuple[str, Path]]:
    """Every os.fsync and os.replace, in order, as (what, path); both still do their real work."""
    events: list[tuple[str, Path]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_atomic_write_flushes_the_data_before_the_rename_and_the_folder_after(tmp_path, fsyncs):
    target = tmp_path / "sub" / "state.json"
    seen: list[str] = []

    def write(tmp: Path) -> None:
        tmp.write_text('{"step": 8}')
        seen.append(tmp.name)

    atomic_write(target, write)
    tmp = target.with_name(seen[0])
    assert fsyncs == [("fsync", tmp), ("replace", target), ("fsync", target.parent)]
    assert json.loads(target.read_text()) == {"step": 8} and not tmp.exists()


def test_atomic_write_works_where_a_folder_cannot_be_fsynced(tmp_path, monkeypatch):
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # as on file systems that answer EINVAL for a folder
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(22, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_write(tmp_path / "a.txt", lambda tmp: tmp.write_text("kept"))
    assert (tmp_path / "a.txt").read_text() == "kept"


def test_a_failed_write_leaves_neither_the_name_nor_a_temp_file(tmp_path):
    def write(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(tmp_path / "a.txt", write)
    assert list(tmp_path.iterdir()) == []


def test_fsync_tree_flushes_every_file_and_folder(tmp_path, fsyncs):
    (tmp_path / "tag" / "zero").mkdir(parents=True)
    files = [tmp_path / "tag" / "mp_rank_00_model_states.pt", tmp_path / "tag" / "zero" / "optim.pt"]
    for f in files:
        f.write_bytes(b"x" * 100)
    fsync_tree(tmp_path / "tag")
    assert {path for _, path in fsyncs} == {*files, tmp_path / "tag", tmp_path / "tag" / "zero"}


def records(*steps: int) -> str:
    return "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps)


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(records(1, 2, 3) + '{"step": 4, "lo')  # killed while writing step 4
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert f"warning: {path} line 4 is torn" in capsys.readouterr().out
    assert _last_metrics(path) == {"step": 3, "loss": 1.0 / 3}


def test_truncating_for_a_resume_drops_a_torn_line_and_the_steps_to_redo(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(records(1, 2, 3, 4, 5) + '{"step": 6, "loss": 0.1')
    _truncate_metrics(path, 4)
    assert path.read_text() == records(1, 2, 3, 4)
    assert "line 6 is torn" in capsys.readouterr().out
    _truncate_metrics(path, 0)  # starting over: nothing kept, nothing parsed
    assert path.read_text() == ""


def test_a_broken_line_before_the_last_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(records(1) + '{"step": 2, "lo\n' + records(3))
    with pytest.raises(MetricsError, match=f"{path} line 2 is not a JSON record.*delete that line"):
        read_metrics(path)
    with pytest.raises(MetricsError, match="line 2"):
        _truncate_metrics(path, 3)
    assert path.read_text() == records(1) + '{"step": 2, "lo\n' + records(3)  # left for a person to fix


def test_blank_lines_and_a_missing_file_are_no_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_metrics(path) == [] and _last_metrics(path) == {}
    path.write_text(records(1) + "\n\n")
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}]


def test_a_load_error_is_one_line_and_a_bare_assert_says_where_it_was_raised():
    try:
        raise AssertionError()  # as DeepSpeed's loader raises for a checkpoint folder without model states
    except AssertionError as err:
        assert re.fullmatch(r"AssertionError: raised at test_training_recovery\.py:\d+", _reason(err))
    assert _reason(RuntimeError("x" * 500 + "\nsecond line")) == "RuntimeError: " + "x" * 200 + "..."


def test_a_failure_shows_the_ranks_last_lines_without_warnings_or_torchruns_post_mortem():
    """As a ZeRO-3 run prints them: the cause, then dozens of deprecation warnings, then torchrun's summary."""
    warning = [
        "/venv/torch/distributed/c10d_logger.py:83: FutureWarning: `all_gather_into_tensor` is deprecated.\n",
        "  return func(*args, **kwargs)\n",
    ]
    lines = [
        "step 1/3: loss 16.548\n",
        "Traceback (most recent call last):\n",
        '  File "loop.py", line 9, in train\n',
        "RuntimeError: the real cause\n",
        *warning * 30,
        "  warnings.warn(\n",
        f"E1206 12:00:00 {POST_MORTEM}:869] failed (exitcode: 1)\n",
        "  rank: 0\n",
    ]
    tail = ErrorTail(keep=4)
    for line in lines:
        tail.add(line)
    assert list(tail.lines) == [
        "Traceback (most recent call last):",
        '  File "loop.py", line 9, in train',
        "RuntimeError: the real cause",
        "  warnings.warn(",  # a multi-line warning's source line: kept, as it cannot be told apart
    ]
