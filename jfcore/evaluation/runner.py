"""Decoding and scoring benchmark problems with every model and method, side by side.

For each problem, every (model, method) pair decodes the same chat prompt back
to back, the order rotated from problem to problem, so a host slowing down or
speeding up hits every pair alike. Each completion is then scored, and each
method's tokens are compared with the same model's HF greedy tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jfcore.chat import encode_chat
from jfcore.decoding import DecodeConfig, special_tokens
from jfcore.decoding.reference import first_divergence
from jfcore.evaluation.benchmarks import Problem, Score
from jfcore.evaluation.config import REFERENCE, DecodingSettings, EvalModel
from jfcore.evaluation.methods import Method, Run, hf_method, project_method
from jfcore.jacobi_forcing_json import decoding_for, tuned_keys
from jfcore.machine import this_machine
from jfcore.models import load_model, model_fingerprint, resolve_checkpoint, tokenizer_fingerprint


@dataclass
class LoadedModel:
    model: object
    tokenizer: object
    methods: dict[str, Method]
    tuned: dict | None = None  # the tuned method's settings, when evaluated


def load_models(models: dict[str, EvalModel], settings: DecodingSettings, log=print) -> dict[str, LoadedModel]:
    loaded = {}
    for label, entry in models.items():
        model, tokenizer = load_model(entry.model)
        eos, pad = special_tokens(model, None, tokenizer.pad_token_id)
        methods, tuned = {}, None
        for name in settings.methods:
            if name == REFERENCE:
                methods[name] = hf_method(model, eos, pad)
            elif name == "hf_prompt_lookup":
                methods[name] = hf_method(model, eos, pad, prompt_lookup_num_tokens=settings.prompt_lookup_tokens)
            elif name == "tuned":
                tuned = tuned_keys(tuned_config(entry, model, lambda line, label=label: log(f"{label}: {line}")))
                methods[name] = project_method(model, eos, pad, **tuned)
            else:
                methods[name] = project_method(model, eos, pad, **settings.decode_config(name))
        loaded[label] = LoadedModel(model, tokenizer, methods, tuned)
    return loaded


def tuned_config(entry: EvalModel, model, log=print) -> DecodeConfig:
    """The model's tuned decoding on this machine at batch 1 (evaluation decodes one problem at a time)."""
    checkpoint = resolve_checkpoint(entry.model)
    machine = this_machine(next(model.parameters()).device, model.dtype)
    return decoding_for(checkpoint if Path(checkpoint).is_dir() else None, machine, 1, log=log)


def fingerprints(models: dict[str, LoadedModel]) -> dict[str, dict[str, str]]:
    return {
        label: {"model": model_fingerprint(m.model), "tokenizer": tokenizer_fingerprint(m.tokenizer)}
        for label, m in models.items()
    }


class Evaluator:
    """Holds the loaded models; turns problems into scored sample rows."""

    def __init__(self, models: dict[str, LoadedModel], settings: DecodingSettings, isolated: bool = True):
        self.models = models
        self.settings = settings
        self.isolated = isolated  # False: programs run without operating-system isolation (the unsafe flag)
        self.pairs = [(label, method) for label in models for method in settings.methods]
        self.warm = settings.warmup_tokens == 0
        self.tuned = {label: m.tuned for label, m in models.items()}

    def run(self, problems: Sequence[Problem], offset: int = 0) -> list[dict]:
        """Sample rows for `problems`; `offset` (their index in the whole run) sets the rotation of the order."""
        if not self.warm and problems:
            self._warm_up(problems[0])
        rows = []
        for i, problem in enumerate(problems):
            turn = (offset + i) % len(self.pairs)
            order = self.pairs[turn:] + self.pairs[:turn]
            prompts = {label: encode_chat(m.tokenizer, problem.prompt) for label, m in self.models.items()}
            runs = {pair: self._decode(pair, prompts) for pair in order}
            later = [self._later_round(r, order, prompts, runs) for r in range(1, self.settings.timing_rounds)]
            rows += self._rows(problem, prompts, runs, later)
        return rows

    def _decode(self, pair: tuple[str, str], prompts: dict) -> Run:
        label, method = pair
        return self.models[label].methods[method]([prompts[label]], self.settings.max_new_tokens)

    def _later_round(self, r: int, order: list, prompts: dict, first: dict) -> dict:
        """Round `r`: the timed methods decode the problem again, their order rotated by r; {pair: (seconds, same
        tokens as the first round)}."""
        timed = [(label, method) for label, method in order if method in self.settings.timed_methods]
        timed = timed[r % len(timed) :] + timed[: r % len(timed)]
        runs = {pair: self._decode(pair, prompts) for pair in timed}
        return {pair: (run.seconds, run.sequences == first[pair].sequences) for pair, run in runs.items()}

    def _warm_up(self, problem: Problem) -> None:
        # One-off costs (allocator growth, lazy initialisation) stay out of the timings.
        for label, method in self.pairs:
            model = self.models[label]
            model.methods[method]([encode_chat(model.tokenizer, problem.prompt)], self.settings.warmup_tokens)
        self.warm = True

    def _rows(self, problem: Problem, prompts: dict, runs: dict, later: list[dict]) -> list[dict]:
        scores: dict[str, Score] = {}  # identical completions are scored once
        rows = []
        for label, method in self.pairs:
            run, tokenizer = runs[label, method], self.models[label].tokenizer
            tokens, reference = run.sequences[0], runs[label, REFERENCE].sequences[0]
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            if text not in scores:
                scores[text] = problem.score(text, self.isolated)
            score = scores[text]
            rows.append(
                {
                    "benchmark": problem.benchmark,
                    "problem_id": problem.id,
                    "model": label,
                    "method": method,
                    "prompt_tokens": len(prompts[label]),
                    "new_tokens": len(tokens),
                    "decode_forwards": run.decode_forwards,
                    "prefill_seconds": run.prefill_seconds,
                    "decode_seconds": run.decode_seconds,
                    "forward_seconds": run.forward_seconds,
                    "tpf": len(tokens) / max(run.decode_forwards, 1),
                    "tokens": tokens,
                    "completion": text,
                    # seconds (prefill + decode) of every timing round; a round that decoded other tokens
                    # makes the sample inexact: the method's output was not reproducible
                    "round_seconds": [run.seconds] + [r[label, method][0] for r in later if (label, method) in r],
                    "exact": tokens == reference and all(r[label, method][1] for r in later if (label, method) in r),
                    "first_divergence": first_divergence(tokens, reference),
                    "correct": score.correct,
                    "verdict": score.verdict,
                    "detail": score.detail[:500],
                }
            )
        return rows
