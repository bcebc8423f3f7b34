"""Real servers as child processes (jf-serve, and the ones tests start), and jf-serve's metrics: for tests
and benchmarks that talk to a real server."""

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
def child_server(name: str, command: list[str], health_url: str, log_path: Path, env: dict, timeout_s: float = 300):
    """Run `command` in its own session until the block ends, once `health_url` answers; its output goes to
    `log_path`, whose tail is the error when it exits or stays silent too long."""
    log = open(log_path, "w")  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.time() + scaled(timeout_s)
        while True:
            try:
                urllib.request.urlopen(health_url, timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{name} did not start: {log_path.read_text()[-3000:]}") from None
                time.sleep(0.5)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@contextlib.contextmanager
def jf_serve(folder: Path, *args: str, api_key: str | None = None):
    """A real `jf-serve` process on a free port; yields its base URL (…/v1 is the OpenAI API)."""
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "JF_API_KEY"}
    if api_key:
        env["JF_API_KEY"] = api_key  # through the environment, as a deployment would pass a secret
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "cli.serve", "--port", str(port), *args]
    with child_server("jf-serve", command, f"{url}/health", folder / f"serve-{port}.log", env):
        yield url


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
