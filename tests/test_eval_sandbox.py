"""The code sandbox: reference solutions pass, hostile programs are contained and fail."""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from jfcore.eval.benchmarks import BenchmarkConfig, load_benchmark
from jfcore.eval.code import CodeProblem, score_completion
from jfcore.eval.sandbox import SandboxLimits, judge

TEST = "assert f(1) == 2\n"
QUICK = SandboxLimits(timeout_s=3, cpu_s=2)


def code_problems(name: str) -> list[CodeProblem]:
    return [p.code for p in load_benchmark(BenchmarkConfig(name))]


@pytest.mark.parametrize("name, count", [("humaneval", 164), ("mbpp", 257), ("mbpp_full", 500)])
def test_every_reference_solution_passes(name, count):
    problems = code_problems(name)
    assert len(problems) == count
    with ThreadPoolExecutor(4) as pool:
        verdicts = list(pool.map(lambda p: score_completion(p, p.reference), problems))
    assert [(p.task_id, v.detail) for p, v in zip(problems, verdicts) if not v.passed] == []


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
        ("while True:\n    pass\n", {"timeout", "error"}),  # at load time
        ("def f(x):\n    while True:\n        pass\n", {"timeout", "error"}),
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
    assert time.monotonic() - started < 15
    assert sandbox_processes() <= before  # nothing the program started outlives the verdict


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
