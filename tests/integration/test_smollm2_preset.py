"""The embedded default model's preset: converted once from its GGUF, then reused; a plain HF checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jfcore import models as jm
from jfcore.models import ModelConfig, load_model, resolve_checkpoint
from jfcore.paths import default_data_dir


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jf-cache")
    start = time.perf_counter()
    checkpoint = resolve_checkpoint(ModelConfig(cache_dir=str(cache)))
    print(f"\nSmolLM2 conversion: {time.perf_counter() - start:.1f} s")
    return cache, Path(checkpoint)


@pytest.mark.slow
def test_smollm2_preset_is_reused(smollm2, monkeypatch):
    cache, checkpoint = smollm2
    assert checkpoint == cache / "models" / f"smollm2-135m-instruct-{jm.CONVERSION_VERSION}"
    assert [p.name for p in (cache / "models").iterdir() if p.is_dir()] == [checkpoint.name]  # no temp dirs left
    weights = next(checkpoint.glob("*.safetensors"))
    mtime = weights.stat().st_mtime_ns

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(jm, "_convert_gguf", no_conversion)
    monkeypatch.setenv("JF_CACHE_DIR", str(cache))
    start = time.perf_counter()
    model, tokenizer = load_model(ModelConfig())  # cache dir from JF_CACHE_DIR
    print(f"\nSmolLM2 cached load: {time.perf_counter() - start:.1f} s")
    assert weights.stat().st_mtime_ns == mtime
    assert model.dtype == torch.float32 and sum(p.numel() for p in model.parameters()) > 100e6
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    bf16, _ = load_model(ModelConfig(dtype="bfloat16"))
    assert bf16.dtype == torch.bfloat16


@pytest.mark.slow
def test_smollm2_checkpoint_is_plain_hf_and_generates(smollm2):
    _, checkpoint = smollm2
    config = json.loads((checkpoint / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"
    assert tokenizer.model_max_length == config["max_position_embeddings"]

    with open(default_data_dir() / "prompts" / "gsm8k_train.jsonl") as f:
        prompt = json.loads(f.readline())["prompt"]
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.eval().generate(**ids, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"\nSmolLM2 greedy: {text!r}")
    words = text.split()
    assert len(words) >= 5 and sum(w.isalpha() for w in words) >= 3 and len(set(words)) >= 4
