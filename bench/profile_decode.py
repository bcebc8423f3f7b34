"""Where one decode's time goes: `torch.profiler` over one `decode` call, top entries by self CPU time.

    python -m bench.profile_decode                                  # SmolLM2-135M, 8 GSM8K prompts, Jacobi n16, 64 tokens
    python -m bench.profile_decode --method ar --batch 64 --short-forward   # the step_overhead model: host work shows
    python -m bench.profile_decode --method ar --lookup-tokens 2 --batch 1 --linear torch   # torch's linear kernels

Prints the table and writes it (with the decode's own statistics) as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from bench.common import RESULTS
from jfcore.chat import encode_chat
from jfcore.decoding import DecodeConfig, decode, special_tokens
from jfcore.decoding.config import LINEAR_MODES
from jfcore.models import ModelConfig, load_model
from jfcore.paths import eval_prompts


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=ModelConfig().name_or_path)
    p.add_argument("--short-forward", action="store_true", help="the 2-layer random model of bench.step_overhead")
    p.add_argument("--method", default="jacobi", choices=["ar", "jacobi", "multiblock"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--linear", default=DecodeConfig.linear, choices=LINEAR_MODES, help="DecodeConfig.linear")
    p.add_argument("--lookup-tokens", type=int, default=0, help="DecodeConfig.lookup_tokens (3-gram match)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--label", default="run")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.short_forward:
        from bench.common import prompts_for, short_forward_model

        model = short_forward_model()
        prompts = prompts_for(args.batch, model.config.vocab_size, args.batch)
        eos, pad = [], 0
    else:
        model, tokenizer = load_model(ModelConfig(name_or_path=args.model))
        prompts = [encode_chat(tokenizer, q) for q in eval_prompts("gsm8k", limit=args.batch)]
        eos, pad = special_tokens(model, None, tokenizer.pad_token_id)
    config = DecodeConfig(
        method=args.method,
        block_size=args.block_size,
        max_new_tokens=args.max_new_tokens,
        linear=args.linear,
        lookup_tokens=args.lookup_tokens,
        lookup_ngram=3,
    )
    decode(model, prompts[:2], replace(config, max_new_tokens=4), eos_token_id=eos, pad_token_id=pad)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = decode(model, prompts, config, eos_token_id=eos, pad_token_id=pad)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
    print(table)
    s = out.stats
    print(
        f"{s.new_tokens} tokens, {s.forward_calls} forwards, decode {s.decode_seconds:.2f} s "
        f"(inside forwards {s.forward_seconds:.2f} s), TPF {s.tpf:.2f}"
    )
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    rows = [{"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in top]
    out_path = args.out or RESULTS / f"profile-{args.label}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(
        json.dumps({"settings": vars(args) | {"out": None}, "stats": s.as_dict(), "top": rows}, indent=2)
    )
    print(f"wrote {out_path}")
    return out_path


if __name__ == "__main__":
    main()
