"""Operating-system isolation for model-written programs (README, "Scoring and the sandbox").

The program's process runs under bubblewrap (`bwrap`) in its own pid, network, mount,
ipc and uts namespaces:
- it sees a read-only view of the system's /usr and the Python installation it runs
  on, its own /proc (only its own processes), a minimal /dev, and a size-capped tmpfs
  at /tmp, its working folder and only writable place;
- it is an unprivileged uid with no capabilities: run by root, `setpriv` turns it into
  the host's `nobody` (65534) before Python starts, so it owns nothing on the host and
  RLIMIT_NPROC applies to it; run by another user, bwrap maps it into a user namespace
  of its own as uid 65534, with every capability dropped;
- it is pid 1 of its namespace: when it ends, the kernel ends every process it started;
  it also dies with bwrap, and bwrap with the evaluator;
- its network namespace holds only a loopback of its own, so nothing on the host,
  loopback services and abstract unix sockets included, is reachable;
- its environment is a fixed minimal one (`ENVIRONMENT`), never the parent's.

Where bubblewrap is missing or the kernel refuses the namespaces, `isolation_problem`
says why and how to fix it, and code evaluation refuses to start unless the user asked
for `unsafe_no_isolation`.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

NOBODY = 65534
SANDBOX_SERVER = "/sandbox/sandbox_server.py"  # where the server script is mounted inside
# What a program's environment holds; nothing of the parent's (tokens, keys, cloud credentials).
ENVIRONMENT = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "HOME": "/tmp",
}
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
FIX = (
    "Install bubblewrap (`apt-get install bubblewrap`, or run `bash infra/setup.sh`, which installs it) on a "
    "Linux kernel that allows namespaces (a non-root user also needs user namespaces: "
    "sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0). Only if every program "
    "evaluated here is trusted: set `unsafe_no_isolation: true` in the evaluation config (recorded with the results)."
)


class IsolationUnavailable(RuntimeError):
    """This host cannot isolate programs; evaluating code here needs the explicit unsafe flag."""


def find_bwrap() -> str | None:
    """bubblewrap on PATH, or the copy infra/setup.sh puts beside the environment's Python."""
    found = shutil.which("bwrap")
    local = Path(sys.prefix) / "bin" / "bwrap"
    return found or (str(local) if os.access(local, os.X_OK) else None)


def interpreter() -> str:
    """The base Python (outside any virtual environment): programs get the standard library only."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _under(path: str, covered: list[str]) -> bool:
    return any(path == c or path.startswith(c.rstrip("/") + "/") for c in covered)


def _readable_tree(path: str, covered: list[str]) -> list[str]:
    """bwrap arguments that mount `path` read-only, its missing parents made traversable (bwrap makes them 0700)."""
    if _under(path, covered):
        return []
    parents = [str(p) for p in reversed(Path(path).parents) if str(p) != "/"]
    args = [a for p in parents if not _under(p, covered) for a in ("--perms", "0755", "--dir", p)]
    covered.append(path)
    return [*args, "--ro-bind", path, path]


def sandbox_command(server: str, *, tmpfs_mb: int, info_fd: int) -> list[str]:
    """The command that runs `server` (the sandbox server script) isolated; bwrap writes the child's pid to `info_fd`."""
    bwrap = find_bwrap()
    if bwrap is None:
        raise IsolationUnavailable(f"bubblewrap (bwrap) is not installed. {FIX}")
    python = interpreter()
    args = [
        bwrap,
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--as-pid-1",
        "--info-fd",
        str(info_fd),
        "--hostname",
        "sandbox",
    ]
    root = os.geteuid() == 0
    if not root:
        args += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL"]
    covered: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += _readable_tree(path, covered)
    for path in {sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(python))}:
        args += _readable_tree(os.path.realpath(path), covered)
    for path in SYSTEM_FILES:
        if os.path.exists(path):
            args += _readable_tree(path, covered)
    args += [
        "--perms",
        "0755",
        "--dir",
        os.path.dirname(SANDBOX_SERVER),
        "--ro-bind",
        server,
        SANDBOX_SERVER,
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(tmpfs_mb << 20),
        "--perms",
        "1777",
        "--tmpfs",
        "/tmp",
        "--chdir",
        "/tmp",
        "--clearenv",
    ]
    args += [a for k, v in ENVIRONMENT.items() for a in ("--setenv", k, v)]
    args.append("--")
    if root:  # become nobody, keeping no capability; keep dying with bwrap (a uid change clears that)
        args += [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--pdeathsig",
            "SIGKILL",
            "--",
        ]
    return [*args, python, "-I", SANDBOX_SERVER]


@functools.cache
def isolation_problem() -> str | None:
    """Why programs cannot be isolated on this host (None: they can). Probed once per process."""
    if sys.platform != "linux":
        return f"process isolation needs Linux namespaces; this is {sys.platform}. {FIX}"
    probe = Path(__file__).with_name("isolation_probe.py")
    read, write = os.pipe()
    try:
        command = sandbox_command(str(probe), tmpfs_mb=1, info_fd=write)
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, pass_fds=(write,), check=False)
    except IsolationUnavailable as err:
        return str(err)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bubblewrap could not be started ({err}). {FIX}"
    finally:
        os.close(read)
        os.close(write)
    if done.returncode != 0 or done.stdout.strip() != "isolated":
        said = (done.stderr.strip() or done.stdout.strip())[-300:]
        return f"bubblewrap failed to start an isolated process (exit code {done.returncode}: {said}). {FIX}"
    return None


def require_isolation() -> None:
    problem = isolation_problem()
    if problem is not None:
        raise IsolationUnavailable(f"Code evaluation refuses to run model-written programs unisolated: {problem}")
