"""Running model-written code safely, and judging it with the benchmark's own tests.

Two processes per program:
- the program runs in `sandbox_server.py`: a separate Python process in its own session,
  in a fresh temporary folder, with a minimal environment (no inherited secrets), CPU time,
  address space, file size and process-count limits, and an audit hook refusing processes,
  signals, sockets, ctypes and writes outside its folder; on timeout its whole process group
  is killed;
- the tests run here, in the trusted process. The program's functions are bound as proxies
  that forward each call to the sandbox and unpickle the answer with `PlainData` (plain
  Python values only), so the verdict cannot be forged: printing "passed", exiting early,
  killing the server or returning an object whose __eq__ always says True all fail.

Time: CPU seconds decide a timeout, so a correct program is not failed because the host
is busy (other processes share its cores) or slow (callers scale the budget with
`jfcore.hostspeed.slowdown()`). The wall clock is only a backstop, for programs that wait
instead of computing (a sleep, a blocked read), and is generous on purpose.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
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

SERVER = Path(__file__).with_name("sandbox_server.py")
REFERENCE = "__jf_sandbox_reference__"  # the same marker as in sandbox_server.py
# The wall-clock backstop leaves room for a host running other work on every core: a program
# that gets a quarter of a core still finishes inside it before it runs out of CPU time.
WALL_PER_CPU, WALL_SLACK_S = 4.0, 10.0
# What a program's environment keeps; everything else (tokens, keys, cloud credentials) is dropped.
ENVIRONMENT = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}


class SandboxFailure(Exception):
    """The program could not be loaded or called (timeout, crash, refused operation, bad answer)."""


class ProgramLoadError(SandboxFailure):
    """Running the program's top level failed (or it exited) before any test could call it."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: float = 10.0  # CPU seconds for loading the program and every call together: the budget
    wall_s: float | None = None  # backstop for waiting programs; default WALL_PER_CPU x cpu_s + WALL_SLACK_S
    memory_mb: int = 1024  # address space
    file_mb: int = 16  # largest file the program may write
    processes: int = 64  # RLIMIT_NPROC (counts the user's processes; root is exempt, the audit hook is not)

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
    ALLOWED = {("builtins", n) for n in ("complex", "set", "frozenset", "bytearray", "range", "slice", "int", "float",
                                         "str", "bytes", "list", "dict", "tuple", "bool")} | {
        ("collections", n) for n in ("Counter", "OrderedDict", "defaultdict", "deque")
    } | {("fractions", "Fraction"), ("decimal", "Decimal")}  # fmt: skip

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise SandboxFailure(f"the program answered with a {module}.{name} object; only plain values are compared")


class Sandbox:
    """One loaded program; `call(name, *args)` runs one of its functions in the sandbox."""

    def __init__(self, program: str, module: str, after: str = "", limits: SandboxLimits | None = None):
        self.limits = limits or SandboxLimits()
        self.deadline = time.monotonic() + self.limits.wall_backstop_s
        self.folder = tempfile.mkdtemp(prefix="jf-sandbox-")
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, cwd=self.folder, env=ENVIRONMENT | {"HOME": self.folder},
            start_new_session=True, close_fds=True,
        )  # fmt: skip
        self.seq = 0
        self.cpu_seconds = 0.0  # CPU time the program has used, as of the last answer or its end
        try:
            mb, cpu = 1 << 20, math.ceil(self.limits.cpu_s)
            # (soft, hard): SIGXCPU at the budget, SIGKILL a second later should the program ignore it
            limits = {"RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_AS": self.limits.memory_mb * mb,
                      "RLIMIT_FSIZE": self.limits.file_mb * mb, "RLIMIT_NPROC": self.limits.processes, "RLIMIT_CORE": 0}  # fmt: skip
            self._send({"module": module, "program": program, "after": after, "limits": limits})
            answer = self._receive(0)
            if answer[1] == "load_error":
                raise ProgramLoadError(f"the program failed to load: {answer[2]}: {answer[3]}")
        except BaseException:
            self.close()  # the with-block never starts, so clean up here
            raise

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
        """User + system CPU seconds of the program's process (readable until it is reaped)."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return self.cpu_seconds
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _ended(self, what: str) -> Exception:
        """The error for a process that went away: a timeout when it ran out of CPU time."""
        deadline = time.monotonic() + 5  # wait for the exit without reaping, so its CPU time can still be read
        with contextlib.suppress(ChildProcessError):
            while os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        self.cpu_seconds = self._cpu_now()
        code = self.process.poll()
        if code == -signal.SIGXCPU or (code == -signal.SIGKILL and self.cpu_seconds > math.ceil(self.limits.cpu_s) - 0.1):
            return TimeoutError(f"the program used up its {self.limits.cpu_s:g} s CPU budget")
        if code is None:
            return SandboxFailure(f"the program's process {what} (still running)")
        reason = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return SandboxFailure(f"the program's process {what} ({reason})")

    def close(self) -> None:
        self.cpu_seconds = self._cpu_now()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # everything it started, too
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Sandbox:
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


def judge(program: str, tests: str, *, context: str = "", after: str = "", entry_points: list[str] | None = None,
          limits: SandboxLimits | None = None) -> Verdict:  # fmt: skip
    """Run `tests` here against `program` loaded in a sandbox.

    `context` is trusted code run here before the tests (a HumanEval prompt's helpers,
    MBPP's imports). `after` is setup code run in the sandbox after the program (MBPP's
    test_setup_code, which builds arguments from classes the program defines); the names
    it assigns reach the tests as references to those sandbox values. Calls to
    `entry_points` (default: every function the program defines) go to the sandbox.
    """
    name = f"_jf_tests_{uuid.uuid4().hex}"
    module = type(sys)(name)
    sandbox = None
    try:
        with Sandbox(program, name, after, limits) as sandbox:
            exec(compile(context, "<context>", "exec"), module.__dict__)  # noqa: S102 (running code is the point)
            for assigned in _assigned_names(after):
                module.__dict__[assigned] = _Remote(assigned)
            for function in entry_points or defined_functions(program):
                module.__dict__[function] = _proxy(sandbox, function)
            exec(compile(tests, "<tests>", "exec"), module.__dict__)  # noqa: S102 (running code is the point)
        verdict = Verdict("passed")
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
