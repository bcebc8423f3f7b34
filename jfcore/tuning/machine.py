"""Which machine a tune was measured on: a tuned configuration holds only where the cost curve was measured."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from jfcore.environment import cpu_model, usable_cores


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
