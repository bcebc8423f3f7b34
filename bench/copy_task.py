"""A sanity case whose answer is known: distillation must make a copying model's own drafts long.

The task: a prompt is a random sequence of 8-24 content words and `=`; the answer is the same sequence and
`</s>`. A tiny Llama trained autoregressively on it copies fluently, but it finds each next word from the one
before (its drafts fail as soon as one word is wrong: untrained Jacobi decoding commits about 1.1 tokens per
forward), while every answer word is fixed by the prompt and its position alone. So Jacobi Forcing can teach it
to draft whole blocks: its own-draft TPF must climb toward the block size. If it does not, the objective, the
mask or the data has a defect.

`make_copy_model` trains the AR model (about a minute on 2 cores) and checks that it is fluent; `main` then runs
the pipeline's own stages through the flow (trajectories -> packing -> DeepSpeed training, without servers),
prints the learning curve the training stage measured on its held-out prompts (simulated TPF and noisy accuracy
against training tokens, and the decoded TPF of the final model) and writes it as JSON:

    python -m bench.copy_task                          # runs/copy-task, bench/results/copy_task.json
    python -m bench.copy_task --set training.ar_weight=10 --work-dir runs/copy-task-lambda10

tests/integration/test_copy_task.py runs the same with a shorter training and asserts the climb.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from jfcore.contracts import ACCEPTANCE, LATEST, TRAINING
from jfcore.decoding import DecodeConfig, decode
from jfcore.environment import usable_cores
from jfcore.training.checkpoints import read_metrics

WORDS = 24  # content words c0..c23
LENGTHS = (8, 24)  # words per sequence, inclusive
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "="]
FLUENT = 0.98  # share of fresh prompts the AR model must copy exactly


def tokenizer() -> PreTrainedTokenizerFast:
    words = SPECIAL + [f"c{i}" for i in range(WORDS)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def sample(rng: random.Random) -> str:
    """One prompt's text: the sequence to copy, then `=`."""
    return " ".join(f"c{rng.randrange(WORDS)}" for _ in range(rng.randint(*LENGTHS))) + " ="


def answer(prompt_ids: list[int], eos: int) -> list[int]:
    return prompt_ids[:-1] + [eos]  # the words again, then EOS


def make_copy_model(path: str | Path, steps: int = 1000, seed: int = 0) -> Path:
    """Train the AR copying model (loss on the answer only) and save it with its tokenizer; refuses to save a
    model that does not copy fresh prompts fluently. Uses every usable core meanwhile (a test process keeps one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(usable_cores())
    try:
        return _train_copy_model(Path(path), steps, seed)
    finally:
        torch.set_num_threads(threads)


def _train_copy_model(path: Path, steps: int, seed: int) -> Path:
    tok = tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        prompts = [tok(sample(rng))["input_ids"] for _ in range(32)]
        texts = [p + answer(p, tok.eos_token_id) for p in prompts]
        width = max(map(len, texts))
        ids = torch.full((len(texts), width), tok.pad_token_id)
        labels = torch.full((len(texts), width), -100)
        for b, (p, text) in enumerate(zip(prompts, texts)):
            ids[b, : len(text)] = torch.tensor(text)
            labels[b, len(p) : len(text)] = torch.tensor(text[len(p) :])
        logits = model(input_ids=ids).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()
    fluency = copy_accuracy(model, tok, random.Random(seed + 1))
    if fluency < FLUENT:
        raise RuntimeError(f"the AR model copies {fluency:.0%} of fresh prompts exactly (< {FLUENT:.0%}): train longer")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def copy_accuracy(model, tok, rng: random.Random, prompts: int = 64) -> float:
    """Share of fresh prompts whose greedy answer is the exact copy."""
    ids = [tok(sample(rng))["input_ids"] for _ in range(prompts)]
    out = decode(model, ids, DecodeConfig(method="ar", max_new_tokens=LENGTHS[1] + 2))
    return sum(o == answer(p, tok.eos_token_id) for o, p in zip(out.sequences, ids)) / prompts


def write_prompts(path: Path, count: int, seed: int) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"id": i, "prompt": sample(rng)}) + "\n" for i in range(count)))
    return path


def recipe(work_dir: Path, model: Path, prompts: Path, block_size: int, steps: int) -> dict:
    """The pipeline recipe: real trajectories, packing (1/64 of the prompts held out; noise targets drawn at
    random, since an answer of 2-3 blocks gets only a few points of a progressive ramp) and DeepSpeed training in
    one CPU process, acceptance measured every `steps // 10` steps at block sizes 4 and 8."""
    return {
        "work_dir": str(work_dir),
        "model": {"name_or_path": str(model)},
        "prompts": {"path": str(prompts), "id_field": "id", "chat_template": False},
        "trajectories": {"block_size": block_size, "max_new_tokens": LENGTHS[1] + 2, "batch_size": 64},
        "prompts_per_shard": 256,
        "ray": {"address": "none", "cpus_per_worker": 2},
        "packing": {"strategy": "random", "heldout_fraction": 1 / 64},
        "training": {
            "max_steps": steps,
            "micro_batch_size": 8,
            "learning_rate": 1.0e-3,
            "warmup_ratio": 0.05,
            "ar_weight": 1.0,
            "checkpoint_every": steps,
            "acceptance": {"every": max(steps // 10, 1), "block_sizes": [4, 8], "prompts": 32, "tokens": 64},
        },
        "launch": {"processes": 1, "deepspeed_config": "zero0"},
    }


def curve(work_dir: Path) -> list[dict]:
    """What the training stage measured on its held-out prompts, in order (the decoded check last)."""
    return read_metrics(work_dir / TRAINING / LATEST / ACCEPTANCE)


def run(work_dir: Path, prompts: int, steps: int, block_size: int, overrides: list[str]) -> dict:
    from flows.jacobi_forcing import jacobi_forcing
    from jfcore.config import apply_overrides

    work_dir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    model = work_dir / "copy-model"
    if not (model / "config.json").is_file():
        make_copy_model(model)
    made = time.perf_counter() - began
    data = recipe(work_dir, model, write_prompts(work_dir / "prompts.jsonl", prompts, seed=0), block_size, steps)
    jacobi_forcing(apply_overrides(data, overrides), stages=["trajectories", "packing", "training"])
    return {"model_seconds": made, "seconds": time.perf_counter() - began, "curve": curve(work_dir)}


def table(points: list[dict]) -> str:
    keys = sorted({k for p in points for k in p if k.startswith("heldout/")})
    head = ["step", "tokens", *(k.removeprefix("heldout/") for k in keys)]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for p in points:
        cells = [str(p["step"]), str(p.get("tokens", ""))] + [f"{p[k]:.3f}" if k in p else "" for k in keys]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default="runs/copy-task")
    parser.add_argument("--prompts", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe value")
    parser.add_argument("--out", default="bench/results/copy_task.json")
    args = parser.parse_args(argv)
    result = run(Path(args.work_dir), args.prompts, args.steps, args.block_size, args.set)
    print(table(result["curve"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), **result}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
