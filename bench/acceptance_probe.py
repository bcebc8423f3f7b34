"""Does what training taught carry to prompts it never saw? The training stage's acceptance figures (noisy
accuracy, simulated Jacobi TPF; docs/TRAINING.md, "Acceptance during training") for checkpoints on prompts
they were trained on beside the held-out ones.

    python -m bench.acceptance_probe runs/ablation/packing/<key> smollm2-135m-instruct \\
        runs/ablation/training/<key>/final --prompts 16

High on trained prompts and low on held-out ones: the model memorised, and more (or more varied) data is what
it lacks. Low on both: it has not learnt the skill yet (training time, or capacity). `--block-sizes` with no value
skips the simulation (minutes per model on 2 cores) and keeps noisy accuracy, split by whether prompt lookup would
copy the token (seconds). Writes bench/results/acceptance_probe.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jfcore.contracts import HELDOUT
from jfcore.environment import usable_cores
from jfcore.models import ModelConfig, load_model, tokenizer_fingerprint
from jfcore.training import acceptance
from jfcore.training.data import PackedData


def probe(checkpoint: str, packed: Path, prompts: int, block_sizes: list[int], tokens: int) -> dict:
    model, tokenizer = load_model(ModelConfig(name_or_path=checkpoint, dtype="float32"))
    out = {}
    for split, folder in (("trained", packed), ("heldout", packed / HELDOUT)):
        data = PackedData(folder, tokenizer_fingerprint(tokenizer))
        # Every k-th row, so the trained slice spans the data as the held-out one does.
        rows = data.take(list(range(0, len(data), max(len(data) // prompts, 1)))[:prompts])
        began = time.perf_counter()
        figures = acceptance.measure(
            model, rows, block_sizes, tokens, tokenizer.pad_token_id, tokenizer.eos_token_id, "sdpa"
        )
        out[split] = {k.removeprefix("heldout/"): v for k, v in figures.metrics().items()}
        print(f"{checkpoint} on {len(rows)} {split} prompts ({time.perf_counter() - began:.0f} s): {figures.summary()}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("packed", type=Path, help="a packing output folder with a heldout/ split")
    parser.add_argument("checkpoints", nargs="+", help="model folders or embedded names")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument(
        "--block-sizes", type=int, nargs="*", default=[4, 8], help="simulated TPF's; none: noisy accuracy alone"
    )
    parser.add_argument("--tokens", type=int, default=64, help="response tokens simulated per prompt")
    parser.add_argument("--out", type=Path, default=Path("bench/results/acceptance_probe.json"))
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(usable_cores())
    results = {c: probe(c, args.packed, args.prompts, args.block_sizes, args.tokens) for c in args.checkpoints}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"packed": str(args.packed), "prompts": args.prompts, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
