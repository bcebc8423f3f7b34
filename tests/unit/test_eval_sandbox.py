"""The code sandbox: a wrong solution fails, hostile programs are contained and fail."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jfcore.evaluation.benchmarks import BenchmarkConfig, load_benchmark
from jfcore.evaluation.code import CodeProblem, judge_workers, score_completion
from jfcore.evaluation.sandbox import SandboxLimits, judge
from jfcore.hostspeed import scaled

TEST = "assert f(1) == 2\n"
QUICK = SandboxLimits(cpu_s=2, wall_s=scaled(6))


def code_problems(name: str) -> list[CodeProblem]:
    return [p.code for p in load_benchmark(BenchmarkConfig(name=name))]


def test_a_wrong_solution_fails_and_a_fenced_completion_passes():
    problem = code_problems("humaneval")[0]
    assert not score_completion(problem, "    return False\n").passed
    fenced = f"Here you go:\n```python\n{problem.reference}```\n"
    assert score_completion(problem, fenced).passed


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def sandbox_processes() -> set[int]:
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            if b"sandbox_server.py" in (proc / "cmdline").read_bytes():
                found.add(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.parametrize(
    "program, status",
    [
        ("while True:\n    pass\n", {"timeout"}),  # at load time
        ("def f(x):\n    while True:\n        pass\n", {"timeout"}),
        ("import time\ndef f(x):\n    time.sleep(60)\n", {"timeout"}),  # no CPU used: the wall clock
        ("import os\nwhile True:\n    os.fork()\n", {"load_error"}),  # fork bomb
        ("import subprocess\ndef f(x):\n    subprocess.run(['sh', '-c', ':(){ :|:& };:'])\n", {"error", "load_error"}),
        ("import os\ndef f(x):\n    os.system('echo hi')\n    return 2\n", {"error"}),
        ("x = bytearray(8 << 30)\n", {"load_error"}),  # memory hog
        ("def f(x):\n    return len([0] * (1 << 31))\n", {"error"}),
        ("import ctypes\n", {"load_error"}),
        ("def f(x):\n    import os\n    os.kill(os.getppid(), 9)\n", {"error"}),
        ("print('passed')\nimport sys\nsys.exit(0)\n", {"load_error"}),  # faking a pass
        ("def f(x):\n    import os\n    os._exit(0)\n", {"error"}),
        ("def f(x):\n    raise SystemExit(0)\n", {"error"}),
        ("class Yes:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Yes()\n", {"error"}),
        ("def f(x):\n    print('ALL TESTS PASSED')\n    return 3\n", {"failed"}),
    ],
)
def test_hostile_programs_are_contained_and_fail(program, status):
    before = sandbox_processes()
    started = time.monotonic()
    verdict = judge(program, TEST, limits=QUICK)
    assert verdict.status in status, verdict
    assert time.monotonic() - started < QUICK.wall_backstop_s + scaled(5)
    assert sandbox_processes() <= before  # nothing the program started outlives the verdict


@pytest.fixture
def busy_host():
    """Two CPU-bound processes per core beside the test, as on a shared or overloaded machine."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(2 * judge_workers())
    ]  # each in its own session, like the sandbox: equal shares
    yield
    for spinner in spinners:
        spinner.kill()
        spinner.wait()


WORK = "def f(x):\n    total = 0\n    for i in range({n}):\n        total += i % 7\n    return x + 1\n"


def test_cpu_time_decides_a_timeout_not_a_busy_host(busy_host):
    # A program needing about a second of CPU, and a budget of twice that.
    n = 4_000_000
    unloaded = judge(WORK.format(n=n), TEST, limits=SandboxLimits(cpu_s=60, wall_s=scaled(600)))
    assert unloaded.passed, unloaded
    n = int(n * 1.0 / max(unloaded.cpu_seconds, 0.05))  # about one CPU second on this host
    budget = SandboxLimits(cpu_s=2)
    started = time.monotonic()
    verdict = judge(WORK.format(n=n), TEST, limits=budget)
    wall = time.monotonic() - started
    assert verdict.passed, verdict
    assert 0.5 < verdict.cpu_seconds < budget.cpu_s
    # The host ran it slower than its CPU budget in wall-clock terms: a wall-clock limit would have failed it.
    assert wall > verdict.cpu_seconds * 2, (wall, verdict.cpu_seconds)


def test_a_timeout_says_which_limit_ended_it():
    budget = SandboxLimits(cpu_s=2)  # and the default wall-clock backstop, 18 s: a loaded host reaches 2 CPU s first
    spins = judge("def f(x):\n    while True:\n        pass\n", TEST, limits=budget)
    assert spins.status == "timeout" and "used up its 2 s CPU budget" in spins.detail, spins
    assert spins.cpu_seconds > 1.5  # /proc samples CPU time by clock ticks: 1.87 s was read on a loaded host
    # Ignoring SIGXCPU does not help: the hard limit kills it a second later.
    ignores = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"
    ignored = judge(ignores, TEST, limits=budget)
    assert ignored.status == "timeout" and "used up its 2 s CPU budget" in ignored.detail, ignored
    waits = judge("import time\ndef f(x):\n    time.sleep(600)\n", TEST, limits=SandboxLimits(cpu_s=2, wall_s=1))
    assert waits.status == "timeout" and "1 s wall-clock backstop" in waits.detail, waits
    assert waits.cpu_seconds < 1


def test_files_outside_the_working_folder_cannot_be_written_or_deleted(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    outside = tmp_path / "pwned.txt"
    for program in [
        f"def f(x):\n    open({str(outside)!r}, 'w').write('x')\n    return 2\n",
        f"import os\ndef f(x):\n    os.remove({str(keep)!r})\n    return 2\n",
        f"import shutil\ndef f(x):\n    shutil.rmtree({str(tmp_path)!r})\n    return 2\n",
        f"import os\ndef f(x):\n    os.rename({str(keep)!r}, 'stolen.txt')\n    return 2\n",
        f"from pathlib import Path\ndef f(x):\n    Path({str(outside)!r}).write_text('x')\n    return 2\n",
    ]:
        assert judge(program, TEST, limits=QUICK).status == "error", program
    assert keep.read_text() == "precious" and not outside.exists()
    # Inside its own folder a program may write and read as it likes.
    ok = "def f(x):\n    open('scratch.txt', 'w').write(str(x + 1))\n    return int(open('scratch.txt').read())\n"
    assert judge(ok, TEST, limits=QUICK).passed


def test_secrets_in_the_environment_do_not_reach_the_program(monkeypatch):
    monkeypatch.setenv("JF_TEST_SECRET_TOKEN", "s3cret")
    reads = "import os\ndef f(x):\n    return os.environ.get('JF_TEST_SECRET_TOKEN')\n"
    assert judge(reads, "assert f(1) == 's3cret'\n", limits=QUICK).status == "failed"
    parent = "import os\ndef f(x):\n    return open(f'/proc/{os.getppid()}/environ').read()\n"
    assert judge(parent, "assert 's3cret' in f(1)\n", limits=QUICK).status == "error"


def test_no_network_socket_can_be_opened():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    connected = threading.Event()

    def accept() -> None:
        try:
            server.accept()
            connected.set()
        except OSError:
            pass

    listener = threading.Thread(target=accept)
    listener.start()
    for program in [
        f"import socket\ndef f(x):\n    socket.create_connection(('127.0.0.1', {port}))\n    return 2\n",
        f"import _socket\ndef f(x):\n    _socket.socket().connect(('127.0.0.1', {port}))\n    return 2\n",
        f"import urllib.request\ndef f(x):\n    urllib.request.urlopen('http://127.0.0.1:{port}/')\n    return 2\n",
    ]:
        assert judge(program, TEST, limits=QUICK).status in {"error", "load_error"}, program
    listener.join()
    server.close()
    assert not connected.is_set()


def test_the_parent_survives_and_the_process_group_is_reaped():
    pid = os.getpid()
    judge("def f(x):\n    import signal, os\n    os.killpg(os.getpgid(0), 9)\n", TEST, limits=QUICK)
    assert alive(pid)
