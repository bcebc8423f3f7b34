"""Low-rank adapters (LoRA, through peft) as an alternative to full fine-tuning.

Only the adapters train, so gradients and AdamW state exist for them alone. The losses, data order,
checkpoints and resume are the same as for full fine-tuning. An export merges each adapter into the
weight it adapts (W + alpha / rank * B A), so the result is still a plain checkpoint of the base
architecture, which any decoder loads.
"""

from __future__ import annotations

import torch

from jfcore.config import ConfigError
from jfcore.training.config import LoraConfig


def with_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """`model` wrapped with fresh adapters (B = 0, so it starts out computing exactly what `model` does)."""
    try:
        import peft
    except ImportError:
        raise ConfigError("TrainConfig.lora needs the peft package: pip install peft") from None
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    settings = peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, task_type="CAUSAL_LM"
    )
    try:
        return peft.get_peft_model(model, settings)
    except ValueError as err:  # target modules that this architecture does not have
        raise ConfigError(f"TrainConfig.lora.target_modules: {err}") from None


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain checkpoint's weights of an adapted model, on the CPU: every adapted weight plus its adapters'
    update, under the base architecture's own names. The model itself is left as it is (training goes on)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    state = {
        key.replace(".base_layer.", "."): value.detach().cpu().clone()
        for key, value in base.state_dict().items()
        if "lora_" not in key
    }
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            weight = f"{name}.weight"
            for adapter in module.active_adapters:
                state[weight] += module.get_delta_weight(adapter).detach().cpu().to(state[weight].dtype)
    return state
