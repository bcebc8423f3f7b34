"""What the benchmark scripts share: where results go, the run's environment, prompts, the tiny fast model, the
model's tune, and the top-2 logit gap that says whether a differing greedy token was a near tie. Importing it
loads neither torch nor transformers (bench.data_scale_bench measures a process's memory above its imports)."""

from __future__ import annotations

import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

    from jfcore.models import ModelConfig

RESULTS = Path(__file__).resolve().parent / "results"  # git-ignored; published figures go to bench/published/


@dataclass
class Prompt:
    source: str  # the prompt set it came from (results are also broken down by it)
    text: str
    ids: list[int]


def environment(model_config: ModelConfig) -> dict:
    import torch
    import transformers

    cuda = model_config.device.startswith("cuda")
    return {
        "model": asdict(model_config),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def tuned_settings(model_config: ModelConfig, model, batch_size: int) -> dict:
    """The model's tune for this machine (DecodeConfig keys); an error when it has none."""
    from jfcore.jacobi_forcing_json import decoding_for, tuned_decoding, tuned_keys
    from jfcore.machine import this_machine
    from jfcore.models import resolve_checkpoint

    checkpoint = resolve_checkpoint(model_config)
    if not Path(checkpoint).is_dir() or tuned_decoding(checkpoint) is None:
        raise SystemExit(
            f"--tuned: {model_config.name_or_path} has no tune; run jf-tune --model {model_config.name_or_path}"
        )
    machine = this_machine(next(model.parameters()).device, model.dtype)
    return tuned_keys(decoding_for(checkpoint, machine, batch_size))


def top2_gap(model, prompt: list[int], prefix: list[int]) -> float:
    """The model's (eager) top-2 logit gap for the token after `prompt + prefix`: how close to a tie the position
    was where a method's output left the reference."""
    import torch

    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + prefix], device=device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def short_forward_model(seed: int = 0, layers: int = 2) -> LlamaForCausalLM:
    """Small layers (two by default) and a small vocabulary: a forward short enough that host work shows, as on a
    GPU. The decoder's cache work is per layer, so `layers` = 30 (SmolLM2-135M's depth) shows that part at a real
    model's size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def prompts_for(batch: int, vocab: int, seed: int) -> list[list[int]]:
    """`batch` seeded random prompts of 32-96 tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randrange(32, 97))] for _ in range(batch)]


def few_shot_system(examples: int, data_dir: Path) -> str:
    """A system prompt of `examples` solved GSM8K train problems."""
    path = data_dir / "prompts" / "gsm8k_train.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()[:examples]]
    shots = "\n\n".join(f"Question: {r['prompt']}\nAnswer: {r['solution']}" for r in records)
    return f"Solve each grade-school math problem step by step, as in these examples.\n\n{shots}"
