"""`jf-decode`: decode a few prompts with the project's lossless parallel decoder.

    jf-decode                                   # 3 real prompts (GSM8K, HumanEval, MBPP), the model's tuned decoding
    jf-decode --method multiblock --compare     # also run HF greedy `generate`: same tokens? how much faster?
    jf-decode --prompt "Write a haiku about caches." --max-new-tokens 64
    jf-decode --prompts-file my.jsonl --field question --limit 5

Decoding starts from the model's tune for this machine (jf-tune), else the
untuned default (Jacobi at the block size it was trained at, 16 for other
models); --method and --block-size override it. Every method is greedy, so the
completion is the one `generate(do_sample=False)` gives; only the number of
forward passes (and the time) changes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from jfcore.chat import encode_chat, read_jsonl
from jfcore.config import ConfigError
from jfcore.decoding import decode, special_tokens
from jfcore.decoding.config import COMPILE_MODES, LINEAR_MODES
from jfcore.decoding.reference import first_divergence, hf_generate
from jfcore.decoding.runner.linear import faster_linear
from jfcore.decoding.runner.slots import device_sync
from jfcore.jacobi_forcing_json import decoding_for
from jfcore.machine import this_machine
from jfcore.models import ModelConfig, load_model, resolve_checkpoint
from jfcore.paths import eval_prompts

DEFAULT_SETS = ("gsm8k", "humaneval", "mbpp")  # one prompt of each when no prompt is given


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jf-decode",
        description="Greedy-decode prompts with Jacobi / multiblock decoding and print completions and speed.",
        epilog="Default prompts: the first GSM8K, HumanEval and MBPP test prompts from the shared data dir.",
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="preset, checkpoint dir, .gguf file or hub id")
    p.add_argument("--method", choices=["jacobi", "multiblock", "ar"], help="default: the model's tune, else jacobi")
    p.add_argument("--block-size", type=int, help="tokens per block (default: the tune's, else the trained size)")
    p.add_argument(
        "--rolling",
        action="store_const",
        const=True,
        help="jacobi: a rolling window, topped up from the model's own predictions instead of a fresh block of filler",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", nargs="+", metavar="TEXT", help="prompt text(s) to decode")
    src.add_argument("--prompts-file", type=Path, metavar="F", help="JSONL (or .jsonl.gz) file of prompts")
    p.add_argument("--field", default="prompt", help="JSON field of the prompt in --prompts-file (default: prompt)")
    p.add_argument("--limit", type=int, default=3, help="prompts to read from --prompts-file (default: 3)")
    p.add_argument("--data-dir", type=Path, help="shared data dir (default: $JF_SHARED_DATA or <repo>/../shared/data)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--attn", default="sdpa", help="attention implementation (sdpa, eager, flash_attention_2, ...)")
    p.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        help="how decode forwards run: cuda_graphs (one CUDA graph per shape bucket), inductor (torch.compile with "
        "frozen weights; each new shape compiles once, tens of seconds on a CPU, inside the timings: pays on long "
        "runs only), off (eager); default auto: cuda_graphs on a GPU, off elsewhere",
    )
    p.add_argument(
        "--linear",
        choices=LINEAR_MODES,
        help="linear layers of eager CPU forwards: auto (default) computes small products weight first wherever "
        "that measures faster on this host; torch always uses torch's own kernels",
    )
    p.add_argument("--temperature", type=float, help="sample at this temperature (default 0: greedy)")
    p.add_argument("--top-k", type=int, help="with --temperature: keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, help="with --temperature: keep the smallest set with this mass (1: off)")
    p.add_argument("--seed", type=int, help="with --temperature: the sampling seed (same seed, same tokens)")
    p.add_argument("--compare", action="store_true", help="also run HF greedy generate: identical tokens? speedup?")
    return p


def _prompts(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(label, text) pairs to decode."""
    if args.prompt:
        return [(f"prompt {i}", text) for i, text in enumerate(args.prompt, 1)]
    if args.prompts_file:
        texts = read_jsonl(args.prompts_file, args.field, args.limit)
        if not texts:
            raise ConfigError(f"no prompts in {args.prompts_file}")
        return [(f"{args.prompts_file.name}:{i}", text) for i, text in enumerate(texts, 1)]
    return [(name, eval_prompts(name, 1, args.data_dir)[0]) for name in DEFAULT_SETS]


def _timed(fn, sync):
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - start


def _one_line(text: str, width: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        prompts = _prompts(args)  # before loading the model: bad paths fail fast
        model_config = ModelConfig(
            name_or_path=args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn
        )
        print(f"loading {args.model} ({args.dtype}, {args.device}) ...", flush=True)
        model, tokenizer = load_model(model_config)
        explicit = {
            "method": args.method,
            "block_size": args.block_size,
            "rolling": args.rolling,
            "max_new_tokens": args.max_new_tokens,
            "compile": args.compile,
            "linear": args.linear,
            "temperature": args.temperature,
            "top_k": args.top_k,
            "top_p": args.top_p,
            "sample_seed": args.seed,
        }
        if args.compare and args.temperature:
            raise ConfigError("--compare checks the tokens against HF greedy generate: leave out --temperature")
        checkpoint = resolve_checkpoint(model_config)
        config = decoding_for(
            checkpoint if Path(checkpoint).is_dir() else None,
            this_machine(args.device, model.dtype),
            1,
            {k: v for k, v in explicit.items() if v is not None},
        )
    except (OSError, ConfigError) as err:  # missing files, bad settings, unloadable models (ModelLoadError)
        print(f"jf-decode: error: {err}", file=sys.stderr)
        return 2
    except KeyError as err:  # a prompt field that is not there
        print(f"jf-decode: error: {err.args[0]}", file=sys.stderr)
        return 2

    eos, pad = special_tokens(model, None, tokenizer.pad_token_id)
    sync = device_sync(args.device)
    encoded = [encode_chat(tokenizer, text) for _, text in prompts]
    what = config.describe()
    print(f"decoding {len(prompts)} prompt(s) with {what}, up to {args.max_new_tokens} new tokens\n")

    # Warm-up: the first calls pay one-off costs (allocator, kernels) that would bias the timings.
    warm = replace(config, max_new_tokens=4)
    decode(model, encoded[:1], warm, eos_token_id=eos, pad_token_id=pad)
    if args.compare:
        hf_generate(model, encoded[:1], 4, eos, pad)

    totals = {"tokens": 0, "forwards": 0, "seconds": 0.0, "hf_tokens": 0, "hf_seconds": 0.0, "identical": 0}
    for i, ((label, text), ids) in enumerate(zip(prompts, encoded), 1):
        out, seconds = _timed(lambda ids=ids: decode(model, [ids], config, eos_token_id=eos, pad_token_id=pad), sync)
        tokens, stats = out.sequences[0], out.stats
        print(f"[{i}/{len(prompts)}] {label}: {_one_line(text)}")
        print("-" * 100)
        print(tokenizer.decode(tokens, skip_special_tokens=True).strip())
        print("-" * 100)
        print(
            f"{stats.new_tokens} new tokens | {stats.decode_forwards} forwards | TPF {stats.tpf:.2f} | "
            f"{stats.new_tokens / seconds:.1f} tokens/s (decode only {stats.decode_tps:.1f}) | "
            f"overhead {stats.overhead:.0%}"
        )
        totals["tokens"] += stats.new_tokens
        totals["forwards"] += stats.decode_forwards
        totals["seconds"] += seconds
        if args.compare:
            reference, hf_seconds = _timed(
                lambda ids=ids: hf_generate(model, [ids], args.max_new_tokens, eos, pad)[0], sync
            )
            same = reference == tokens
            totals["identical"] += same
            totals["hf_tokens"] += len(reference)
            totals["hf_seconds"] += hf_seconds
            verdict = "identical tokens" if same else f"DIFFERENT tokens from {first_divergence(tokens, reference)} on"
            hf_tps = len(reference) / hf_seconds
            speedup = len(tokens) / seconds / hf_tps
            print(f"HF greedy generate: {verdict} | {hf_tps:.1f} tokens/s | speedup {speedup:.2f}x")
        print()

    t = totals
    tps = t["tokens"] / t["seconds"]
    tpf = t["tokens"] / max(t["forwards"], 1)
    summary = f"total: {t['tokens']} tokens in {t['seconds']:.1f} s ({tps:.1f} tokens/s), TPF {tpf:.2f}"
    if args.compare:
        hf_tps = t["hf_tokens"] / t["hf_seconds"]
        summary += f"; vs HF greedy: {t['identical']}/{len(prompts)} identical, speedup {tps / hf_tps:.2f}x"
    print(summary)
    mode = faster_linear(model, config.linear) if args.device == "cpu" else None  # decided already: measures nothing
    if mode is not None and mode.record is not None:
        ways = Counter(mode.choices.values())
        print(
            "linear layers: "
            + ", ".join(f"{way} for {count}" for way, count in sorted(ways.items()))
            + f" of {len(mode.choices)} product shapes, as recorded in {mode.record.path}"
        )
    if config.method != "ar" and not config.lookup_tokens and tpf < 1.5:
        print(
            "(TPF near 1: the model accepts about one draft token per forward, as an untrained model does; "
            "Jacobi Forcing training is what raises it)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
