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


@contextlib.contextmanager
def jf_serve(folder: Path, *args: str, api_key: str | None = None):
    """A real `jf-serve` process on a free port; yields its base URL (…/v1 is the OpenAI API)."""
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("JF_API_KEY", None)
    if api_key:
        env["JF_API_KEY"] = api_key  # through the environment, as a deployment would pass a secret
    log_path = folder / f"serve-{port}.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed in the finally below)
    command = [sys.executable, "-m", "tasks.serve", "--port", str(port), *args]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + scaled(300)
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"jf-serve did not start: {log_path.read_text()[-3000:]}")
                time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def prometheus_value(url: str, name: str, api_key: str | None = None) -> float:
    """One sample of a server's /metrics (0 when absent), e.g. 'jf_requests_total{finish_reason="cancelled"}'."""
    request = urllib.request.Request(
        f"{url}/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0
