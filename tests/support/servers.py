"""Real servers for integration tests, on 127.0.0.1 with free ports."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from jfcore.hostspeed import scaled


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(folder: Path):
    """`mlflow server` with a SQLite backend and a local artifact folder; yields its URI."""
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    log = open(folder / "server.log", "w")  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{folder / 'mlflow.db'}",
            "--artifacts-destination",
            str(folder / "artifacts"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + scaled(120)
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
