"""How training changed a model on the text it was trained from: each model reads the held-out prompts with their
trajectories' responses (the starting model's greedy text) and we count, per response token, its top-1
probability, its entropy, the text's negative log-likelihood and how often its argmax is still the text's token.

    python -m bench.confidence_probe runs/ablation/packing/<key> \
        base=smollm2-135m-instruct trained=runs/ablation/training/<key>/final

A model sharper than its start (top-1 up, entropy down) loops more easily under greedy decoding; one that is not
sharper but whose argmax moved changed its text some other way (bench/published/frozen-teacher-cpu-2026-12-05).
The starting model's argmax agrees with its own fixed points on every token (float32).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq
import torch

from jfcore.contracts import HELDOUT
from jfcore.models import ModelConfig, load_model
from jfcore.training.batch import clean_stream


def prompt_and_response(row: dict) -> tuple[list[int], list[int]]:
    """A packed row's prompt and its fixed points' tokens, block after block: the clean stream training reads."""
    clean = clean_stream(row)
    return clean[: row["prompt_length"]], clean[row["prompt_length"] :]


@torch.no_grad()
def probe(model, rows: list[dict]) -> dict:
    top1 = entropy = nll = agree = count = 0.0
    for row in rows:
        prompt, response = prompt_and_response(row)
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1)
        target = torch.tensor(response)
        top1 += logp.max(-1).values.exp().sum().item()
        entropy += -(logp.exp() * logp).sum().item()
        nll += -logp[torch.arange(len(response)), target].sum().item()
        agree += (logp.argmax(-1) == target).sum().item()
        count += len(response)
    return {
        "tokens": int(count),
        "mean_top1_prob": top1 / count,
        "mean_entropy": entropy / count,
        "nll_of_the_text": nll / count,
        "argmax_is_the_text": agree / count,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("packing", type=Path, help="a packing output folder with a heldout/ folder")
    parser.add_argument("models", nargs="+", metavar="LABEL=PATH", help="models to read the text with")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts (the first by file order)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/confidence_probe.json"))
    args = parser.parse_args(argv)
    shards = sorted((args.packing / HELDOUT).glob("packed-*.parquet"))
    rows = [r for shard in shards for r in pq.read_table(shard).to_pylist()][: args.prompts]
    if not rows:
        raise SystemExit(f"{args.packing / HELDOUT} holds no packed rows: pack with packing.heldout_fraction > 0")
    results = {}
    for spec in args.models:
        label, _, path = spec.partition("=")
        model, _ = load_model(ModelConfig(name_or_path=path or label))
        results[label] = probe(model.eval(), rows)
        print(label, json.dumps({k: round(v, 4) for k, v in results[label].items()}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"packing": str(args.packing), "models": args.models, **results}, indent=1))


if __name__ == "__main__":
    main()
