"""Where and with what a tune was measured: the machine (a tuned configuration holds only where its cost curve was
measured) and the engine, the decoder's code and the kernel settings it ran under. A tune's measured costs and
speedups hold only for that engine, so a tune made by other decoder code, or applied under other linear or compile
settings, is stale: the tuner measures again and decoding falls back to the untuned default (each says so).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from jfcore.decoding import DecodeConfig
from jfcore.environment import cpu_model, usable_cores

DECODER_SOURCES = Path(__file__).resolve().parent / "decoding"


@dataclass(frozen=True)
class MachineIdentity:
    cpu: str  # the CPU model name
    cores: int  # cores this process may use
    torch_threads: int
    gpu: str | None  # the GPU's name when decoding on one
    device: str  # "cpu" or "cuda"
    dtype: str  # the model's dtype while measured

    def as_dict(self) -> dict:
        return asdict(self)

    def differences(self, other: MachineIdentity) -> list[str]:
        return field_differences(self, other)


def field_differences(mine, theirs) -> list[str]:
    """What differs between two identities of one kind, as `field: mine != theirs` lines (empty: the same)."""
    return [
        f"{name}: {getattr(mine, name)!r} != {getattr(theirs, name)!r}"
        for name in mine.__dataclass_fields__
        if getattr(mine, name) != getattr(theirs, name)
    ]


def this_machine(device: str | torch.device, dtype: str | torch.dtype) -> MachineIdentity:
    device = torch.device(device)
    cores = usable_cores()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return MachineIdentity(
        cpu=cpu_model(),
        cores=cores,
        torch_threads=torch.get_num_threads(),
        gpu=gpu,
        device=device.type,
        dtype=str(dtype).removeprefix("torch."),
    )


@dataclass(frozen=True)
class EngineIdentity:
    decoder: str  # digest of the decoder's sources, Python and C (`decoder_digest`)
    linear: str  # DecodeConfig.linear the tune ran under
    compile: str  # DecodeConfig.compile the tune ran under

    def as_dict(self) -> dict:
        return asdict(self)

    def differences(self, other: EngineIdentity) -> list[str]:
        return field_differences(self, other)


@functools.cache
def decoder_digest() -> str:
    """sha256 over jfcore/decoding's .py, .c and .h files (names and bytes, in name order), 16 hex digits: any change
    to the decoder, the built C step's sources included, makes another digest."""
    digest = hashlib.sha256()
    for path in sorted(p for p in DECODER_SOURCES.rglob("*") if p.suffix in (".py", ".c", ".h")):
        digest.update(path.relative_to(DECODER_SOURCES).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def this_engine(config: DecodeConfig) -> EngineIdentity:
    """The engine `config` decodes with: this code, its linear and compile settings."""
    return EngineIdentity(decoder=decoder_digest(), linear=config.linear, compile=config.compile)
