"""Rows with one long opening (a system prompt: here a few-shot block of solved GSM8K train problems) decoded with
the opening's KV shared between rows, and with every row holding its own copy, side by side in one run.

Each round decodes the same batch both ways back to back (order alternating), on the real model. Printed and
written to JSON: prefill seconds (time to the first token), decode tokens/s, end-to-end tokens/s, the KV cache
the batch holds after its prefill, and whether the two ways gave the same tokens (a row that differs is reported
with the top-2 logit margin where it first differs: float rounding may flip only a near tie).

    python -m bench.shared_prefix_bench                               # 16 rows, 8 examples, AR and Jacobi
    python -m bench.shared_prefix_bench --rows 4 --examples 2 --max-new-tokens 16 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace

import torch

from bench.common import RESULTS, few_shot_system, top2_gap
from jfcore.chat import encode_chat
from jfcore.decoding import DecodeConfig, decode, special_tokens
from jfcore.decoding.decoder import Decoder
from jfcore.models import ModelConfig, load_model
from jfcore.paths import default_data_dir, eval_prompts


def kv_bytes(model, prompts: list[list[int]], config: DecodeConfig) -> int:
    """Bytes of KV the batch holds right after admitting `prompts` (its own slots, and any shared prefix)."""
    live = Decoder(model, config, eos_token_ids=[], pad_token_id=0).scheduler()
    live.add(prompts)
    own = sum(t.numel() * t.element_size() for layer in live.slots.cache.layers for t in (layer.keys, layer.values))
    shared = live.slots.shared
    prefixes = shared.prefixes if shared is not None else []
    return own + sum(t.numel() * t.element_size() for p in prefixes for t in (*p.keys, *p.values))


def margin_at_divergence(model, prompt: list[int], a: list[int], b: list[int]) -> dict:
    """Where two outputs first differ, and the reference forward's top-2 logit margin there."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"position": at, "top2_margin": top2_gap(model, prompt, a[:at])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--examples", type=int, default=8, help="solved problems in the shared system prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--methods", nargs="+", default=["ar", "jacobi"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--share-prefix-tokens", type=int, default=DecodeConfig.share_prefix_tokens)
    p.add_argument("--label", default="run")
    args = p.parse_args()

    data_dir = default_data_dir()
    model, tokenizer = load_model(ModelConfig(name_or_path=args.model, dtype="float32"))
    system = few_shot_system(args.examples, data_dir)
    questions = eval_prompts("gsm8k", args.rows)
    prompts = [encode_chat(tokenizer, q, system) for q in questions]
    eos, pad = special_tokens(model)
    ways = {"own_copies": 0, "shared": args.share_prefix_tokens}
    print(f"{len(prompts)} rows, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens")

    results: dict = {"methods": {}}
    results["settings"] = {
        **vars(args),
        "prompt_tokens": [len(p) for p in prompts],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": platform.node(),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"shared-prefix-{args.label}.json"
    for method in args.methods:
        base = DecodeConfig(method=method, max_new_tokens=args.max_new_tokens)
        runs: dict[str, list[dict]] = {way: [] for way in ways}
        outputs = {}
        for r in range(args.rounds):
            for way in ways if r % 2 == 0 else reversed(ways):
                config = replace(base, share_prefix_tokens=ways[way])
                start = time.perf_counter()
                out = decode(model, prompts, config, eos_token_id=eos, pad_token_id=pad)
                wall = time.perf_counter() - start
                s = out.stats
                runs[way].append(
                    {
                        "prefill_seconds": s.prefill_seconds,
                        "decode_tokens_per_second": s.new_tokens / s.decode_seconds,
                        "tokens_per_second": s.new_tokens / wall,
                        "new_tokens": s.new_tokens,
                    }
                )
                outputs[way] = out.sequences
        figures = {
            way: {key: statistics.median(run[key] for run in done) for key in done[0]} for way, done in runs.items()
        }
        for way, share in ways.items():
            figures[way]["kv_bytes_after_prefill"] = kv_bytes(model, prompts, replace(base, share_prefix_tokens=share))
        differs = [
            {"row": i, **margin_at_divergence(model, prompts[i], a, b)}
            for i, (a, b) in enumerate(zip(outputs["own_copies"], outputs["shared"]))
            if a != b
        ]
        own, shared = figures["own_copies"], figures["shared"]
        ratios = {
            key: shared[key] / own[key]
            for key in ("prefill_seconds", "decode_tokens_per_second", "tokens_per_second", "kv_bytes_after_prefill")
        }
        results["methods"][method] = {"figures": figures, "shared_over_own": ratios, "rows_that_differ": differs}
        print(
            f"{method:>10}: prefill {own['prefill_seconds']:.2f} -> {shared['prefill_seconds']:.2f} s, "
            f"decode {own['decode_tokens_per_second']:.1f} -> {shared['decode_tokens_per_second']:.1f} tok/s, "
            f"end to end {own['tokens_per_second']:.1f} -> {shared['tokens_per_second']:.1f} tok/s, "
            f"KV {own['kv_bytes_after_prefill'] / 2**20:.1f} -> {shared['kv_bytes_after_prefill'] / 2**20:.1f} MiB, "
            f"rows that differ: {len(differs)}"
        )
        path.write_text(json.dumps(results, indent=2))  # after each method: a long run stopped early keeps its figures
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
