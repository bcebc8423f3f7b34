"""Which decoder a tune was measured with: its code and the kernel settings it ran under. A tune's measured costs
and speedups hold only for that engine, so a tune made by other decoder code, or applied under other linear or
compile settings, is stale: the tuner measures again and decoding falls back to the untuned default (each says so).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

from jfcore.decoding import DecodeConfig
from jfcore.tuning.machine import field_differences

DECODER_SOURCES = Path(__file__).resolve().parents[1] / "decoding"


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
