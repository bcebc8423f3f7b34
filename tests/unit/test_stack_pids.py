"""infra/stack.py signals only the processes it started: a pid file naming a pid that another program now holds
(left from before a reboot) is reported and removed, never acted on."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra import stack
from tests.support import REPO


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("JF_STACK_DIR", str(tmp_path / "stack"))
    (tmp_path / "stack" / "pids").mkdir(parents=True)
    return tmp_path / "stack"


@contextlib.contextmanager
def process(command: list[str]) -> Iterator[subprocess.Popen]:
    """A real process in its own session (as the stack starts its services), ended afterwards."""
    proc = subprocess.Popen(command, start_new_session=True)
    try:
        exec_done(proc.pid)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def exec_done(pid: int) -> None:
    """Wait until the new program's command line shows: Popen may return before the kernel has set it."""
    deadline = time.time() + 10
    while not stack._cmdline(pid):
        assert time.time() < deadline, f"pid {pid} shows no command line"
        time.sleep(0.01)


def alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def stand_in(tmp_path: Path) -> stack.Service:
    """A service whose program is a script run by its interpreter, like `.venv/bin/prefect server start ...`."""
    script = tmp_path / "bin" / "fake-server"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(300)\n")
    script.chmod(0o755)
    return stack.Service("fake-server", [str(script), "serve", "--port", "1"], None)


def test_down_leaves_a_process_that_reused_the_pid_alone(state: Path) -> None:
    with process(["sleep", "300"]) as sleeper:
        mlflow = next(s for s in stack.services() if s.name == "mlflow-server")
        record = {"pid": sleeper.pid, "start_time": 1, "command": mlflow.command}
        mlflow.pid_file().write_text(json.dumps(record))
        done = subprocess.run(
            [sys.executable, "infra/stack.py", "down"],
            cwd=REPO,
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        time.sleep(0.5)  # a SIGTERM, had one been sent, has landed
        assert alive(sleeper)
        assert not mlflow.pid_file().exists()
        assert f"pid {sleeper.pid}, which is now `sleep 300`, not this service" in done.stdout


def test_old_plain_pid_file_is_trusted_only_when_the_command_line_matches(state: Path, tmp_path: Path) -> None:
    service = stand_in(tmp_path)
    with process(["sleep", "300"]) as sleeper, process(service.command) as server:
        service.pid_file().write_text(str(sleeper.pid))
        assert service.pid() is None and service.owner().now == "sleep 300"
        service.pid_file().write_text(str(server.pid))
        assert service.pid() == server.pid


def test_status_reports_a_stale_pid_file(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with process(["sleep", "300"]) as sleeper:
        worker = next(s for s in stack.services() if s.name == "prefect-worker")
        worker.pid_file().write_text(str(sleeper.pid))
        stack.status()
        assert f"prefect-worker: pid file names pid {sleeper.pid}, which is now `sleep 300`" in capsys.readouterr().out
        assert alive(sleeper)


def test_started_service_is_recognised_and_stopped(
    state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    service = stand_in(tmp_path)
    monkeypatch.setattr(stack, "services", lambda: [service])
    stack._start(service, dict(os.environ))
    recorded = json.loads(service.pid_file().read_text())
    pid = recorded["pid"]
    try:
        exec_done(pid)
        assert recorded["command"] == service.command and recorded["start_time"] == stack._start_time(pid)
        assert service.pid() == pid  # the script's cmdline is `python .../fake-server serve --port 1`
        stack.down()
        assert "fake-server: stopped" in capsys.readouterr().out
        assert not service.pid_file().exists()
        with contextlib.suppress(ChildProcessError):  # reaped already: gone too
            _, status = os.waitpid(pid, 0)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def test_same_command_with_another_start_time_is_not_ours(
    state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pid and the command line may both match by chance after a reboot; the start time does not."""
    service = stand_in(tmp_path)
    monkeypatch.setattr(stack, "services", lambda: [service])
    with process(service.command) as server:
        service.record(server.pid)
        assert service.pid() == server.pid
        record = json.loads(service.pid_file().read_text())
        service.pid_file().write_text(json.dumps(record | {"start_time": record["start_time"] - 1}))
        assert service.pid() is None
        stack.down()
        time.sleep(0.5)
        assert alive(server) and not service.pid_file().exists()
