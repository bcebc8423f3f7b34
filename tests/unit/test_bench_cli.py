"""The decoding benchmark (bench/decode_bench.py) and the jf-decode CLI, end to end on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from bench import decode_bench
from cli import decode as cli
from jfcore.decoding.reference import first_divergence
from tests.support.tiny_models import greedy_reference, save_tiny_checkpoint

PROJECT_METHODS = ("ar", "jacobi_n4", "jacobi_n8", "multiblock_n4")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A random 2-layer Llama with a word-level tokenizer (words w0..w124)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "toy.jsonl"
    path.write_text('{"q": "w1 w2 w3 w4 w5 w1 w2"}\n{"q": "w9 w8 w7 w9 w8"}\n')
    return path


def test_bench_writes_every_method_and_project_methods_are_exact(tiny, prompts_file, tmp_path):
    out = tmp_path / "bench.json"
    args = [
        "--model",
        str(tiny),
        "--prompts",
        str(prompts_file),
        "--field",
        "q",
        "--max-new-tokens",
        "12",
        "--block-sizes",
        "4,8",
        "--multiblock-size",
        "4",
        "--warmup-tokens",
        "2",
        "--out",
        str(out),
    ]
    assert decode_bench.main(args) == 0
    result = json.loads(out.read_text())

    agg = result["aggregates"]
    lengths = [n for b in result["batches"] for n in b["methods"]["hf_greedy"]["new_tokens"]]
    assert set(agg) == {"hf_greedy", *PROJECT_METHODS, "hf_prompt_lookup"} == set(result["methods"])
    for name in PROJECT_METHODS:
        assert agg[name]["exact"] == 1.0, name  # lossless in float32
        assert agg[name]["first_divergence_min"] == min(lengths)  # equal outputs diverge at their length
    assert agg["hf_greedy"]["speedup"] == pytest.approx(1.0) and agg["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    for name in agg:  # over the same model's AR: the same ratio of tokens/s, against another baseline
        assert agg[name]["speedup_vs_ar"] == pytest.approx(agg[name]["tps"] / agg["ar"]["tps"])
    # AR: the prefill gives the first token, then one token per forward.
    assert agg["ar"]["decode_forwards"] == agg["ar"]["new_tokens"] - agg["ar"]["prompts"]
    assert 1.0 < agg["ar"]["tpf"] < 1.2
    assert agg["hf_greedy"]["decode_forwards"] == agg["ar"]["decode_forwards"]
    assert len(result["batches"]) == 2 and result["environment"]["torch"] == torch.__version__
    assert result["settings"]["block_sizes"] == [4, 8]


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_cli_compare_reports_identical_tokens(tiny, capsys):
    code = cli.main(
        [
            "--model",
            str(tiny),
            "--prompt",
            "w1 w2 w3",
            "w4 w5 w4 w5",
            "--max-new-tokens",
            "10",
            "--block-size",
            "4",
            "--method",
            "multiblock",
            "--compare",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "[2/2] prompt 2: w4 w5 w4 w5" in out
    assert out.count("HF greedy generate: identical tokens") == 2
    assert "2/2 identical" in out and "TPF" in out


def test_cli_decodes_with_a_rolling_window(tiny, capsys):
    args = ["--model", str(tiny), "--prompt", "w1 w2 w3", "--max-new-tokens", "12", "--block-size", "4"]
    assert cli.main([*args, "--method", "jacobi", "--rolling", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "with jacobi n4r," in out and "1/1 identical" in out
    assert cli.main([*args, "--method", "multiblock", "--rolling"]) == 2
    assert "rolling needs method 'jacobi'" in capsys.readouterr().err


def test_cli_errors_are_clear(tiny, prompts_file, capsys):
    assert cli.main(["--model", str(tiny), "--prompts-file", str(prompts_file.with_name("missing.jsonl"))]) == 2
    assert "prompt file not found" in capsys.readouterr().err
    assert cli.main(["--model", str(tiny), "--prompts-file", str(prompts_file), "--field", "question"]) == 2
    assert "no field 'question' (fields: q)" in capsys.readouterr().err


def test_step_overhead_bench_times_every_method_beside_hf_generate(tmp_path):
    """Every method gets a whole step, a forward and a host share per batch size, each method decoding the same
    number of steps (EOS off), and the ratios are against HF generate's whole step of the same batch."""
    from bench import step_overhead

    out = step_overhead.main(
        ["--batches", "1", "3", "--rounds", "1", "--max-new-tokens", "6", "--out", str(tmp_path / "s.json")]
    )
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"1", "3"}
    for figures in results.values():
        assert set(figures) == {"hf_generate", "ar", "jacobi", "multiblock", "ar+lookup"}
        hf = figures["hf_generate"]
        assert hf["steps"] == 5 and figures["ar"]["steps"] == 5  # 6 tokens: the prefill gives the first
        for f in figures.values():
            assert 0 < f["forward_ms"] <= f["step_ms"]
            assert f["host_ms"] == pytest.approx(f["step_ms"] - f["forward_ms"])
            assert f["step_over_hf_step"] == pytest.approx(f["step_ms"] / hf["step_ms"])


def test_compile_curve_times_a_bfloat16_copy_beside_the_model(tiny, tmp_path):
    """`--compiled bfloat16` measures a copy of the model in bfloat16; the float32 model it sits beside is left as
    it was."""
    from bench import compile_curve

    args = ["--model", str(tiny), "--compiled", "bfloat16", "--widths", "1", "2", "--rounds", "2"]
    out = compile_curve.main([*args, "--out", str(tmp_path / "curve.json")])
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"eager", "bfloat16"} and all(results[v]["ms"]["2"] > 0 for v in results)
    model = compile_curve.load_model(compile_curve.ModelConfig(name_or_path=str(tiny)))[0]
    copy = compile_curve.build(model, "bfloat16")
    assert copy is not model and next(copy.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32


def test_compile_curve_times_several_eager_variants_in_one_run_but_one_compiled(tiny, tmp_path):
    """The linear mode with and without the C kernel beside eager, interleaved in one run; two compiled variants in
    one process would share graphs, so they are refused."""
    from bench import compile_curve

    args = ["--model", str(tiny), "--widths", "1", "3", "--rounds", "2", "--out", str(tmp_path / "curve.json")]
    out = compile_curve.main([*args, "--compiled", "linear-two-ways", "linear-auto"])
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["eager", "linear-two-ways", "linear-auto"] and all(
        r["ms"]["3"] > 0 for r in results.values()
    )
    with pytest.raises(SystemExit):
        compile_curve.main([*args, "--compiled", "inductor", "inductor-frozen"])


def test_linear_ways_times_every_way_on_every_weight_shape(tiny, tmp_path):
    from bench import linear_ways
    from jfcore.decoding.runner.linear import WAYS

    out = linear_ways.main(
        ["--model", str(tiny), "--rows", "1", "5", "--rounds", "2", "--out", str(tmp_path / "w.json")]
    )
    table = json.loads(out.read_text())["microseconds"]
    model = linear_ways.load_model(linear_ways.ModelConfig(name_or_path=str(tiny)))[0]
    shapes = {f"{m.weight.shape[0]}x{m.weight.shape[1]}" for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert set(table) == shapes
    assert all(
        set(cells) == {"1", "5"} and all(set(c) == set(WAYS) for c in cells.values()) for cells in table.values()
    )
    assert all(us > 0 for cells in table.values() for c in cells.values() for us in c.values())


def test_linear_ways_sweep_times_every_way_over_all_weights(tiny, tmp_path):
    from bench import linear_ways
    from jfcore.decoding.runner.linear import WAYS

    out = linear_ways.main(
        ["--model", str(tiny), "--sweep", "--rows", "1", "3", "--rounds", "2", "--out", str(tmp_path / "s.json")]
    )
    result = json.loads(out.read_text())
    model = linear_ways.load_model(linear_ways.ModelConfig(name_or_path=str(tiny)))[0]
    output = model.get_output_embeddings()
    swept = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not output]
    assert result["weights_mb"] == pytest.approx(sum(w.numel() * 4 for w in swept) / 1e6)
    assert set(result["milliseconds"]) == {"1", "3"}
    assert all(set(c) == set(WAYS) and min(c.values()) > 0 for c in result["milliseconds"].values())


def test_linear_ways_kernels_times_each_c_kernel_and_leaves_the_hosts_in_use(tiny, tmp_path):
    from bench import linear_ways
    from jfcore.decoding.runner.linear import _rows

    if _rows is None:
        pytest.fail("jfcore/decoding/runner/_rows.c was not built: install a C compiler, pip install -e .")
    default = _rows.kernels()[0]
    out = linear_ways.main(
        [
            "--model",
            str(tiny),
            "--sweep",
            "--kernels",
            "--rows",
            "2",
            "--rounds",
            "1",
            "--out",
            str(tmp_path / "k.json"),
        ]
    )
    cells = json.loads(out.read_text())["milliseconds"]["2"]
    assert set(cells) == {"torch", "weight_first", *(f"rows:{k}" for k in _rows.kernels())}
    assert _rows.use(default) == default  # each kernel was switched to for its own calls only


def test_text_repetition_counts_the_4grams_a_completion_repeats():
    from jfcore.evaluation.repetition import repeated_share

    assert repeated_share([1, 2, 3, 4, 1, 2, 3, 4]) == 1 / 5  # the last 4-gram is the first again
    assert repeated_share([7] * 10) == 6 / 7  # a loop: every 4-gram after the first
    assert repeated_share(list(range(12))) == 0.0 and repeated_share([1, 2]) == 0.0


def test_text_repetition_counts_answers_that_end_in_a_repeated_line_apart_from_short_loops(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bench.text_repetition import summarize

    text, line = list(range(20)), list(range(100, 112))
    answers = {"line": text + line * 3, "newlines": text + [198] * 12, "fresh": list(range(60))}
    rows = [
        {"benchmark": "gsm8k", "model": "trained", "method": m, "tokens": a, "correct": False, "new_tokens": len(a)}
        for a in answers.values()
        for m in ("hf_greedy", "tuned")
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "samples.parquet")
    summary = summarize(tmp_path)["all/trained"]
    assert summary["samples"] == 3  # greedy answers only
    assert (summary["short_loop_ends"], summary["loop_ends"]) == (1 / 3, 2 / 3)


def test_a_completion_ends_in_a_short_loop_when_its_last_tokens_repeat_with_period_one_or_two():
    from jfcore.evaluation.repetition import ends_in_short_loop

    text = list(range(20))
    assert ends_in_short_loop(text + [198] * 10)  # newline after newline
    assert ends_in_short_loop(text + [7, 198] * 5)  # two tokens by turns
    assert not ends_in_short_loop(text + [198] * 9)  # one token short of the run
    assert not ends_in_short_loop(text + [1, 2, 3] * 4)  # period 3: a 4-gram repeat, not a short loop
    assert not ends_in_short_loop([198] * 10 + text)  # a loop that the text leaves counts only in the 4-gram share
    assert not ends_in_short_loop([5] * 5)  # too short to tell


def test_a_short_loop_starts_at_the_first_token_of_its_longest_periodic_tail():
    from jfcore.evaluation.repetition import short_loop_start

    text = list(range(20))
    assert short_loop_start(text + [198] * 12) == 20
    assert short_loop_start(text + [7, 198] * 6) == 20
    assert short_loop_start(text + [198, 7, 198, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]) == 23  # the loop after the pairs
    assert short_loop_start([198] * 15) == 0
    assert short_loop_start(text + [198] * 9) is None and short_loop_start(text) is None


def test_own_drafts_counts_every_family_and_checks_it_against_ar(tiny, capsys):
    from bench import own_drafts

    row = own_drafts.measure(str(tiny), ["jacobi:4", "rolling:4", "multiblock:4", "rolling:4inL3"], 1, 12)
    assert row["prompts"] == 2  # one GSM8K and one HumanEval test problem
    for figures in row["drafts"].values():
        assert figures["exact"] == 2
        assert 1.0 <= figures["tpf"] <= 4.0
    within, beside = own_drafts.draft_config("rolling:4inL3", 12), own_drafts.draft_config("jacobi:2+L2", 12)
    assert (within.lookup_tokens, within.lookup_within, within.rolling) == (3, True, True)
    assert (beside.lookup_tokens, beside.lookup_within, beside.rolling) == (2, False, False)
    with pytest.raises(SystemExit, match="FAMILY:N"):
        own_drafts.draft_config("lookahead:4", 12)


def test_own_drafts_counts_answers_that_end_in_loops_only_up_to_the_loop(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench import own_drafts
    from jfcore.chat import encode_chat
    from jfcore.evaluation.repetition import short_loop_start
    from jfcore.paths import eval_prompts

    # At this scale of weights the answers are a few words and then a short loop, except one.
    checkpoint = save_tiny_checkpoint(tmp_path, initializer_range=0.1)
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(checkpoint).eval(),
        AutoTokenizer.from_pretrained(checkpoint),
    )
    prompts = [encode_chat(tokenizer, text) for name in own_drafts.SETS for text in eval_prompts(name, 2)]
    answers = [greedy_reference(model, prompt, 32) for prompt in prompts]
    starts = [short_loop_start(answer) for answer in answers]
    cut = [start for start in starts if start]  # answers with text before their loop
    assert len(cut) >= 2 and None in starts

    row = own_drafts.measure(str(checkpoint), ["jacobi:4"], 2, 32)
    figures = row["drafts"]["jacobi:4"]
    assert row["loop_ends"] == sum(start is not None for start in starts)
    assert figures["checked"] == len(prompts) + len(cut) and figures["exact"] == figures["checked"]
    assert figures["tokens"] == sum(map(len, answers))
    assert figures["tokens_before_loops"] == sum(cut) + sum(len(a) for a, s in zip(answers, starts) if s is None)
    assert 1.0 <= figures["tpf_before_loops"] <= 4.0


def test_copy_targets_pairs_each_noisy_prefix_with_the_next_fixed_point_token():
    from bench.copy_targets import block_pairs
    from tests.support.training_data import packed_row

    # Block 0 wrong from offset 1, block 1 from offset 0; the last clean token has no next token to predict.
    row = packed_row([1, 2], [([3, 5, 9], [3, 4, 5]), ([6, 6, 9], [6, 7, 8])], mismatch=[1, 0], n=3)
    assert list(block_pairs(row, None)) == [
        ([3, 5], [3, 4], 5),  # the target 5 is already in the noisy block: a copy
        ([3, 5, 9], [3, 4, 5], 6),  # the bridge into block 1
        ([6], [6], 7),
        ([6, 6], [6, 7], 8),
    ]
    assert [p[2] for p in block_pairs(row, 1)] == [5, 7]  # offset 0 past each block's first mismatch only


def test_confidence_probe_reads_the_fixed_points_as_the_models_greedy_text_and_sees_sharpening(tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    from bench import confidence_probe
    from jfcore.packing import PackingConfig
    from jfcore.training.acceptance import examples
    from jfcore.training.copies import lookup_candidates
    from tests.support.training_data import packed_data

    base = save_tiny_checkpoint(tmp_path / "base", initializer_range=0.3)
    packing = packed_data(base, tmp_path, prompts=12, heldout=PackingConfig(heldout_fraction=0.5, heldout_seed=1))
    sharper = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():  # logits twice as large: the same argmax, a sharper distribution
        sharper.lm_head.weight.mul_(2.0)
    sharper.save_pretrained(tmp_path / "sharper")
    (tmp_path / "sharper" / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
    out = tmp_path / "probe.json"
    confidence_probe.main([str(packing), f"base={base}", f"sharper={tmp_path / 'sharper'}", "--out", str(out)])
    figures = json.loads(out.read_text())
    assert figures["base"]["tokens"] > 0
    assert figures["base"]["argmax_is_the_text"] == 1.0  # trajectories end at the model's own greedy text
    assert figures["sharper"]["argmax_is_the_text"] == 1.0
    assert figures["sharper"]["mean_top1_prob"] > figures["base"]["mean_top1_prob"]
    assert figures["sharper"]["mean_entropy"] < figures["base"]["mean_entropy"]
    # The base model never leaves its own text, so its argmax is the lookup candidate exactly where the text is.
    rows = [r for f in sorted((packing / "heldout").glob("*.parquet")) for r in pq.read_table(f).to_pylist()][:16]
    texts = [(e.prompt, e.response) for e in examples(rows)]
    pairs = [(c, t) for p, r in texts for c, t in zip(lookup_candidates(p, r), r) if c >= 0]
    assert figures["base"]["tokens_with_a_lookup_candidate"] == len(pairs) > 0
    assert figures["base"]["argmax_is_the_lookup"] == pytest.approx(sum(c == t for c, t in pairs) / len(pairs))
    assert (figures["base"]["departures"], figures["base"]["departures_to_the_lookup"]) == (0, None)


def test_acceptance_probe_without_block_sizes_measures_noisy_accuracy_alone(tmp_path):
    from bench import acceptance_probe
    from jfcore.packing import PackingConfig
    from tests.support.training_data import packed_data

    base = save_tiny_checkpoint(tmp_path / "base", initializer_range=0.3)
    packing = packed_data(base, tmp_path, prompts=12, heldout=PackingConfig(heldout_fraction=0.5, heldout_seed=1))
    out = tmp_path / "probe.json"
    acceptance_probe.main([str(packing), str(base), "--prompts", "4", "--block-sizes", "--out", str(out)])
    figures = json.loads(out.read_text())["results"][str(base)]
    for split in ("trained", "heldout"):
        assert not any(k.startswith("simulated_tpf") for k in figures[split])
        shares = figures[split]["copyable_share"]
        assert 0 <= shares <= 1 and 0 <= figures[split]["noisy_accuracy"] <= 1
        assert figures[split]["text_kept"] == 1.0  # the trajectories are this model's own greedy text


def test_the_repeat_probe_measures_what_the_training_repeat_penalty_does_on_the_same_text():
    from bench.repeat_probe import repeat_measures
    from jfcore.training import collate
    from jfcore.training.losses import repeat_loss
    from tests.support.training_data import packed_row

    # Clean stream 1 4 5 6 4 5 6 3 8, prompt 1 4 5: the probe reads it as one sequence, training as a packed row.
    blocks = [([9, 9, 9], [6, 4, 5]), ([9, 9, 9], [6, 3, 8])]
    batch = collate([packed_row([1, 4, 5], blocks, mismatch=[0, 0], n=3)], 0, 2, ar_prompt=False)
    torch.manual_seed(0)
    logits = torch.randn(*batch.input_ids.shape, 11)
    flat = logits.reshape(-1, 11)
    on_clean = (batch.clean_index >= 0).nonzero()[:, 0]
    clean = flat[on_clean[batch.clean_index[on_clean].argsort()]]
    ids = [1, 4, 5, 6, 4, 5, 6, 3, 8]
    measures = repeat_measures(torch.log_softmax(clean, -1), ids, start=2)
    assert len(measures) == 6
    assert sum(measures) / 6 == pytest.approx(repeat_loss(logits, batch).item(), rel=1e-5)


def test_the_base_judge_agrees_with_its_own_greedy_text_and_not_with_a_garbled_copy(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.base_judge import judge, judge_tokens
    from jfcore.chat import encode_chat
    from jfcore.evaluation.repetition import short_loop_start

    logp = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]]), -1)
    nll, top = judge_tokens(logp, [0, 1])
    assert top == [True, False] and nll == pytest.approx([-logp[0, 0].item(), -logp[1, 1].item()])

    checkpoint = save_tiny_checkpoint(tmp_path, initializer_range=0.1)
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(checkpoint).eval(),
        AutoTokenizer.from_pretrained(checkpoint),
    )
    text = "w7 w8 w9"
    answer = greedy_reference(model, encode_chat(tokenizer, text), 32)
    own = judge(model, tokenizer, [(text, answer)])
    assert own["argmax_share"] == 1.0 and own["tokens"] == 32
    loop = short_loop_start(answer)
    assert own["tokens_before_loops"] == (32 if loop is None else loop)
    garbled = judge(model, tokenizer, [(text, [(t + 1) % 128 for t in answer])])
    assert garbled["argmax_share"] < 0.5 and garbled["nll"] > own["nll"]


def test_trajectory_endings_counts_answers_that_end_and_code_blocks_closed_before_the_end():
    from bench.trajectory_endings import answer_endings

    words = {1: "```", 2: "<eos>", 3: "\n", 4: "x", 5: " y"}

    def decode(tokens):
        return "".join(words[t] for t in tokens)

    def row(prompt, block, states):  # the last state is the fixed point
        return {"prompt_id": prompt, "block_index": block, "states": states, "fixed_point": states[-1]}

    rows = [
        row("closes", 1, [[3, 1, 2], [3, 1, 2]]),  # out of order: block 1 follows block 0
        row("closes", 0, [[1, 3, 3], [1, 3, 4]]),  # a wrong newline at offset 2
        row("runs-on", 0, [[4, 5, 4], [4, 5, 5]]),
        row("ends-in-text", 0, [[1, 4, 5], [1, 4, 2]]),
    ]
    figures = answer_endings(rows, eos=2, decode=decode)
    assert figures["prompts"] == 3 and figures["ended"] == 2 and figures["with_code_fence"] == 2
    assert figures["short_loop_ends"] == figures["loop_ends"] == 0
    assert figures["closed_code_block_then_ended"] == 1  # "```\nx\n```" then EOS; "```x y" then EOS is not closed
    assert figures["newline_share_fixed_points"] == 2 / 12
    assert figures["newline_share_wrong_draft_tokens"] == 1 / 3  # the wrong tokens: 3 (a newline), 4 and 5


def test_trajectory_endings_counts_answers_that_end_in_a_loop_and_the_tokens_it_holds():
    from bench.trajectory_endings import answer_endings

    line = [4, 5, 5, 4, 4, 5, 3]  # a 7-token line, written 4 times after 10 tokens of text
    answers = {"lines": list(range(10, 20)) + line * 4, "newlines": list(range(10, 28)) + [3] * 20}
    rows = [
        {"prompt_id": p, "block_index": j, "states": [a[k : k + 8]], "fixed_point": a[k : k + 8]}
        for p, a in answers.items()
        for j, k in enumerate(range(0, len(a), 8))
    ]
    figures = answer_endings(rows, eos=2, decode=lambda tokens: "")
    assert (figures["short_loop_ends"], figures["loop_ends"]) == (1, 2)
    assert figures["loop_token_share"] == (28 + 20) / 76
