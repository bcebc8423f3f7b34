"""Run inside the sandbox by jfcore.evaluation.isolation: prints "isolated" when the isolation took effect."""

import os
from pathlib import Path

status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
capabilities = int(status["CapEff"], 16)
isolated = os.getuid() == 65534 and os.getpid() == 1 and capabilities == 0 and os.environ.get("HOME") == "/tmp"
print("isolated" if isolated else f"not isolated: uid {os.getuid()}, pid {os.getpid()}, capabilities {capabilities:x}")
