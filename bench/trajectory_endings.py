"""Do the trajectories show the model how an answer ends? Per prompt of a trajectory store, the fixed points laid end
to end are the base model's greedy answer (docs/DESIGN.md, section 3). This counts the answers that end (reach EOS
within the store's token budget), that hold a code fence, and that close a code block and then end: the step a short
code answer takes, and the one where trained models went into a newline after a newline instead
(bench/published/repeat-only-cpu-2026-12-06). It also gives the share of newline tokens among the fixed points and
among the drafts' wrong tokens, which is what the student sees in the noisy blocks, and the answers that end in a
loop (a short one, or a line written again and again) with the share of tokens those loops hold: what an on-policy
round trains back in unless packing cuts it (packing.cut_loops, packing.loop_period).

    python -m bench.trajectory_endings runs/ablation/trajectories/<key> --tokenizer smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import pyarrow.parquet as pq

from jfcore.evaluation.repetition import LINE_PERIOD, short_loop_start

FENCE = "```"


def answer_endings(rows: Iterable[dict], eos: int, decode: Callable[[list[int]], str]) -> dict:
    """`rows`: trajectory rows (prompt_id, block_index, states, fixed_point). Counts per prompt and token shares."""
    blocks = defaultdict(list)
    for row in rows:
        blocks[row["prompt_id"]].append(row)
    newline: dict[int, bool] = {}

    def is_newline(token: int) -> bool:
        if token not in newline:
            text = decode([token])
            newline[token] = "\n" in text and not text.strip()
        return newline[token]

    ended = fenced = closed_then_ended = short_loops = loops = loop_tokens = answer_tokens = 0
    fixed_tokens = fixed_newlines = wrong_tokens = wrong_newlines = 0
    for prompt_blocks in blocks.values():
        prompt_blocks.sort(key=lambda r: r["block_index"])
        answer = [t for r in prompt_blocks for t in r["fixed_point"]]
        text = decode(answer[: answer.index(eos)] if eos in answer else answer)
        ended += eos in answer
        fenced += FENCE in text
        closed_then_ended += eos in answer and text.rstrip().endswith(FENCE)
        short_loops += short_loop_start(answer) is not None
        loop = short_loop_start(answer, LINE_PERIOD)
        loops += loop is not None
        loop_tokens += 0 if loop is None else len(answer) - loop
        answer_tokens += len(answer)
        for r in prompt_blocks:
            fixed_tokens += len(r["fixed_point"])
            fixed_newlines += sum(map(is_newline, r["fixed_point"]))
            for state in r["states"][:-1]:
                wrong = [a for a, b in zip(state, r["fixed_point"], strict=False) if a != b]
                wrong_tokens += len(wrong)
                wrong_newlines += sum(map(is_newline, wrong))
    return {
        "prompts": len(blocks),
        "ended": ended,
        "with_code_fence": fenced,
        "closed_code_block_then_ended": closed_then_ended,
        "short_loop_ends": short_loops,
        "loop_ends": loops,  # any period up to LINE_PERIOD, short loops included
        "loop_token_share": loop_tokens / max(answer_tokens, 1),
        "newline_share_fixed_points": fixed_newlines / max(fixed_tokens, 1),
        "newline_share_wrong_draft_tokens": wrong_newlines / max(wrong_tokens, 1),
    }


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from jfcore.models import ModelConfig, resolve_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", type=Path, help="a trajectory store folder (shard-*.parquet)")
    parser.add_argument("--tokenizer", default="smollm2-135m-instruct", help="the model the store was decoded with")
    parser.add_argument("--out", type=Path, default=Path("bench/results/trajectory_endings.json"))
    args = parser.parse_args(argv)
    shards = sorted(args.store.glob("shard-*.parquet"))
    if not shards:
        raise SystemExit(f"{args.store}: no shard-*.parquet here; pass a folder under <work_dir>/trajectories/")
    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(ModelConfig(name_or_path=args.tokenizer)))
    columns = ["prompt_id", "block_index", "states", "fixed_point"]
    rows = (row for shard in shards for row in pq.read_table(shard, columns=columns).to_pylist())
    figures = answer_endings(rows, tokenizer.eos_token_id, tokenizer.decode)
    print(json.dumps(figures, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"store": str(args.store), **figures}, indent=1) + "\n")


if __name__ == "__main__":
    main()
