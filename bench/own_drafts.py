"""A model's own drafts: tokens per forward of each draft family with prompt lookup off (unless asked for), in
float32, on test problems no training prompt comes from (the first `--limit` of GSM8K and of HumanEval), every output
checked token for token against the same model's AR. Counts forwards only, so it needs no quiet machine.

    python -m bench.own_drafts smollm2-135m-instruct runs/ablation/training/<key>/final \\
        --drafts jacobi:4 rolling:4 jacobi:8 rolling:8 multiblock:8 rolling:4inL3 --limit 8 --max-new-tokens 64

A suffix adds prompt lookup of k copied tokens, written as the tuner writes it: `+Lk` verifies them in positions of
their own, `inLk` in place of the draft's unverified guesses. Two models' TPF at the same setting is the ratio of
their speeds there, since a forward costs both the same.

Writes bench/results/own_drafts.json (or --out) and prints one row per model: pooled TPF (new tokens / decode
forwards over all prompts) per draft family and block size, and the same before loops: where a model's answer ends in
a short loop (jfcore/evaluation/repetition.py), a loop that drafts itself, that answer counts only up to the loop's
first token (decoded again with that budget), so the figure is what the drafts do on the text itself.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from bench.common import RESULTS
from jfcore.chat import encode_chat
from jfcore.decoding import DecodeConfig, decode
from jfcore.evaluation.repetition import short_loop_start
from jfcore.models import ModelConfig, load_model
from jfcore.paths import eval_prompts

SETS = ("gsm8k", "humaneval")
SPEC = re.compile(r"(jacobi|rolling|multiblock):(\d+)(?:(\+|in)L(\d+))?")


def draft_config(spec: str, max_new_tokens: int) -> DecodeConfig:
    """A spec such as "jacobi:8", "rolling:4", "multiblock:8", "rolling:4inL3" or "rolling:2+L2" -> its DecodeConfig
    (prompt lookup off unless asked for, the defaults otherwise)."""
    found = SPEC.fullmatch(spec)
    if not found:
        raise SystemExit(f"--drafts: {spec!r} is not FAMILY:N[+Lk|inLk] with FAMILY jacobi, rolling or multiblock")
    family, size, where, lookup = found.groups()
    return DecodeConfig(
        method="jacobi" if family == "rolling" else family,
        block_size=int(size),
        rolling=family == "rolling",
        max_new_tokens=max_new_tokens,
        lookup_tokens=int(lookup or 0),
        lookup_within=where == "in",
    )


def measure(checkpoint: str, drafts: list[str], limit: int, max_new_tokens: int) -> dict:
    model, tokenizer = load_model(ModelConfig(name_or_path=checkpoint, dtype="float32"))
    prompts = [encode_chat(tokenizer, text) for name in SETS for text in eval_prompts(name, limit)]
    reference = [decode(model, [p], DecodeConfig(method="ar", max_new_tokens=max_new_tokens)) for p in prompts]
    loops = [short_loop_start(ref.sequences[0]) for ref in reference]
    row = {"model": checkpoint, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "drafts": {}}
    row["loop_ends"] = sum(start is not None for start in loops)
    for spec in drafts:
        config = draft_config(spec, max_new_tokens)
        tokens = forwards = exact = checked = 0
        before_tokens = before_forwards = 0  # the same, each answer cut at its loop's start
        for prompt, ref, loop in zip(prompts, reference, loops, strict=True):
            out = decode(model, [prompt], config)
            tokens += out.stats.new_tokens
            forwards += out.stats.decode_forwards
            exact += out.sequences[0] == ref.sequences[0]
            checked += 1
            if loop:  # text before the loop: decoded again up to it
                out = decode(model, [prompt], draft_config(spec, loop))
                exact += out.sequences[0] == ref.sequences[0][:loop]
                checked += 1
            if loop != 0:  # an answer that is all loop has no text before it
                before_tokens += out.stats.new_tokens
                before_forwards += out.stats.decode_forwards
        tpf, before = tokens / max(forwards, 1), before_tokens / max(before_forwards, 1)
        row["drafts"][spec] = {
            "tpf": tpf,
            "tpf_before_loops": before,
            "tokens": tokens,
            "tokens_before_loops": before_tokens,
            "exact": exact,
            "checked": checked,
        }
        print(f"{checkpoint} {spec}: TPF {tpf:.3f} ({before:.3f} before loops), {exact}/{checked} equal to its AR")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="presets or checkpoint folders")
    p.add_argument("--drafts", nargs="+", default=["jacobi:4", "rolling:4", "jacobi:8", "rolling:8", "multiblock:8"])
    p.add_argument("--limit", type=int, default=8, help="problems per set (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=RESULTS / "own_drafts.json")
    args = p.parse_args()
    for spec in args.drafts:
        draft_config(spec, 1)  # refuse a bad spec before any model loads
    rows = [measure(m, args.drafts, args.limit, args.max_new_tokens) for m in args.models]
    print("\n| model | loop ends | " + " | ".join(args.drafts) + " |\n|---|---:|" + "---:|" * len(args.drafts))
    for row in rows:
        cells = " | ".join(
            f"{row['drafts'][s]['tpf']:.3f} ({row['drafts'][s]['tpf_before_loops']:.3f})" for s in args.drafts
        )
        print(f"| {row['model']} | {row['loop_ends']}/{row['prompts']} | {cells} |")
    print("(TPF before loops in brackets: answers that end in a short loop cut at its start)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
