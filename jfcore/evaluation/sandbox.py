"""Running model-written code safely, and judging it with the benchmark's own tests.

Two processes per program:
- the program runs in `sandbox_server.py`, inside operating-system isolation
  (`jfcore.evaluation.isolation`: its own pid, network, mount, ipc and uts namespaces, an
  unprivileged uid without capabilities, a read-only system, a size-capped tmpfs as its
  only writable folder, a minimal environment), with CPU time, address space, file size,
  open file and process-count limits, and an audit hook as a first tripwire that says
  early what a benchmark solution never needs; on a timeout or at the verdict its whole
  pid namespace is killed;
- the tests run here, in the trusted process. The program's functions are bound as proxies
  that forward each call to the sandbox and unpickle the answer with `PlainData` (plain
  Python values only), so the verdict cannot be forged: printing "passed", exiting early,
  killing the server or returning an object whose __eq__ always says True all fail.

Time: CPU seconds decide a timeout, so a correct program is not failed because the host
is busy (other processes share its cores) or slow (callers scale the budget with
`jfcore.hostspeed.slowdown()`). The wall clock is only a backstop, for programs that wait
instead of computing (a sleep, a blocked read), and is generous on purpose.

`isolated=False` (the evaluation's `unsafe_no_isolation`) runs the server as a plain
child process with the audit hook as its only wall: for hosts without namespaces, and
only for trusted programs.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import math
import os
import pickle
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from typing_extensions import Self

from jfcore.evaluation.isolation import ENVIRONMENT, IsolationUnavailable, require_isolation, sandbox_command

SERVER = Path(__file__).with_name("sandbox_server.py")
REFERENCE = "__jf_sandbox_reference__"  # the same marker as in sandbox_server.py
# The wall-clock backstop leaves room for a host running other work on every core: a program
# that gets a quarter of a core still finishes inside it before it runs out of CPU time.
WALL_PER_CPU, WALL_SLACK_S = 4.0, 10.0


class SandboxFailure(Exception):
    """The program could not be loaded or called (timeout, crash, refused operation, bad answer)."""


class ProgramLoadError(SandboxFailure):
    """Running the program's top level failed (or it exited) before any test could call it."""


class SandboxUnavailable(RuntimeError):
    """The sandbox itself could not start: a fault of the host, never a verdict on the program."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: float = 10.0  # CPU seconds for loading the program and every call together: the budget
    wall_s: float | None = None  # backstop for waiting programs; default WALL_PER_CPU x cpu_s + WALL_SLACK_S
    memory_mb: int = 1024  # address space
    file_mb: int = 16  # largest file the program may write
    disk_mb: int = 64  # size of its tmpfs, all its files together (isolated only)
    open_files: int = 256
    processes: int = 64  # RLIMIT_NPROC: the sandbox uid's processes and threads (root, unisolated, is exempt)

    @property
    def wall_backstop_s(self) -> float:
        return self.wall_s if self.wall_s is not None else WALL_PER_CPU * self.cpu_s + WALL_SLACK_S


@dataclass(frozen=True)
class Verdict:
    status: Literal["passed", "failed", "timeout", "load_error", "error"]
    detail: str = ""
    cpu_seconds: float = 0.0  # CPU time the program used (loading and every call)

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class PlainData(pickle.Unpickler):
    """Unpickles answers from the sandbox: builtin values only, never a class or function of its choosing."""

    # Builtin and standard-library value types: the program cannot change how they compare here.
    ALLOWED = (
        {
            ("builtins", n)
            for n in (
                "complex",
                "set",
                "frozenset",
                "bytearray",
                "range",
                "slice",
                "int",
                "float",
                "str",
                "bytes",
                "list",
                "dict",
                "tuple",
                "bool",
            )
        }
        | {("collections", n) for n in ("Counter", "OrderedDict", "defaultdict", "deque")}
        | {("fractions", "Fraction"), ("decimal", "Decimal")}
    )

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise SandboxFailure(f"the program answered with a {module}.{name} object; only plain values are compared")


class Sandbox:
    """One loaded program; `call(name, *args)` runs one of its functions in the sandbox."""

    def __init__(
        self, program: str, module: str, after: str = "", limits: SandboxLimits | None = None, isolated: bool = True
    ):
        self.limits = limits or SandboxLimits()
        self.deadline = time.monotonic() + self.limits.wall_backstop_s
        self.seq = 0
        self.cpu_seconds = 0.0  # CPU time the program has used, as of the last answer or its end
        self.folder = self.pidfd = self.pid = None
        self.isolated = isolated
        if isolated:
            self._start_isolated()
        else:
            self.folder = tempfile.mkdtemp(prefix="jf-sandbox-")
            self.process = subprocess.Popen(
                [sys.executable, "-I", str(SERVER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=self.folder,
                env=ENVIRONMENT | {"HOME": self.folder},
                start_new_session=True,
                close_fds=True,
            )
            self.pid = self.process.pid
        try:
            # soft = hard: SIGKILL at the budget (the isolated server is its namespace's pid 1, which ignores SIGXCPU)
            mb, cpu = 1 << 20, math.ceil(self.limits.cpu_s)
            limits = {
                "RLIMIT_CPU": cpu,
                "RLIMIT_AS": self.limits.memory_mb * mb,
                "RLIMIT_FSIZE": self.limits.file_mb * mb,
                "RLIMIT_NOFILE": self.limits.open_files,
                "RLIMIT_NPROC": self.limits.processes,
                "RLIMIT_CORE": 0,
            }
            self._send({"module": module, "program": program, "after": after, "limits": limits})
            answer = self._receive(0)
            if answer[1] == "load_error":
                raise ProgramLoadError(f"the program failed to load: {answer[2]}: {answer[3]}")
        except BaseException:
            self.close()  # the with-block never starts, so clean up here
            raise

    def _start_isolated(self) -> None:
        require_isolation()
        info, info_write = os.pipe()
        try:
            self.process = subprocess.Popen(
                sandbox_command(str(SERVER), tmpfs_mb=self.limits.disk_mb, info_fd=info_write),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=ENVIRONMENT,
                start_new_session=True,
                pass_fds=(info_write,),
            )
        except OSError as err:
            os.close(info)
            raise SandboxUnavailable(f"bwrap could not be started: {err}") from err
        finally:
            os.close(info_write)
        try:
            self.pid = self._child_pid(info)
            with contextlib.suppress(ProcessLookupError):
                self.pidfd = os.pidfd_open(self.pid)  # kills the right process even after its pid is reused
        except BaseException:
            self.close()
            raise
        finally:
            os.close(info)

    def _child_pid(self, fd: int) -> int:
        """The server's pid on this host, which bwrap writes to its info pipe once the namespaces exist."""
        data = b""
        while True:
            if not select.select([fd], [], [], max(self.deadline - time.monotonic(), 0))[0]:
                break
            chunk = os.read(fd, 4096)
            data += chunk
            with contextlib.suppress(ValueError):
                return int(json.loads(data)["child-pid"])
            if not chunk:
                break
        error = (
            self.process.stderr.read().decode(errors="replace").strip()[-300:]
            if self.process.poll() is not None
            else ""
        )
        raise SandboxUnavailable(f"the sandbox did not start (bwrap: {error or 'no answer'})")

    def call(self, name: str, *args, **kwargs):
        self.seq += 1
        self._send((self.seq, name, args, kwargs))
        answer = self._receive(self.seq)
        if answer[1] == "error":
            raise SandboxFailure(f"{name} raised {answer[2]}: {answer[3]}")
        return answer[2]

    def _send(self, message) -> None:
        data = pickle.dumps(message)
        try:
            self.process.stdin.write(struct.pack("<I", len(data)) + data)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            raise self._ended("is gone") from err

    def _read(self, size: int) -> bytes:
        chunks, fd = [], self.process.stdout.fileno()
        while size:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                self.cpu_seconds = self._cpu_now()
                raise TimeoutError(
                    f"the program waited past the {self.limits.wall_backstop_s:g} s wall-clock backstop "
                    f"(having used {self.cpu_seconds:.1f} s of its {self.limits.cpu_s:g} s CPU budget)"
                )
            chunk = os.read(fd, size)
            if not chunk:
                raise self._ended("ended")
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def _receive(self, seq: int):
        (size,) = struct.unpack("<I", self._read(4))
        try:
            answer = PlainData(io.BytesIO(self._read(size))).load()
        except SandboxFailure:
            raise
        except Exception as err:
            raise SandboxFailure(f"unreadable answer from the program: {err}") from err
        if not isinstance(answer, tuple) or not answer or answer[0] != seq:
            raise SandboxFailure("the program's process answered out of turn")
        self.cpu_seconds = self._cpu_now()
        return answer

    def _cpu_now(self) -> float:
        """User + system CPU seconds of the server's process (readable until it is reaped)."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError, TypeError):  # gone, or never started
            return self.cpu_seconds
        return max(self.cpu_seconds, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))

    def _reap(self, timeout: float | None) -> int | None:
        """Wait for the child to exit; its exit code (a signal as -n), and its CPU time from the kernel's accounting."""
        if self.process.returncode is not None:
            return self.process.returncode
        with contextlib.suppress(ChildProcessError):  # reaped already (by Popen.poll)
            return self._wait(timeout)
        return self.process.returncode

    def _wait(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(self.process.pid, 0 if deadline is None else os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        code = os.waitstatus_to_exitcode(status)
        if self.isolated and code > 128:  # bwrap exits with 128 + the signal that ended the program
            code = 128 - code
        self.process.returncode = code
        self.cpu_seconds = max(self.cpu_seconds, usage.ru_utime + usage.ru_stime)  # includes what bwrap reaped
        return code

    def _ended(self, what: str) -> Exception:
        """The error for a process that went away: a timeout when it ran out of CPU time."""
        code = self._reap(timeout=5)
        if code == -signal.SIGKILL and self.cpu_seconds > math.ceil(self.limits.cpu_s) - 0.1:
            return TimeoutError(f"the program used up its {self.limits.cpu_s:g} s CPU budget")
        if code is None:
            return SandboxFailure(f"the program's process {what} (still running)")
        reason = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return SandboxFailure(f"the program's process {what} ({reason})")

    def close(self) -> None:
        self.cpu_seconds = self._cpu_now()
        if self.pidfd is not None:  # the isolated server is pid 1 of its namespace: everything in it ends too
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            os.close(self.pidfd)
            self.pidfd = None
            self._reap(timeout=5)  # bwrap reaps it and exits, which accounts its CPU time to bwrap
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # unisolated: everything it started, too
        self._reap(timeout=None)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            with contextlib.suppress(OSError, AttributeError):
                stream.close()
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class _Remote:
    """A value that exists only in the sandbox: a global made by setup code from the program's own classes."""

    name: str


def _proxy(sandbox: Sandbox, name: str):
    def call(*args, **kwargs):
        args = tuple((REFERENCE, a.name) if isinstance(a, _Remote) else a for a in args)
        return sandbox.call(name, *args, **kwargs)

    call.__name__ = name
    return call


def _assigned_names(code: str) -> list[str]:
    """Top-level names the trusted setup code assigns."""
    if not code.strip():
        return []
    tree = ast.parse(code)
    return [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)]


def defined_functions(program: str) -> list[str]:
    """Top-level function names of a program (read from its text, never by running it)."""
    return re.findall(r"^(?:async\s+)?def\s+(\w+)\s*\(", program, flags=re.MULTILINE)


def judge(
    program: str,
    tests: str,
    *,
    context: str = "",
    after: str = "",
    entry_points: list[str] | None = None,
    limits: SandboxLimits | None = None,
    isolated: bool = True,
) -> Verdict:
    """Run `tests` here against `program` loaded in a sandbox.

    `context` is trusted code run here before the tests (a HumanEval prompt's helpers,
    MBPP's imports). `after` is setup code run in the sandbox after the program (MBPP's
    test_setup_code, which builds arguments from classes the program defines); the names
    it assigns reach the tests as references to those sandbox values. Calls to
    `entry_points` (default: every function the program defines) go to the sandbox.
    `isolated=False` runs it without operating-system isolation (trusted programs only).
    """
    name = f"_jf_tests_{uuid.uuid4().hex}"
    module = type(sys)(name)
    sandbox = None
    try:
        with Sandbox(program, name, after, limits, isolated) as sandbox:
            exec(compile(context, "<context>", "exec"), module.__dict__)  # noqa: S102 (running code is the point)
            for assigned in _assigned_names(after):
                module.__dict__[assigned] = _Remote(assigned)
            for function in entry_points or defined_functions(program):
                module.__dict__[function] = _proxy(sandbox, function)
            exec(compile(tests, "<tests>", "exec"), module.__dict__)  # noqa: S102 (running code is the point)
        verdict = Verdict("passed")
    except (IsolationUnavailable, SandboxUnavailable):
        raise  # the host's fault, not the program's: never a verdict
    except TimeoutError as err:
        verdict = Verdict("timeout", str(err))
    except ProgramLoadError as err:
        verdict = Verdict("load_error", str(err))
    except SandboxFailure as err:
        verdict = Verdict("error", str(err))
    except AssertionError as err:
        verdict = Verdict("failed", f"assertion failed {err}".strip())
    except Exception as err:  # noqa: BLE001 (a test that cannot run against the program is a failure)
        verdict = Verdict("failed", f"{type(err).__name__}: {err}")
    return dataclasses.replace(verdict, cpu_seconds=sandbox.cpu_seconds if sandbox else 0.0)
