"""Does the consistency objective teach copying? For each consistency pair of a packed dataset, is the token the
noisy logit must predict already among the noisy tokens it sees in its own block? Against that, the same question
for the clean stream (is the next token of the model's own text among the block's tokens before it), which is the
repetition the text has anyway.

    python -m bench.copy_targets runs/ablation/packing/<key> --offsets 2

A target share well above the clean share means the objective rewards copying a visible token: a model that learns
it also copies its own earlier tokens when it decodes greedily, and its text repeats more
(bench/published/frozen-teacher-cpu-2026-12-05).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq

from jfcore.training.batch import clean_stream


def block_pairs(row: dict, max_offset: int | None):
    """(noisy tokens the student sees, clean tokens before the same position, target) for each consistency pair of
    a packed row, in the layout of jfcore.training.batch (offsets from the block's first mismatch; targets past the
    response's end dropped)."""
    ids, P, n = row["input_ids"], row["prompt_length"], row["block_size"]
    clean = clean_stream(row)[P:]
    seen = 0
    for j, (d, m) in enumerate(zip(row["first_mismatch"], row["valid_lengths"])):
        noisy = ids[P + 2 * j * n : P + 2 * j * n + m]
        stop = m if max_offset is None else min(m, d + max_offset)
        for t in range(d, stop):
            if seen + t + 1 < len(clean):
                yield noisy[: t + 1], clean[seen : seen + t + 1], clean[seen + t + 1]
        seen += m


def measure(folder: Path, max_offset: int | None) -> dict:
    pairs = in_noisy = same_as_input = in_clean = 0
    for shard in sorted(folder.glob("packed-*.parquet")):
        for row in pq.read_table(shard).to_pylist():
            for noisy, clean, target in block_pairs(row, max_offset):
                pairs += 1
                in_noisy += target in noisy
                same_as_input += target == noisy[-1]
                in_clean += target in clean
    return {
        "pairs": pairs,
        "target_in_visible_noisy_block": in_noisy / pairs,
        "target_equals_input_token": same_as_input / pairs,
        "next_clean_token_in_clean_block_before": in_clean / pairs,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("packing", type=Path, help="a packing output folder (packed-*.parquet)")
    parser.add_argument("--offsets", type=int, default=None, help="training.consistency_offsets (default: all)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/copy_targets.json"))
    args = parser.parse_args(argv)
    figures = measure(args.packing, args.offsets)
    print(json.dumps(figures, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"packing": str(args.packing), "offsets": args.offsets, **figures}, indent=1))


if __name__ == "__main__":
    main()
