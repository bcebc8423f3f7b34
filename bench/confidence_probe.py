"""How training changed a model on the text it was trained from: each model reads the held-out prompts with their
trajectories' responses (the starting model's greedy text) and we count, per response token, its top-1
probability, its entropy, the text's negative log-likelihood and how often its argmax is still the text's token.
It also asks whether a model copies from what it has read: at each token, prompt lookup's candidate (the token that
followed the latest earlier occurrence of the context's last 1-3 tokens) against the model's argmax and the text.

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
from jfcore.training.acceptance import examples
from jfcore.training.copies import lookup_candidates


@torch.no_grad()
def probe(model, rows: list[dict]) -> dict:
    top1 = entropy = nll = agree = count = 0.0
    with_candidate = argmax_copies = wrong_candidates = wrong_candidate_prob = wrong_off_text = 0.0
    departures = departures_copy = 0.0
    for prompt, response in ((e.prompt, e.response) for e in examples(rows)):
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1)
        target, argmax = torch.tensor(response), logp.argmax(-1)
        top1 += logp.max(-1).values.exp().sum().item()
        entropy += -(logp.exp() * logp).sum().item()
        nll += -logp[torch.arange(len(response)), target].sum().item()
        agree += (argmax == target).sum().item()
        count += len(response)
        candidate = torch.tensor(lookup_candidates(prompt, response))
        has = candidate >= 0
        wrong = has & (candidate != target)
        departed = argmax != target
        with_candidate += has.sum().item()
        argmax_copies += (has & (argmax == candidate)).sum().item()
        wrong_candidates += wrong.sum().item()
        at = wrong.nonzero()[:, 0]
        wrong_candidate_prob += logp[at, candidate[wrong]].exp().sum().item()
        wrong_off_text += (1 - logp[at, target[wrong]].exp()).sum().item()
        departures += departed.sum().item()
        departures_copy += (departed & has & (argmax == candidate)).sum().item()
    return {
        "tokens": int(count),
        "mean_top1_prob": top1 / count,
        "mean_entropy": entropy / count,
        "nll_of_the_text": nll / count,
        "argmax_is_the_text": agree / count,
        # Copying: over the tokens with a lookup candidate, how often the argmax is that candidate; where the
        # candidate is not the text's token, its mean probability and its share of the probability kept off the
        # text's token; and, of the tokens where the argmax left the text, the share that left it for the candidate.
        "tokens_with_a_lookup_candidate": int(with_candidate),
        "argmax_is_the_lookup": argmax_copies / max(with_candidate, 1),
        "wrong_lookup_prob": wrong_candidate_prob / max(wrong_candidates, 1),
        "wrong_lookup_share_of_error": wrong_candidate_prob / max(wrong_off_text, 1e-9),
        "departures": int(departures),
        "departures_to_the_lookup": departures_copy / departures if departures else None,
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
        print(label, json.dumps({k: v if v is None else round(v, 4) for k, v in results[label].items()}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"packing": str(args.packing), "models": args.models, **results}, indent=1))


if __name__ == "__main__":
    main()
