"""The local stack: Prefect server (SQLite), a process work pool and worker, an MLflow server (SQLite +
an artifact folder), all on 127.0.0.1, telemetry off, state and logs under one folder.

    python infra/stack.py up        # start what is not running, wait until healthy, register the deployments
    python infra/stack.py status    # what runs, where, and whether it answers
    python infra/stack.py down      # stop everything (state is kept; `up` again resumes it)
    python infra/stack.py env       # the environment to talk to the stack, as shell exports
    python infra/stack.py results   # the newest pipeline results table (a Prefect artifact) and the UI addresses
    python infra/stack.py serve     # jf-serve the registry's champion on 127.0.0.1:$JF_SERVE_PORT (8000)

State: $JF_STACK_DIR (default <repo>/.stack): prefect/ (database, results), mlflow/ (database,
artifacts), logs/<service>.log, pids/<service>.pid. Ports: $JF_PREFECT_PORT (4200), $JF_MLFLOW_PORT (5000).
Ray needs no service here: each stage starts a local Ray for its run (set `ray.address` in the recipe
to use a cluster).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from jfcore.environment import defaults

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the environment this script runs in has prefect and mlflow
POOL = "jacobi-forcing-local"


def state_dir() -> Path:
    return Path(os.environ.get("JF_STACK_DIR", REPO / ".stack")).resolve()


def ports() -> tuple[int, int]:
    return int(os.environ.get("JF_PREFECT_PORT", "4200")), int(os.environ.get("JF_MLFLOW_PORT", "5000"))


def environment() -> dict[str, str]:
    """What every process of the stack (and anything that talks to it) gets: addresses, quiet, offline-safe."""
    state, (prefect_port, mlflow_port) = state_dir(), ports()
    return {
        "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{state / 'prefect' / 'prefect.db'}",
        "PREFECT_LOCAL_STORAGE_PATH": str(state / "prefect" / "storage"),  # persisted task results
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",  # stage progress and reuse lines reach the flow run's log
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{prefect_port}/api",
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        **defaults(),  # quiet, offline (set HF_HUB_OFFLINE=0 to let recipes name hub models), the cache folder
    }


@dataclass(frozen=True)
class Owner:
    """Who the pid in a service's pid file is now."""

    pid: int | None  # as recorded; None: no (readable) pid file
    ours: bool  # the process this service started, safe to signal
    now: str | None  # the command line that pid runs now; None: no such process


@dataclass(frozen=True)
class Service:
    name: str
    command: list[str]
    health: str | None  # URL that answers 200 once the service is up

    def pid_file(self) -> Path:
        return state_dir() / "pids" / f"{self.name}.pid"

    def log_file(self) -> Path:
        return state_dir() / "logs" / f"{self.name}.log"

    def record(self, pid: int) -> None:
        """The pid with what identifies its process: a pid alone may name another program after a reboot."""
        record = {"pid": pid, "start_time": _start_time(pid), "command": self.command}
        self.pid_file().write_text(json.dumps(record))

    def owner(self) -> Owner:
        try:
            recorded = _read_pid_file(self.pid_file())
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return Owner(None, False, None)
        pid = recorded["pid"]
        cmdline = _cmdline(pid)
        if not cmdline:  # gone, or a zombie (exited, not yet reaped)
            return Owner(pid, False, None)
        # An old plain-integer pid file records no command: only the service's own command line vouches for it.
        started, command = recorded.get("start_time"), recorded.get("command") or self.command
        same_start = started is None or _start_time(pid) in (None, started)
        return Owner(pid, same_start and _runs(cmdline, command), " ".join(cmdline))

    def pid(self) -> int | None:
        """The service's pid, only when that process really is this service."""
        owner = self.owner()
        return owner.pid if owner.ours else None


def _read_pid_file(path: Path) -> dict:
    text = path.read_text().strip()
    recorded = json.loads(text) if text.startswith("{") else {"pid": int(text)}  # plain integer: written before
    recorded["pid"] = int(recorded["pid"])
    return recorded


def _cmdline(pid: int) -> list[str] | None:
    """The command line `pid` runs ([] for a zombie), None when no such process."""
    if Path("/proc/self/cmdline").is_file():
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:  # no such process (or one /proc hides from us, which is not ours either)
            return None
    done = subprocess.run(["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True, check=False)
    return done.stdout.split() if done.returncode == 0 else None  # ps has no argument boundaries: split on spaces


def _start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks after boot, /proc/<pid>/stat field 22); None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # after the parenthesised name, which may hold spaces


def _runs(cmdline: list[str], command: list[str]) -> bool:
    """Whether a process with `cmdline` runs `command`: the same arguments at the end, after the program itself
    or a script of that name its interpreter runs (`.venv/bin/python .venv/bin/prefect server start ...`)."""
    have, want = " ".join(cmdline).split(), " ".join(command).split()  # ps gives one string: compare word by word
    head = len(have) - len(want) + 1  # words up to and including the program
    if not want or head < 1 or have[head:] != want[1:]:
        return False
    return any(Path(word).name == Path(want[0]).name for word in have[:head])


def _stale(service: Service, owner: Owner) -> str:
    return f"{service.name}: pid file names pid {owner.pid}, which is now `{owner.now}`, not this service"


def services() -> list[Service]:
    state, (prefect_port, mlflow_port) = state_dir(), ports()
    mlflow = state / "mlflow"
    return [
        Service(
            "prefect-server",
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
            f"http://127.0.0.1:{prefect_port}/api/health",
        ),
        Service(
            "mlflow-server",
            [
                str(BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(mlflow_port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{mlflow / 'mlflow.db'}",
                "--artifacts-destination",
                str(mlflow / "artifacts"),
            ],
            f"http://127.0.0.1:{mlflow_port}/health",
        ),
        Service(
            "prefect-worker",
            [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process", "--name", "local-worker"],
            None,
        ),
    ]


def model_server(model: str | None = None) -> Service:
    """jf-serve as a stack service: the registry's champion unless `model` names another."""
    port = os.environ.get("JF_SERVE_PORT", "8000")
    model = model or f"models:/{os.environ.get('JF_REGISTERED_MODEL', 'jacobi-forcing-smollm2')}@champion"
    return Service(
        "model-server", [str(BIN / "jf-serve"), "--model", model, "--port", port], f"http://127.0.0.1:{port}/health"
    )


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _start(service: Service, env: dict[str, str], timeout_s: float = 180) -> None:
    owner = service.owner()
    if owner.ours:
        print(f"{service.name}: already running (pid {owner.pid})")
        return
    if owner.now is not None:
        print(f"{_stale(service, owner)}; starting a new one")
    state = state_dir()
    for folder in (service.pid_file().parent, service.log_file().parent, state / "prefect", state / "mlflow"):
        folder.mkdir(parents=True, exist_ok=True)
    with open(service.log_file(), "a") as log:
        # Its own session: `down` stops the service and everything it started.
        proc = subprocess.Popen(
            service.command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
    service.record(proc.pid)
    from jfcore.hostspeed import scaled  # here: it imports torch, which other commands need not wait for

    deadline = time.time() + scaled(timeout_s)
    while service.health and not _healthy(service.health):
        if proc.poll() is not None or time.time() > deadline:
            tail = service.log_file().read_text()[-3000:]
            raise SystemExit(f"{service.name} did not come up (see {service.log_file()}):\n{tail}")
        time.sleep(1)
    print(f"{service.name}: up (pid {proc.pid}, log {service.log_file()})")


def _prefect(args: list[str], env: dict[str, str]) -> None:
    done = subprocess.run([str(BIN / "prefect"), *args], env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"prefect {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")


def up(recipe: str | None) -> None:
    env = os.environ | environment()
    server, mlflow, worker = services()
    _start(server, env)
    _start(mlflow, env)
    _prefect(["work-pool", "create", POOL, "--type", "process", "--overwrite"], env)
    _start(worker, env)
    command = [sys.executable, str(REPO / "infra" / "deployments.py"), "--pool", POOL]
    done = subprocess.run(command + (["--recipe", recipe] if recipe else []), env=env, cwd=REPO, check=False)
    if done.returncode != 0:
        raise SystemExit("registering the deployments failed (see above)")
    status()


def serve(model: str | None) -> None:
    """Start jf-serve beside the stack (stopped by `down`); the API key, if any, comes from $JF_API_KEY."""
    server = model_server(model)
    if server.owner().ours:
        print(f"model-server: already running (pid {server.pid()}); `down` stops it")
        return
    _start(server, os.environ | environment(), timeout_s=600)
    print(f"OpenAI API: {server.health.removesuffix('/health')}/v1")


def down() -> None:
    for service in reversed([*services(), model_server()]):
        owner = service.owner()
        if not owner.ours:
            if owner.now is not None:
                print(f"{_stale(service, owner)}; removing the stale pid file")
            else:
                print(f"{service.name}: not running")
            service.pid_file().unlink(missing_ok=True)
            continue
        _stop(service, owner.pid)
        service.pid_file().unlink(missing_ok=True)
        print(f"{service.name}: stopped")


def _stop(service: Service, pid: int) -> None:
    """SIGTERM to the service's process group (it runs in its own session), SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    for _ in range(30):
        if service.pid() is None:
            return
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def status() -> None:
    prefect_port, mlflow_port = ports()
    for service in [*services(), model_server()]:
        owner = service.owner()
        pid = owner.pid if owner.ours else None
        health = (
            "" if service.health is None or not pid else (" healthy" if _healthy(service.health) else " NOT answering")
        )
        print(f"{service.name:<15} {'pid ' + str(pid) if pid else 'stopped':<12}{health}  log {service.log_file()}")
        if not owner.ours and owner.now is not None:
            print(f"  {_stale(service, owner)}; `down` removes the stale pid file")
    print(f"Prefect UI: http://127.0.0.1:{prefect_port}   MLflow UI: http://127.0.0.1:{mlflow_port}")


def results() -> None:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    from tasks import GATE_ARTIFACT, RESULTS_ARTIFACT

    prefect_port, mlflow_port = ports()
    latest = {}
    with SyncPrefectClient(api=environment()["PREFECT_API_URL"]) as client:
        for key in (RESULTS_ARTIFACT, GATE_ARTIFACT):
            found = client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                sort=ArtifactSort.CREATED_DESC,
                limit=1,
            )
            latest[key] = found[0].data if found else None
    print(latest[RESULTS_ARTIFACT] or "no results yet: run `prefect deployment run jacobi-forcing/full`")
    if latest[GATE_ARTIFACT]:
        print(f"\n{latest[GATE_ARTIFACT]}")
    print(f"\nPrefect UI: http://127.0.0.1:{prefect_port}   MLflow UI: http://127.0.0.1:{mlflow_port}")
    from tasks.tracking import TrackingConfig, models_link

    if link := models_link(TrackingConfig(uri=f"http://127.0.0.1:{mlflow_port}")):  # the recipes' default experiment
        print(f"Compare checkpoints (MLflow Models tab): {link}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "env", "results", "serve"])
    parser.add_argument("--recipe", help="recipe the deployments run (default configs/pipeline_smollm2_cpu.yaml)")
    parser.add_argument("--model", help="what `serve` serves (default models:/$JF_REGISTERED_MODEL@champion)")
    args = parser.parse_args(argv)
    if args.command == "up":
        up(args.recipe)
    elif args.command == "down":
        down()
    elif args.command == "status":
        status()
    elif args.command == "results":
        results()
    elif args.command == "serve":
        serve(args.model)
    else:
        print("\n".join(f"export {k}={v}" for k, v in environment().items()))


if __name__ == "__main__":
    main()
