"""LoRA adapters: the merged export computes what the adapted model computes, under the base's own names."""

from __future__ import annotations

import copy

import pytest
import torch

from jfcore.config import ConfigError
from jfcore.training.config import LoraConfig
from jfcore.training.lora import is_lora, merged_state_dict, with_lora
from tests.support.tiny_models import tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_merged_weights_compute_what_the_adapted_model_does(arch):
    adapted = with_lora(tiny_model(arch), LoraConfig(rank=4, alpha=8))
    assert is_lora(adapted) and not is_lora(tiny_model(arch))
    for name, param in adapted.named_parameters():
        if "lora_B" in name:  # fresh adapters are zero; make them count
            torch.nn.init.normal_(param, std=0.2)
    state = merged_state_dict(adapted)
    plain = tiny_model(arch)
    assert state.keys() == plain.state_dict().keys()
    plain.load_state_dict(state)
    tokens = torch.randint(0, 90, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens).logits, adapted(input_ids=tokens).logits, rtol=1e-4, atol=1e-4)
        reference = copy.deepcopy(adapted).merge_and_unload().state_dict()  # peft's own merge agrees
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value)


def test_only_adapters_train():
    adapted = with_lora(tiny_model("llama"), LoraConfig(rank=2))
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_unknown_target_modules_are_a_config_error():
    with pytest.raises(ConfigError, match="target_modules"):
        with_lora(tiny_model("llama"), LoraConfig(target_modules=("no_such_proj",)))
