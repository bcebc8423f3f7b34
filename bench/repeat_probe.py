"""Does a model lean toward short loops where the text goes on? Each model reads the base model's own greedy answers
from an evaluation report (teacher-forced, float32), and at every answer token we take the repeat penalty's measure
(training.repeat_unlikelihood): -log(1 - p(C)), C the last `REPEAT_WINDOW` tokens up to the position other than the
text's next one. The base model scores its own text low; a model that ends answers in a newline after a newline
scores it higher, most on prompts unlike its training ones.

    python -m bench.repeat_probe runs/ablation/evaluation/<run key>/report \
        base=smollm2-135m-instruct trained=runs/ablation/training/<key>/final
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import torch

from jfcore.chat import encode_chat
from jfcore.evaluation.benchmarks import BenchmarkConfig, load_benchmark
from jfcore.models import ModelConfig, load_model
from jfcore.training.batch import REPEAT_WINDOW, recent_tokens


def repeat_measures(logp: torch.Tensor, ids: list[int], start: int) -> list[float]:
    """-log(1 - p(C)) at each position from `start` (the prompt's last token) that predicts a token of `ids`;
    `logp` holds log-probabilities over the vocabulary at every position of `ids`. Positions with an empty C are
    left out, as the training term leaves them out."""
    out = []
    for i in range(start, len(ids) - 1):
        recent = recent_tokens(ids, i)
        if recent:
            p = logp[i, recent].exp().sum()
            out.append(-torch.log1p(-p.clamp(max=1 - 1e-7)).item())
    return out


@torch.no_grad()
def probe(model, tokenizer, answers: list[tuple[str, list[int]]]) -> float:
    """The mean measure over (prompt text, answer tokens) pairs."""
    values = []
    for prompt_text, answer in answers:
        prompt = encode_chat(tokenizer, prompt_text)
        ids = prompt + answer
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        values += repeat_measures(logp, ids, len(prompt) - 1)
    return sum(values) / max(len(values), 1)


def report_answers(report: Path, data_dir: str | None) -> dict[str, dict[str, list[tuple[str, list[int]]]]]:
    """Each model's HF greedy answers in an evaluation report with their prompts: model -> benchmark -> pairs."""
    rows = pq.read_table(report / "samples.parquet").to_pylist()
    prompts = {}
    for name in {r["benchmark"] for r in rows}:
        prompts.update({p.id: p.prompt for p in load_benchmark(BenchmarkConfig(name=name, limit=None), data_dir)})
    answers: dict = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["method"] == "hf_greedy":
            answers[r["model"]][r["benchmark"]].append((prompts[r["problem_id"]], list(r["tokens"])))
    return {model: dict(by_bench) for model, by_bench in answers.items()}


def base_answers(report: Path, data_dir: str | None) -> dict[str, list[tuple[str, list[int]]]]:
    """The report's base model's greedy answers with their prompts, by benchmark."""
    answers = report_answers(report, data_dir)
    return answers[min(answers, key=lambda m: m != "base")]  # "base" where the report has one


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="an evaluation report folder (with samples.parquet)")
    parser.add_argument("models", nargs="+", help="NAME=MODEL: a preset, a hub id or a checkpoint folder")
    parser.add_argument("--data-dir", default=None, help="where the benchmark files are (default: the usual search)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/repeat_probe.json"))
    args = parser.parse_args(argv)
    answers = base_answers(args.report, args.data_dir)
    results: dict[str, dict[str, float]] = {}
    print("| model | " + " | ".join(answers) + " |")
    print("|---|" + "---:|" * len(answers))
    for spec in args.models:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"{spec!r}: write NAME=MODEL, e.g. base=smollm2-135m-instruct")
        model, tokenizer = load_model(ModelConfig(name_or_path=path))
        results[name] = {bench: probe(model, tokenizer, pairs) for bench, pairs in answers.items()}
        print(f"| {name} | " + " | ".join(f"{v:.4f}" for v in results[name].values()) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"report": str(args.report), "window": REPEAT_WINDOW, "measure": results}, indent=1))


if __name__ == "__main__":
    main()
