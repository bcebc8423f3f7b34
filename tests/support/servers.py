"""Real servers for integration tests, on 127.0.0.1 with free ports."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from tests.support.serve_process import child_server, free_port

__all__ = ["free_port", "mlflow_server"]


@contextlib.contextmanager
def mlflow_server(folder: Path):
    """`mlflow server` with a SQLite backend and a local artifact folder; yields its URI."""
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}"]
    command += ["--artifacts-destination", str(folder / "artifacts")]
    uri = f"http://127.0.0.1:{port}"
    with child_server("mlflow server", command, f"{uri}/health", folder / "server.log", env, timeout_s=120):
        yield uri
