"""The operating-system isolation around model-written programs, tried as an attacker would.

Every hostile program first defeats the in-process audit hook (`BREAK_GUARD`; the first test
shows that this works when the hook is the only wall), so what these tests exercise is the
isolation itself: namespaces, the unprivileged uid, the read-only system and the capped tmpfs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from jfcore.evaluation.isolation import ENVIRONMENT, NOBODY
from jfcore.evaluation.sandbox import SandboxLimits, Verdict, judge
from jfcore.hostspeed import scaled

QUICK = SandboxLimits(cpu_s=2, wall_s=scaled(8))
SECRET = f"jf-secret-{uuid.uuid4().hex}"
# The tests show whatever f returned in the verdict's detail: a leaked secret would be there.
TEST = "result = f(1)\nassert result == 2, repr(result)\n"
# Empties the audit hook's tables of refused events and imports (found by name in the server's
# module) and makes every path look like the working folder: the in-process guard then refuses nothing.
BREAK_GUARD = """
import os, os.path, sys
for table in ("DENIED_EVENTS", "DENIED_IMPORTS", "PATH_EVENTS"):
    getattr(sys.modules["__main__"], table).clear()
os.path.realpath = lambda path, **kwargs: os.getcwd()
"""


def sandboxed_processes() -> set[int]:
    """Processes in another pid namespace than this one, or running as the sandbox's uid."""
    mine, found = os.readlink("/proc/self/ns/pid"), set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if os.readlink(proc / "ns" / "pid") != mine or proc.stat().st_uid == NOBODY:
                    found.add(int(proc.name))
            except OSError:
                continue
    return found


@pytest.fixture
def contained(monkeypatch):
    """Runs a hostile program; checks it failed, leaked no secret and left no process behind."""
    monkeypatch.setenv("JF_TEST_SECRET", SECRET)  # in the evaluator's environment when the sandbox starts
    before = sandboxed_processes()

    def run(program: str, tests: str = TEST, limits: SandboxLimits = QUICK) -> Verdict:
        verdict = judge(BREAK_GUARD + program, tests, limits=limits)
        assert not verdict.passed, verdict
        assert "sandbox:" not in verdict.detail, verdict  # the audit hook refused nothing: the isolation held
        assert SECRET not in verdict.detail
        assert sandboxed_processes() <= before, "a process of the program outlived the verdict"
        return verdict

    return run


def test_the_broken_guard_alone_would_let_a_write_out(tmp_path):
    outside = tmp_path / "pwned.txt"
    program = f"def f(x):\n    open({str(outside)!r}, 'w').write('x')\n    return 2\n"
    assert judge(program, TEST, limits=QUICK, isolated=False).status == "error"  # the hook refuses it...
    assert judge(BREAK_GUARD + program, TEST, limits=QUICK, isolated=False).passed  # ...until it is defeated
    assert outside.exists()
    outside.unlink()
    assert judge(BREAK_GUARD + program, TEST, limits=QUICK).status == "error"  # the isolation holds
    assert not outside.exists()


def test_what_the_program_sees():
    probe = BREAK_GUARD + (
        "import os, socket\n"
        "def f(x):\n"
        "    status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())\n"
        "    return {'uid': os.getuid(), 'pid': os.getpid(), 'caps': int(status['CapEff'], 16),\n"
        "            'env': dict(os.environ), 'procs': sorted(p for p in os.listdir('/proc') if p.isdigit()),\n"
        "            'nics': sorted(n for _, n in socket.if_nameindex()), 'host': socket.gethostname(),\n"
        "            'cwd': os.getcwd(), 'root': sorted(os.listdir('/'))}\n"
    )
    tests = (
        "seen = f(1)\n"
        f"assert seen['uid'] == {NOBODY} and seen['caps'] == 0 and seen['pid'] == 1, seen\n"
        "assert seen['procs'] == ['1'], seen\n"  # no other process of the host is visible
        "assert seen['nics'] == ['lo'] and seen['host'] == 'sandbox', seen\n"
        f"assert set(seen['env']) <= {set(ENVIRONMENT) | {'PWD', 'LC_CTYPE'}!r}, seen\n"
        "assert seen['cwd'] == '/tmp' and 'home' not in seen['root'] and 'work' not in seen['root'], seen\n"
    )
    verdict = judge(probe, tests, limits=QUICK)
    assert verdict.passed, verdict


def test_files_outside_cannot_be_written_through_dir_fds_renames_or_the_read_only_system(contained, tmp_path):
    outside, relative = tmp_path / "pwned.txt", str(tmp_path / "pwned.txt")[1:]
    system_file = os.__file__
    mtime = os.stat(system_file).st_mtime
    for attack in [
        f"open({str(outside)!r}, 'w').write('x')",
        f"root = os.open('/', os.O_RDONLY)\n    os.close(os.open({relative!r}, os.O_WRONLY | os.O_CREAT, dir_fd=root))",
        f"open('a', 'w').write('x')\n    os.rename('a', {relative!r}, dst_dir_fd=os.open('/', os.O_RDONLY))",
        f"os.symlink({str(outside)!r}, 'link')\n    open('link', 'w').write('x')",
        f"os.utime({system_file!r}, (0, 0))",
        "open('/usr/pwned', 'w').write('x')",
        "os.mkdir('/pwned')",
    ]:
        contained(f"def f(x):\n    {attack}\n    return 2\n")
    assert not outside.exists() and os.stat(system_file).st_mtime == mtime
    assert not Path("/usr/pwned").exists() and not Path("/pwned").exists()


def test_root_only_files_and_other_processes_cannot_be_read(contained, tmp_path):
    secret_file = tmp_path / "root-only"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o600)
    for attack in [
        f"return open({str(secret_file)!r}).read()",
        "return open('/etc/shadow').read()",
        "return os.listdir('/root')",
        f"return open('/proc/{os.getpid()}/environ').read()",  # the evaluator, by its pid on the host
        "return [open(f'/proc/{p}/environ').read() for p in os.listdir('/proc') if p.isdigit()]",
        "return open('/proc/1/root/proc/1/environ').read() + str(os.environ)",
        "return os.listdir('/proc/1/root/work')",
    ]:
        contained(f"import os\ndef f(x):\n    {attack}\n")


def test_forked_and_setsid_survivors_end_with_the_verdict(contained):
    for spawn in [
        "if os.fork() == 0:\n        time.sleep(60)",
        "if os.fork() == 0:\n        os.setsid()\n        if os.fork() == 0:\n            time.sleep(60)\n        os._exit(0)",
        "subprocess.Popen(['setsid', 'sleep', '60'], start_new_session=True)",
        "subprocess.Popen(['sh', '-c', 'trap \"\" TERM HUP; sleep 60 & sleep 60'])",
    ]:
        contained(f"import os, subprocess, time\ndef f(x):\n    {spawn}\n    time.sleep(0.3)\n    return 3\n")


def test_a_fork_bomb_is_capped_and_ends(contained):
    limits = SandboxLimits(cpu_s=2, wall_s=scaled(8), processes=32)
    contained("import os\ndef f(x):\n    while True:\n        os.fork()\n", limits=limits)


def test_the_disk_is_a_small_tmpfs(contained):
    for size in [1 << 20, 1 << 10]:  # big files, and many small ones: each takes a page
        verdict = contained(
            "def f(x):\n    i = 0\n    while True:\n"
            f"        with open(f'f{{i}}', 'wb') as out:\n            out.write(b'x' * {size})\n        i += 1\n",
            limits=SandboxLimits(cpu_s=10, wall_s=scaled(30), disk_mb=16),
        )
        assert "No space left on device" in verdict.detail, verdict


def test_memory_is_capped(contained):
    # Each block's pages are zeroed, which costs CPU time: a budget well above what reaching the cap takes on a
    # loaded host, so that the memory cap, not the CPU budget, is what ends the program.
    roomy = SandboxLimits(cpu_s=10, wall_s=scaled(60), memory_mb=512)
    verdict = contained("blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))\n", limits=roomy)
    assert "MemoryError" in verdict.detail, verdict
    contained("def f(x):\n    return len(bytearray(8 << 30))\n")


class Listener:
    """A host-side socket that records whether anything reached it."""

    def __init__(self, family: int, kind: int, address):
        self.socket = socket.socket(family, kind)
        self.socket.bind(address)
        self.socket.settimeout(0.2)
        self.address = self.socket.getsockname()
        if kind == socket.SOCK_STREAM:
            self.socket.listen()
        self.reached = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._wait, args=(kind,), daemon=True)
        self.thread.start()

    def _wait(self, kind: int) -> None:
        while not self.stopping:
            try:
                self.socket.accept() if kind == socket.SOCK_STREAM else self.socket.recv(64)
                self.reached.set()
            except OSError:
                continue

    def close(self) -> bool:
        self.stopping = True
        self.thread.join()
        self.socket.close()
        return self.reached.is_set()


def test_no_socket_of_any_family_reaches_the_host(contained, tmp_path):
    listeners = {
        "tcp": Listener(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0)),
        "udp": Listener(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0)),
        "unix": Listener(socket.AF_UNIX, socket.SOCK_STREAM, str(tmp_path / "host.sock")),
        "abstract": Listener(socket.AF_UNIX, socket.SOCK_STREAM, f"\0jf-test-{uuid.uuid4().hex}"),
    }
    if socket.has_ipv6:
        try:
            listeners["tcp6"] = Listener(socket.AF_INET6, socket.SOCK_STREAM, ("::1", 0))
        except OSError:  # no IPv6 loopback on this host
            pass
    address = {name: listener.address for name, listener in listeners.items()}
    attacks = [
        f"socket.create_connection({address['tcp'][:2]!r}, timeout=1)",
        f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', {address['udp']!r})\n    raise OSError('sent')",
        f"s = socket.socket(socket.AF_UNIX)\n    s.connect({address['unix']!r})",
        f"s = socket.socket(socket.AF_UNIX)\n    s.connect({address['abstract']!r})",
        f"import urllib.request\n    urllib.request.urlopen('http://127.0.0.1:{address['tcp'][1]}/', timeout=1)",
        "socket.socket(socket.AF_PACKET, socket.SOCK_RAW)",
        "s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)\n    s.bind((0, 0))\n    raise OSError('netlink')",
        "socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)",
        "socket.create_connection(('1.1.1.1', 80), timeout=1)",
    ]
    if "tcp6" in address:
        attacks.append(f"socket.create_connection(('::1', {address['tcp6'][1]}), timeout=1)")
    for attack in attacks:
        contained(f"import socket\ndef f(x):\n    {attack}\n    return 2\n")
    reached = {name for name, listener in listeners.items() if listener.close()}
    assert reached == set()


@pytest.fixture
def bystander():
    """A process with the sandbox's uid on the host (nobody when run by root; otherwise the user's own)."""
    same_uid = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
    process = subprocess.Popen(["sleep", "120"], **same_uid)
    yield process
    process.kill()
    process.wait()


def test_killing_the_parent_the_group_or_everything_hurts_no_one_outside(bystander, contained):
    for attack in [
        "os.kill(os.getppid(), 9)",
        "os.killpg(os.getpgid(0), 9)",
        "os.kill(-1, 9)",
        f"os.kill({os.getpid()}, 9)",
        f"os.kill({bystander.pid}, 9)",
    ]:
        contained(f"import os\ndef f(x):\n    {attack}\n    return 3\n")  # a wrong answer: fails alive or dead
    assert bystander.poll() is None  # alive, as is this process


def test_without_bubblewrap_code_evaluation_refuses_to_start():
    env = os.environ | {"PATH": "/nonexistent"}
    code = (
        "from jfcore.evaluation.sandbox import judge\n"
        "try:\n    judge('def f(x):\\n    return x + 1\\n', 'assert f(1) == 2\\n')\n"
        "except Exception as err:\n    print(type(err).__name__, err)\n"
    )
    said = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert said.startswith("IsolationUnavailable") and "bubblewrap" in said and "unsafe_no_isolation" in said, said
