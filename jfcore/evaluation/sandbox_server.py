"""The untrusted side of the code sandbox: loads one model-written program and answers calls into it.

Run as `python -I sandbox_server.py` by jfcore.evaluation.sandbox, inside the operating-system
isolation of jfcore.evaluation.isolation (or, unsafe, as a plain child process in a fresh temporary
folder), with a minimal environment; it sets its resource limits itself before the program
runs. Standard library only.

The verdict is never decided here: the benchmark's tests run in the trusted process and
reach the program only through calls answered by this server, so nothing the program
prints, exits with or writes can count as a pass. Requests and answers are
length-prefixed pickles; answers are unpickled on the trusted side by an unpickler
that accepts plain data only.

Before the program runs, an audit hook refuses what a benchmark solution never needs, so
that a program doing it fails early with a clear message. It is a tripwire, not the wall:
code in the same process can defeat it, and the isolation holds when it does. It refuses
processes (fork, exec, spawn, system, subprocess), signals to other processes, sockets,
ctypes, files written, deleted or renamed outside the working folder, and reads under /proc.
"""

import os
import pickle
import resource
import struct
import sys

DENIED_EVENTS = {
    "os.fork",
    "os.forkpty",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.system",
    "os.startfile",
    "subprocess.Popen",
    "os.kill",
    "os.killpg",
    "signal.pthread_kill",
    "socket.__new__",
    "socket.connect",
    "socket.bind",
    "socket.getaddrinfo",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "ctypes.cdata",
    "ctypes.addressof",
    "sys._current_frames",
    "os.setuid",
    "os.setgid",
    "os.chroot",
    "resource.setrlimit",
    "resource.prlimit",
}
DENIED_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess", "socket", "_socket", "multiprocessing", "pty"}
PATH_EVENTS = {  # event -> indices of path arguments that must stay inside the working folder
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.rename": (0, 1),
    "os.mkdir": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.symlink": (1,),
    "os.link": (1,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "shutil.rmtree": (0,),
    "shutil.copyfile": (1,),
    "shutil.copytree": (1,),
    "shutil.move": (1,),
}
REFERENCE = "__jf_sandbox_reference__"  # (REFERENCE, name): an argument that is a global of the program's module
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def install_guard(root: str) -> None:
    root = os.path.realpath(root)

    def inside(path) -> bool:
        if isinstance(path, int):  # a file descriptor
            return True
        path = os.path.realpath(os.fsdecode(path))
        return path == root or path.startswith(root + os.sep)

    def hook(event, args):
        if event in DENIED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in DENIED_IMPORTS:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return
            writes = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & WRITE_FLAGS)
            if writes and not inside(path):
                raise PermissionError(f"sandbox: writing {path} is outside the working folder")
            if os.path.realpath(os.fsdecode(path)).startswith("/proc/"):
                raise PermissionError(f"sandbox: reading {path} is not allowed")
        elif event in PATH_EVENTS:
            for i in PATH_EVENTS[event]:
                if i < len(args) and args[i] is not None and not inside(args[i]):
                    raise PermissionError(f"sandbox: {event} on {args[i]} is outside the working folder")

    sys.addaudithook(hook)


def read_message(stream):
    header = stream.read(4)
    if len(header) < 4:
        return None
    (size,) = struct.unpack("<I", header)
    return pickle.loads(stream.read(size))


def write_message(stream, message) -> None:
    try:
        data = pickle.dumps(message)
    except Exception as err:  # noqa: BLE001 (an answer that cannot travel is an error answer)
        data = pickle.dumps((message[0], "error", type(err).__name__, f"result cannot be sent: {err}"))
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def main() -> None:
    # The protocol gets private copies of stdin/stdout; the program's own output goes nowhere.
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    setup = read_message(requests)
    for name, value in setup["limits"].items():  # set here, not in a preexec_fn: the parent may have threads
        resource.setrlimit(
            getattr(resource, name), tuple(value) if isinstance(value, (tuple, list)) else (value, value)
        )
    module = type(sys)(setup["module"])
    install_guard(os.getcwd())
    try:
        exec(compile(setup["program"], "<program>", "exec"), module.__dict__)  # noqa: S102 (running code is the point)
        if setup["after"]:
            exec(compile(setup["after"], "<setup>", "exec"), module.__dict__)  # noqa: S102 (running code is the point)
    except BaseException as err:  # noqa: BLE001 (SystemExit included: the program may not end the server)
        write_message(answers, (0, "load_error", type(err).__name__, str(err)[:500]))
        return
    write_message(answers, (0, "ready"))
    while (request := read_message(requests)) is not None:
        seq, name, args, kwargs = request
        try:
            function = module.__dict__[name]
            args = [
                module.__dict__[a[1]] if isinstance(a, tuple) and len(a) == 2 and a[0] == REFERENCE else a for a in args
            ]
            write_message(answers, (seq, "ok", function(*args, **kwargs)))
        except BaseException as err:  # noqa: BLE001
            write_message(answers, (seq, "error", type(err).__name__, str(err)[:500]))


if __name__ == "__main__":
    main()
