"""The local stack (infra/stack.py: Prefect server and process worker, MLflow server) for flow-level tests,
and the `prefect` commands a user types against it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

from jfcore.hostspeed import scaled
from tests.support import REPO
from tests.support.servers import free_port

# A short tune for tiny models in flow tests: few tokens, a small grid, one curve round (seconds, not minutes).
TINY_TUNE = {
    "max_new_tokens": 16,
    "block_sizes": [1, 2, 4],
    "lookup_tokens": [0, 2, 4],
    "lookup_ngrams": [2],
    "confirm": 2,
    "confirm_prompts": 2,
    "widths": [1, 2, 4, 8],
    "curve_rounds": 1,
    "multiblock": False,
}


def start_stack(root: Path) -> dict:
    """`infra/stack.py up` with its state under `root`; `stop_stack` takes it down."""
    env = dict(
        os.environ, JF_STACK_DIR=str(root / "stack"), JF_PREFECT_PORT=str(free_port()), JF_MLFLOW_PORT=str(free_port())
    )
    env.pop("PREFECT_HOME", None)  # the stack's own, not the test session's throwaway one
    # The worker looks for scheduled runs every 10 s by default: a test that starts a dozen runs one after another
    # would wait about a minute for pickups alone.
    env["PREFECT_WORKER_QUERY_SECONDS"] = "1"
    exports = subprocess.run(
        [sys.executable, "infra/stack.py", "env"], env=env, cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    env |= dict(line.removeprefix("export ").split("=", 1) for line in exports.splitlines())
    stack = {"root": root, "env": env, "mlflow": env["MLFLOW_TRACKING_URI"]}
    try:
        subprocess.run([sys.executable, "infra/stack.py", "up"], env=env, cwd=REPO, check=True, timeout=scaled(300))
    except BaseException:
        stop_stack(stack)
        raise
    return stack


def stop_stack(stack: dict) -> None:
    subprocess.run(
        [sys.executable, "infra/stack.py", "down"], env=stack["env"], cwd=REPO, check=False, timeout=scaled(120)
    )


def prefect(stack, *args: str, timeout: float = 600) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        env=stack["env"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
        check=False,
    )
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout if "--output" in args else done.stdout + done.stderr  # logs may come on either


def start_run(stack, recipe: Path, deployment: str = "full", **params: object) -> str:
    extra = [a for k, v in params.items() for a in ("--param", f"{k}={json.dumps(v)}")]
    out = prefect(stack, "deployment", "run", f"jacobi-forcing/{deployment}", "--param", f"recipe={recipe}", *extra)
    return re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1)


def state_of(stack, flow_run_id: str) -> str:
    # The API in process, not `prefect flow-run inspect`: each CLI call is a 2.5 s interpreter start, and polling
    # with it took most of a core from the flow run under test on a 2-core host.
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api=stack["env"]["PREFECT_API_URL"]) as client:
        return client.read_flow_run(UUID(flow_run_id)).state.type.value


def finish(stack, flow_run_id: str, timeout: float = 900) -> str:
    """Wait for the flow run to end; returns its log (and fails with it unless it completed)."""
    wait_for(
        lambda: state_of(stack, flow_run_id) in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"),
        timeout,
        f"flow run {flow_run_id}",
    )
    logs = logs_of(stack, flow_run_id)
    assert state_of(stack, flow_run_id) == "COMPLETED", logs[-6000:]
    return logs


def logs_of(stack, flow_run_id: str) -> str:
    """The flow run's log messages in order, one a line: what `prefect flow-run logs` prints, without its 2.5 s
    interpreter start. Logs reach the server in batches after the state does, so this waits (a few seconds at
    most) for the flow's own closing line."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    only = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(flow_run_id)]))
    deadline = time.time() + scaled(15)
    with SyncPrefectClient(api=stack["env"]["PREFECT_API_URL"]) as client:
        while True:
            logs = []
            while page := client.read_logs(only, limit=200, offset=len(logs)):
                logs += page
            closed = any(log.task_run_id is None and log.message.startswith("Finished in state") for log in logs)
            if closed or time.time() > deadline:
                return "\n".join(log.message for log in logs)
            time.sleep(0.5)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.time() + scaled(timeout)
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(1)
