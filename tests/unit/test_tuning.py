"""The tuner: its predictions, what it records in a model's jacobi_forcing.json, and every bad input it refuses."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cli.tune import main as jf_tune
from jfcore import machine as engine_identity
from jfcore.config import ConfigError
from jfcore.decoding import DecodeConfig, decode
from jfcore.evaluation.benchmarks import BenchmarkConfig
from jfcore.jacobi_forcing_json import TunedBucket, TunedDecoding, decoding_for, tuned_decoding, write_tuned
from jfcore.machine import this_engine, this_machine
from jfcore.tuning.acceptance import greedy_pass, record_drafts
from jfcore.tuning.cost import CostCurve, measure_curve
from jfcore.tuning.predict import predict
from jfcore.tuning.split import TuningSet, check_disjoint, load_split
from jfcore.tuning.tuner import TuneConfig, grid
from tests.support.tiny_models import save_tiny_checkpoint, tiny_model

PROMPTS = [[40, 41, 40, 41, 40], [5, 6, 7, 8], [1, 2, 3], [9, 9, 30, 31, 9]]


def test_cost_curve_interpolates_and_extends_linearly():
    curve = CostCurve(1, 16, (1, 2, 4), (1.0, 1.5, 2.5))
    assert curve.t(1) == 1.0 and curve.t(3) == 2.0 and curve.t(6) == 3.5
    assert curve.ratio(2) == 1.5
    with pytest.raises(ValueError, match="start at 1"):
        CostCurve(1, 16, (2, 4), (1.0, 2.0))


def test_measured_curve_times_every_width():
    curve = measure_curve(tiny_model("llama"), batch_size=2, widths=(1, 4, 8), context=12, rounds=2)
    assert curve.widths == (1, 4, 8) and all(t > 0 for t in curve.seconds)


@pytest.fixture(scope="module")
def acceptance():
    m, quiet = tiny_model("qwen3"), {"batch_size": 3, "host_probe_tokens": 6, "log": lambda _: None}
    acceptance = greedy_pass(m, PROMPTS, [], 0, 40, **quiet)
    for config in (
        DecodeConfig(method="jacobi", block_size=8),
        DecodeConfig(method="multiblock", block_size=8, num_blocks=2),
    ):
        acceptance.drafts[config.method] = record_drafts(m, PROMPTS, config, [], 0, 40, **quiet)
    return m, acceptance


def test_predicted_tpf_of_prompt_lookup_is_the_decoders_own(acceptance):
    """With no draft of its own (n = 1) a row's forwards are replayed exactly, so the predicted TPF is the TPF the
    decoder then measures on the same prompts."""
    m, acc = acceptance
    curve = CostCurve(1, 16, (1, 2, 64), (1.0, 1.0, 1.0))
    assert acc.greedy == decode(m, PROMPTS, DecodeConfig(method="ar", max_new_tokens=40), eos_token_id=[]).sequences
    for tokens, ngram in [(4, 1), (10, 3)]:
        config = DecodeConfig(method="ar", block_size=1, lookup_tokens=tokens, lookup_ngram=ngram)
        run = decode(m, PROMPTS, replace(config, max_new_tokens=40), eos_token_id=[])
        assert predict(config, acc, curve, 0.0).tpf == pytest.approx(run.stats.tpf)
    ar = predict(DecodeConfig(method="ar"), acc, curve, acc.ar_host_seconds)
    ar_run = decode(m, PROMPTS, DecodeConfig(method="ar", max_new_tokens=40), eos_token_id=[])
    assert ar.speedup == pytest.approx(1.0) and ar.tpf == pytest.approx(ar_run.stats.tpf)  # 40 tokens, 39 forwards


def test_wider_forwards_cost_what_the_curve_says(acceptance):
    """The same acceptance on a curve where width is free and on one where it is dear: only the time changes."""
    _, acc = acceptance
    config = DecodeConfig(method="jacobi", block_size=8, lookup_tokens=6)
    free = predict(config, acc, CostCurve(1, 16, (1, 64), (1.0, 1.0)), 0.0)
    dear = predict(config, acc, CostCurve(1, 16, (1, 64), (1.0, 64.0)), 0.0)
    assert free.tpf == pytest.approx(dear.tpf)
    assert free.speedup > 1 > dear.speedup
    assert free.mean_width > 8


def test_rolling_windows_are_on_the_grid_and_predicted_from_their_own_drafts(acceptance):
    """Each Jacobi point of the grid comes fixed and rolling, and a rolling point draws its runs from the rolling
    record: drafts that commit more give it the higher TPF at the same width."""
    _, acc = acceptance
    points = grid(TuneConfig(block_sizes=(1, 4), lookup_tokens=(0, 2)), record_n=8)
    assert {(c.rolling, c.lookup_tokens, c.lookup_within) for c in points if c.method == "jacobi"} == {
        (r, t, w) for r in (False, True) for t, w in ((0, False), (2, False), (2, True))
    }
    assert not any(c.rolling for c in grid(TuneConfig(block_sizes=(1, 4), rolling=False), record_n=8))
    fixed = acc.drafts["jacobi"]
    acc = replace(acc, drafts={**acc.drafts, "rolling": replace(fixed, accepted=tuple(a + 1 for a in fixed.accepted))})
    curve = CostCurve(1, 16, (1, 64), (1.0, 1.0))
    at = {r: predict(DecodeConfig(method="jacobi", block_size=4, rolling=r), acc, curve, 0.0) for r in (False, True)}
    assert at[True].tpf > at[False].tpf and at[True].mean_width == at[False].mean_width == 4


def test_a_window_draws_its_runs_from_the_narrowest_record_at_least_as_wide(acceptance):
    """Rolling drafts recorded at n = 8 and n = 4: a window of 2, 3 or 4 is predicted from the n = 4 record, one of 6
    or 8 from the n = 8 record, a wider one from the widest; a family never recorded is an error naming it."""
    _, acc = acceptance
    fixed = acc.drafts["jacobi"]
    wide = replace(fixed, config=replace(fixed.config, rolling=True), accepted=(1,) * len(fixed.accepted))
    narrow = replace(fixed, config=replace(fixed.config, rolling=True, block_size=4), accepted=(3,) * 50)
    acc = replace(acc, drafts={**acc.drafts, "rolling": wide, "rolling@4": narrow})
    assert [acc.steps_for("rolling", n) for n in (2, 3, 4, 6, 8, 16)] == [narrow] * 3 + [wide] * 3
    curve = CostCurve(1, 16, (1, 64), (1.0, 1.0))
    tpf = {n: predict(DecodeConfig(method="jacobi", block_size=n, rolling=True), acc, curve, 0.0).tpf for n in (4, 8)}
    assert tpf[4] > 2.5 and tpf[8] < 1.2  # each from its own record: 3 tokens a forward against 1
    with pytest.raises(KeyError, match="no multiblock drafts were recorded"):
        replace(acc, drafts={"jacobi": fixed}).steps_for("multiblock", 8)


def _tuned(machine, lookup_tokens=6):
    decoding = DecodeConfig(method="ar", block_size=1, lookup_tokens=lookup_tokens, lookup_ngram=2)
    return TunedDecoding(
        machine=machine,
        engine=this_engine(DecodeConfig()),
        buckets=(TunedBucket(1, decoding, 1.4, 1.35), TunedBucket(8, DecodeConfig(method="ar"), 1.0, 1.0)),
    )


def test_the_tune_is_read_back_on_its_machine_and_only_there(tmp_path):
    (tmp_path / "jacobi_forcing.json").write_text(json.dumps({"block_size": 12, "steps": 3}))
    here = this_machine("cpu", "float32")
    write_tuned(tmp_path, _tuned(here))
    assert json.loads((tmp_path / "jacobi_forcing.json").read_text())["steps"] == 3  # training's record is kept
    assert tuned_decoding(tmp_path).buckets[0].decoding.lookup_tokens == 6

    lines = []
    config = decoding_for(tmp_path, here, 1, log=lines.append)
    assert (config.method, config.lookup_tokens, config.lookup_ngram, lines) == ("ar", 6, 2, [])
    assert decoding_for(tmp_path, here, 5, log=lines.append).lookup_tokens == 0  # the batch-8 bucket
    assert decoding_for(tmp_path, here, 64, log=lines.append).lookup_tokens == 0  # beyond: the largest bucket
    same = decoding_for(tmp_path, here, 1, {"method": "ar", "lookup_tokens": 3, "max_new_tokens": 9}, log=lines.append)
    assert (same.method, same.lookup_tokens, same.lookup_ngram, same.max_new_tokens) == ("ar", 3, 2, 9)
    other = decoding_for(tmp_path, here, 1, {"method": "jacobi"}, log=lines.append)  # not the tune's method
    assert (other.method, other.block_size, other.lookup_tokens) == ("jacobi", 12, 0)

    elsewhere = replace(here, cpu="another CPU", torch_threads=here.torch_threads + 1)
    fallback = decoding_for(tmp_path, elsewhere, 1, log=lines.append)
    assert (fallback.method, fallback.block_size, fallback.lookup_tokens) == ("jacobi", 12, 0)
    assert len(lines) == 1 and "another CPU" in lines[0] and "untuned default" in lines[0]


def test_a_tune_holds_only_for_the_decoder_and_kernels_that_measured_it(tmp_path, monkeypatch):
    """Applied under other linear or compile settings, measured by other decoder code, or recorded before tunes
    named their decoder: the untuned default, and a log line that says why."""
    (tmp_path / "jacobi_forcing.json").write_text(json.dumps({"block_size": 12}))
    here = this_machine("cpu", "float32")
    write_tuned(tmp_path, _tuned(here))
    lines = []
    assert decoding_for(tmp_path, here, 1, log=lines.append).lookup_tokens == 6 and not lines
    for explicit, why in (({"linear": "torch"}, "linear: 'auto' != 'torch'"), ({"compile": "off"}, "compile: ")):
        config = decoding_for(tmp_path, here, 1, explicit, log=lines.append)
        assert (config.method, config.block_size, config.lookup_tokens) == ("jacobi", 12, 0)
        assert "stale" in lines[-1] and why in lines[-1] and "jf-tune" in lines[-1]
    monkeypatch.setattr(engine_identity, "decoder_digest", lambda: "0123456789abcdef")
    assert decoding_for(tmp_path, here, 1, log=lines.append).lookup_tokens == 0
    assert "decoder: " in lines[-1] and "0123456789abcdef" in lines[-1]
    monkeypatch.undo()
    write_tuned(tmp_path, replace(_tuned(here), engine=None))  # a tune from before tunes named their engine
    assert decoding_for(tmp_path, here, 1, log=lines.append).lookup_tokens == 0
    assert "records no decoder identity" in lines[-1]


def test_an_unknown_key_in_the_tune_is_an_error_that_names_it(tmp_path):
    write_tuned(tmp_path, _tuned(this_machine("cpu", "float32")))
    data = json.loads((tmp_path / "jacobi_forcing.json").read_text())
    data["tuned"]["buckets"][0]["decoding"]["lookup_tokenz"] = 3
    (tmp_path / "jacobi_forcing.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="unknown key 'lookup_tokenz'"):
        decoding_for(tmp_path, this_machine("cpu", "float32"))
    data["tuned"]["buckets"][0]["decoding"].pop("lookup_tokenz")
    data["tuned"]["speed"] = 1
    (tmp_path / "jacobi_forcing.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="tuned: unknown key 'speed'"):
        tuned_decoding(tmp_path)


def test_a_split_that_overlaps_an_evaluation_benchmark_is_refused():
    split = load_split([TuningSet(path="eval/gsm8k_test.jsonl", ask="math", field="question", limit=2)])
    with pytest.raises(ConfigError, match="overlaps the evaluation benchmark 'gsm8k'"):
        check_disjoint(split, [BenchmarkConfig(name="humaneval"), BenchmarkConfig(name="gsm8k", limit=1)])
    default = load_split(
        [
            TuningSet(path="prompts/gsm8k_train.jsonl", ask="math"),
            TuningSet(path="prompts/mbpp_train.jsonl", ask="mbpp"),
        ]
    )
    check_disjoint(default, [BenchmarkConfig(name=name) for name in ("gsm8k", "mbpp", "humaneval", "math500")])


def test_jf_tune_writes_the_tune_into_the_checkpoint_and_reuses_it(tmp_path, capsys, monkeypatch):
    model = save_tiny_checkpoint(tmp_path / "model")
    (model / "jacobi_forcing.json").write_text(json.dumps({"block_size": 4, "steps": 1}))
    config = tmp_path / "tune.yaml"
    config.write_text(
        "max_new_tokens: 16\nblock_sizes: [1, 2, 4]\nlookup_tokens: [0, 2, 4]\nlookup_ngrams: [2]\nconfirm: 2\n"
        "confirm_prompts: 2\nwidths: [1, 2, 4, 8]\ncurve_rounds: 1\nsplit:\n"
        "  - {path: prompts/mbpp_train.jsonl, ask: mbpp, limit: 2}\n  - {path: prompts/gsm8k_train.jsonl, ask: math, limit: 2}\n"
    )
    args = ["--model", str(model), "--out", str(tmp_path / "out"), "--config", str(config)]
    assert jf_tune(args) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert first["reused"] is False
    tuned = tuned_decoding(model)
    assert not tuned.machine.differences(this_machine("cpu", "float32"))
    report = json.loads((tmp_path / "out" / tuned.report.split("/")[-1] / "tune.json").read_text())
    confirmed = report["buckets"][0]["confirmed"]
    assert confirmed[0]["config"] == "ar" and all(c["exact"] for c in confirmed)
    # Recorded at the trained n, and the rolling window at half of it too.
    assert set(report["acceptance"]["drafts"]) == {"jacobi", "rolling", "multiblock", "rolling@2"}
    assert report["acceptance"]["drafts"]["rolling@2"]["block_size"] == 2
    assert report["buckets"][0]["chosen"]["measured_speedup"] == max(c["measured_speedup"] for c in confirmed)
    assert jf_tune(args) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["reused"] is True
    assert report["engine"] == this_engine(DecodeConfig()).as_dict() == tuned.engine.as_dict()
    # The decoder's code changed: the tune is stale, said so, and measured again under the new identity.
    monkeypatch.setattr(engine_identity, "decoder_digest", lambda: "0123456789abcdef")
    assert jf_tune(args) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.splitlines()[-1])["reused"] is False
    assert "is stale (decoder: " in captured.out + captured.err
    assert tuned_decoding(model).engine.decoder == "0123456789abcdef"


def test_jf_tune_refuses_bad_input_with_a_message(tmp_path, capsys):
    model = save_tiny_checkpoint(tmp_path / "model")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: 2\n")
    assert jf_tune(["--model", str(model), "--config", str(bad)]) == 2
    assert "rounds: the median needs >= 3 rounds" in capsys.readouterr().err
    bad.write_text("split: [{path: eval/math500_test.jsonl, field: problem, ask: math}]\n")
    assert jf_tune(["--model", str(model), "--config", str(bad)]) == 2
    assert "overlaps the evaluation benchmark 'math500'" in capsys.readouterr().err
    assert jf_tune(["--model", str(tmp_path / "nothing-here")]) == 2
    assert "nothing-here" in capsys.readouterr().err


def test_a_model_without_a_tune_gets_the_untuned_default_and_one_line(tmp_path):
    lines = []
    (tmp_path / "jacobi_forcing.json").write_text(json.dumps({"block_size": 8}))
    config = decoding_for(tmp_path, this_machine("cpu", "float32"), 1, {"max_new_tokens": 5}, log=lines.append)
    assert (config.method, config.block_size, config.lookup_tokens, config.max_new_tokens) == ("jacobi", 8, 0, 5)
    assert len(lines) == 1 and "has no tune" in lines[0]
    assert decoding_for(None, None, log=lines.append).block_size == 16 and len(lines) == 1  # no model folder: quiet


def test_the_evaluation_worker_keeps_why_a_model_decodes_untuned(tmp_path):
    """Inside an evaluation worker a missing or stale tune falls back to the untuned default; the worker keeps the
    line for the driver's log (one run's log said nothing while its trained model's "tuned" rows decoded untuned)."""
    from tasks.evaluation import EvalWorker

    model = save_tiny_checkpoint(tmp_path / "model")
    models = {"trained": {"model": {"name_or_path": str(model)}}}
    worker = EvalWorker(models, {"methods": ["hf_greedy", "tuned"], "max_new_tokens": 8}, False, 1)
    notes = worker.loading_notes()
    assert len(notes) == 1 and notes[0].startswith("trained: ") and "has no tune" in notes[0]
    assert worker.tuned()["trained"]["method"] == "jacobi" and not worker.tuned()["trained"]["lookup_tokens"]
