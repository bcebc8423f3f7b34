"""Is a trained model's text still text? The base model reads each model's greedy answers in an evaluation report
(teacher-forced, float32) and gives, per model and benchmark, its mean negative log-likelihood per answer token and
the share of answer tokens that are its own argmax, over whole answers and over the text before any short loop they
end in (jfcore/evaluation/repetition.py). The 4-gram share misses text that skips or garbles words without repeating
them, and accuracy misses it where the base model solves nothing; a model whose drafts were bought by drifting
scores worse here than the base model on its own answers (whose agreement is 1 by construction).

    python -m bench.base_judge runs/ablation/evaluation/<run key>/report --base smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.repeat_probe import report_answers
from jfcore.chat import encode_chat
from jfcore.evaluation.repetition import short_loop_start
from jfcore.models import ModelConfig, load_model


def judge_tokens(logp: torch.Tensor, answer: list[int]) -> tuple[list[float], list[bool]]:
    """Per answer token: the judge's negative log-likelihood and whether it is the judge's argmax. `logp` holds the
    judge's log-probabilities at the positions that predict each answer token, one row per token."""
    target = torch.tensor(answer)
    nll = -logp.gather(1, target[:, None])[:, 0]
    return nll.tolist(), (logp.argmax(-1) == target).tolist()


@torch.no_grad()
def judge(model, tokenizer, pairs: list[tuple[str, list[int]]]) -> dict[str, float]:
    whole_nll, whole_top, before_nll, before_top = [], [], [], []
    for prompt_text, answer in pairs:
        prompt = encode_chat(tokenizer, prompt_text)
        logits = model(input_ids=torch.tensor([prompt + answer])).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(answer) - 1], -1)
        nll, top = judge_tokens(logp, answer)
        cut = short_loop_start(answer)
        cut = len(answer) if cut is None else cut
        whole_nll += nll
        whole_top += top
        before_nll += nll[:cut]
        before_top += top[:cut]

    def mean(values: list) -> float:
        return sum(values) / max(len(values), 1)

    return {
        "nll": mean(whole_nll),
        "argmax_share": mean(whole_top),
        "nll_before_loops": mean(before_nll),
        "argmax_share_before_loops": mean(before_top),
        "tokens": len(whole_nll),
        "tokens_before_loops": len(before_nll),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="an evaluation report folder (with samples.parquet)")
    parser.add_argument("--base", default="smollm2-135m-instruct", help="the judge: a preset or checkpoint folder")
    parser.add_argument("--data-dir", default=None, help="where the benchmark files are (default: the usual search)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/base_judge.json"))
    args = parser.parse_args(argv)
    answers = report_answers(args.report, args.data_dir)
    model, tokenizer = load_model(ModelConfig(name_or_path=args.base, dtype="float32"))
    results = {
        name: {b: judge(model, tokenizer, pairs) for b, pairs in sorted(by.items())} for name, by in answers.items()
    }
    print("| model | benchmark | NLL per token | base argmax | NLL before loops | base argmax before loops |")
    print("|---|---|---:|---:|---:|---:|")
    for name, by in results.items():
        for bench, f in by.items():
            print(
                f"| {name} | {bench} | {f['nll']:.3f} | {f['argmax_share']:.3f} | {f['nll_before_loops']:.3f} | "
                f"{f['argmax_share_before_loops']:.3f} |"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"report": str(args.report), "judge": args.base, "figures": results}, indent=1))


if __name__ == "__main__":
    main()
