"""Prompt sources: local JSONL/Parquet files and folders, the shared prompt files, the builtin set, and their errors."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from jfcore.config import ConfigError, from_dict
from jfcore.models import ModelConfig, resolve_checkpoint
from jfcore.paths import default_data_dir
from jfcore.prompts import PromptSource, PromptSourceError, builtin_prompts_path, encode_prompts, load_prompt_texts
from tests.support import REPO

ROWS = [{"question": f"question number {i} " + "word " * i, "qid": f"q{i}"} for i in range(10)]


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path, monkeypatch):
    # load_dataset converts every file it reads into Arrow under its cache; keep test files out of the user's.
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


@pytest.fixture(scope="module")
def words():
    """A template-less word-level tokenizer: one token per word, no special tokens added."""
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "question": 1, "number": 2, "word": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


@pytest.fixture(scope="module")
def smol():
    """The real SmolLM2 tokenizer (ChatML template) from the converted-checkpoint cache."""
    return AutoTokenizer.from_pretrained(resolve_checkpoint(ModelConfig()))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def test_local_jsonl_parquet_and_folder(tmp_path):
    jsonl = write_jsonl(tmp_path / "qs.jsonl", ROWS)
    pairs = load_prompt_texts(PromptSource(path=str(jsonl), field="question"))
    assert pairs == [(f"qs:{i}", row["question"]) for i, row in enumerate(ROWS)]
    by_id = load_prompt_texts(PromptSource(path=str(jsonl), field="question", id_field="qid"))
    assert [i for i, _ in by_id] == [f"qs:q{i}" for i in range(10)]

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "qs.parquet")
    assert load_prompt_texts(PromptSource(path=str(tmp_path / "qs.parquet"), field="question", id_field="qid")) == by_id

    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ROWS[:4])
    write_jsonl(folder / "b.jsonl.gz", ROWS[4:])
    assert load_prompt_texts(PromptSource(path=str(folder), field="question", id_field="qid")) == [
        (f"folder:q{i}", t) for i, (_, t) in enumerate(by_id)
    ]


def test_a_folder_of_files_with_other_columns_gives_each_files_prompts(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"question": "q0", "answer": "1"}, {"question": "q1", "answer": "2"}])
    write_jsonl(folder / "b.jsonl", [{"question": "q2", "tests": ["assert f()"], "name": "x"}])
    assert load_prompt_texts(PromptSource(path=str(folder), field="question")) == [
        ("mixed:0", "q0"),
        ("mixed:1", "q1"),
        ("mixed:2", "q2"),
    ]
    write_jsonl(folder / "c.jsonl", [{"text": "no question here"}])
    with pytest.raises(PromptSourceError, match=r"c.jsonl has no column 'question'; available: text"):
        load_prompt_texts(PromptSource(path=str(folder), field="question"))


def test_the_shared_prompt_folder_loads_whole():
    prompts = load_prompt_texts(PromptSource(path=str(default_data_dir() / "prompts")))
    assert len(prompts) == 7471 + 4480 + 456 + 1715 and len({t for _, t in prompts}) > 14000


def test_shuffle_and_limit_are_deterministic(tmp_path):
    path = str(write_jsonl(tmp_path / "qs.jsonl", ROWS))
    first = load_prompt_texts(PromptSource(path=path, field="question", shuffle_seed=3, limit=4))
    assert first == load_prompt_texts(PromptSource(path=path, field="question", shuffle_seed=3, limit=4))
    assert first != load_prompt_texts(PromptSource(path=path, field="question", shuffle_seed=4, limit=4))
    assert len(first) == 4 and first != load_prompt_texts(PromptSource(path=path, field="question", limit=4))
    for prompt_id, text in first:  # ids keep the row index of the source, whatever the order
        assert text == ROWS[int(prompt_id.split(":")[1])]["question"]
    assert load_prompt_texts(PromptSource(path=path, field="question", limit=3)) == [
        (f"qs:{i}", ROWS[i]["question"]) for i in range(3)
    ]


def test_too_long_prompts_are_skipped_and_counted(tmp_path, words):
    path = str(write_jsonl(tmp_path / "qs.jsonl", ROWS))  # row i has 3 + i words
    prompts = encode_prompts(PromptSource(path=path, field="question", max_prompt_tokens=7), words)
    assert prompts.skipped_too_long == 5 and prompts.ids == [f"qs:{i}" for i in range(5)]
    assert [len(t) for t in prompts.token_ids] == [3, 4, 5, 6, 7]  # whole, never truncated
    assert prompts.token_ids[2] == [1, 2, 0, 3, 3]
    assert prompts.texts == [r["question"] for r in ROWS[:5]]


def test_chat_template_and_system_prompt(smol):
    source = PromptSource(limit=3)
    prompts = encode_prompts(source, smol)
    start = smol.convert_tokens_to_ids("<|im_start|>")
    for text, ids in zip(prompts.texts, prompts.token_ids):
        assert (
            ids[0] == start
            and ids
            == smol.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        assert smol.decode(ids).endswith(f"{text}<|im_end|>\n<|im_start|>assistant\n")
    system = encode_prompts(PromptSource(limit=3, system_prompt="Answer in one line."), smol)
    assert smol.decode(system.token_ids[0]).startswith("<|im_start|>system\nAnswer in one line.<|im_end|>")
    plain = encode_prompts(PromptSource(limit=3, chat_template=False), smol)
    assert plain.token_ids[0] == smol(prompts.texts[0])["input_ids"] and start not in plain.token_ids[0]
    fingerprints = {p.fingerprint() for p in (prompts, system, plain)}
    assert len(fingerprints) == 3 and encode_prompts(source, smol).fingerprint() == prompts.fingerprint()


def test_shared_prompt_files_by_path(smol):
    data = default_data_dir() / "prompts"
    gsm8k = encode_prompts(
        PromptSource(path=str(data / "gsm8k_train.jsonl"), id_field="id", limit=8, shuffle_seed=0), smol
    )
    assert len(gsm8k) + gsm8k.skipped_too_long == 8 and all(i.startswith("gsm8k_train:") for i in gsm8k.ids)
    mbpp = load_prompt_texts(PromptSource(path=str(data / "mbpp_train.jsonl"), id_field="task_id", limit=2))
    assert mbpp[0][0] == "mbpp_train:1" and mbpp[0][1].startswith("Write a")
    tight = encode_prompts(PromptSource(path=str(data / "gsm8k_train.jsonl"), limit=50, max_prompt_tokens=90), smol)
    assert 0 < tight.skipped_too_long < 50 and max(map(len, tight.token_ids)) <= 90


def test_builtin_set_is_packaged_balanced_and_clean():
    pairs = load_prompt_texts(PromptSource())
    records = [json.loads(line) for line in builtin_prompts_path().read_text().splitlines()]
    assert len(pairs) == len(records) >= 300
    assert [i for i, _ in pairs] == [f"builtin:{r['id']}" for r in records]
    kinds = [r["kind"] for r in records]
    assert set(kinds) == {"code", "math"} and 0.4 < kinds.count("code") / len(kinds) < 0.6
    texts = [t for _, t in pairs]
    assert len(set(texts)) == len(texts) and all(0 < len(t) < 300 for t in texts)
    # The committed file is what the generator writes.
    script = REPO / "tools" / "make_builtin_prompts.py"
    spec = importlib.util.spec_from_file_location("make_builtin_prompts", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.build() == records
    # Written for the project: none appears verbatim in a held-out benchmark.
    blobs = []
    for path in sorted((default_data_dir() / "eval").glob("*.jsonl*")):
        with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
            blobs.append(f.read())
    blob = "\n".join(blobs)
    assert blobs and not [t for t in texts if t in blob or json.dumps(t)[1:-1] in blob]


def test_source_errors(tmp_path, words):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(PromptSourceError, match=r"'.*nope.jsonl' does not exist"):
        load_prompt_texts(PromptSource(path=str(missing)))
    path = str(write_jsonl(tmp_path / "qs.jsonl", ROWS))
    with pytest.raises(PromptSourceError, match=r"no column 'prompt'; available: question, qid"):
        load_prompt_texts(PromptSource(path=path))
    with pytest.raises(PromptSourceError, match=r"no column 'key'; available"):
        load_prompt_texts(PromptSource(path=path, field="question", id_field="key"))
    with pytest.raises(
        PromptSourceError,
        match=r"could not load dataset 'jf-no-such-org/no-such-set' from the hub "
        r"\(offline\?\): .*; download it or point `path` at a local JSONL/Parquet file",
    ):
        load_prompt_texts(PromptSource(path="jf-no-such-org/no-such-set"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(PromptSourceError, match="could not read prompts from .*empty.jsonl: it holds no rows"):
        load_prompt_texts(PromptSource(path=str(tmp_path / "empty.jsonl")))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    with pytest.raises(PromptSourceError, match=r"bad.jsonl: .*JSON parse error: Missing a comma"):
        load_prompt_texts(PromptSource(path=str(tmp_path / "bad.jsonl")))
    (tmp_path / "cut.parquet").write_bytes(b"PAR1 not parquet")
    with pytest.raises(PromptSourceError, match=r"could not read prompts from .*cut.parquet: .*Parquet"):
        load_prompt_texts(PromptSource(path=str(tmp_path / "cut.parquet")))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(PromptSourceError, match=r"notes.txt: unsupported type; use one of .jsonl"):
        load_prompt_texts(PromptSource(path=str(tmp_path / "notes.txt")))
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(PromptSourceError, match="none.parquet: it holds no rows"):
        load_prompt_texts(PromptSource(path=str(tmp_path / "none.parquet")))
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "a.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "mixed" / "b.parquet")
    with pytest.raises(PromptSourceError, match="mixes JSON and Parquet files"):
        load_prompt_texts(PromptSource(path=str(tmp_path / "mixed"), field="question"))
    (tmp_path / "bare").mkdir()
    with pytest.raises(PromptSourceError, match=r"holds no \.jsonl"):
        load_prompt_texts(PromptSource(path=str(tmp_path / "bare")))
    dup = str(write_jsonl(tmp_path / "dup.jsonl", [{"prompt": "a", "id": 1}, {"prompt": "b", "id": 1}]))
    with pytest.raises(PromptSourceError, match="id '1' in column 'id' is not unique"):
        load_prompt_texts(PromptSource(path=dup, id_field="id"))
    blank = str(write_jsonl(tmp_path / "blank.jsonl", [{"prompt": "a"}, {"prompt": " "}]))
    with pytest.raises(PromptSourceError, match="row 1 has no text in 'prompt'"):
        load_prompt_texts(PromptSource(path=blank))
    with pytest.raises(PromptSourceError, match="`config` and `split` apply to hub ids only"):
        load_prompt_texts(PromptSource(path=path, field="question", split="test"))
    with pytest.raises(PromptSourceError, match="the tokenizer has no chat template"):
        encode_prompts(PromptSource(path=path, field="question", system_prompt="Be brief."), words)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"path": ""}, "path: must not be empty"),
        ({"limit": 0}, "limit: must be positive"),
        ({"max_prompt_tokens": 0}, "max_prompt_tokens: must be positive"),
        ({"system_prompt": "hi", "chat_template": False}, "needs chat_template: true"),
        ({"path": "data.jsonl", "field": ""}, "field: must not be empty"),
        ({"split": "test"}, "'builtin' has no config"),
        ({"limit": "10"}, "expected an integer"),
        ({"feild": "text"}, "unknown key 'feild' \\(did you mean 'field'\\?\\)"),
    ],
)
def test_config_validation(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(PromptSource, data)


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "parquet"])
def test_a_limit_streams_only_the_rows_it_takes(tmp_path, kind, monkeypatch):
    """With a limit and no shuffle a file is streamed (no Arrow copy of the whole file is made), and the
    prompts and their ids are what a full load gives."""
    import datasets

    path = tmp_path / f"qs.{kind}"
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    else:
        write_jsonl(path, ROWS)
    full = load_prompt_texts(PromptSource(path=str(path), field="question"))
    built = []
    original = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: built.append(k.get("streaming")) or original(*a, **k))
    for limit, id_field in ((3, None), (4, "qid")):
        streamed = load_prompt_texts(PromptSource(path=str(path), field="question", limit=limit, id_field=id_field))
        expected = load_prompt_texts(PromptSource(path=str(path), field="question", id_field=id_field))[:limit]
        assert streamed == expected and len(streamed) == limit
    assert built[:2] == [True, None]  # the limited load streamed; the full one did not
    shuffled = load_prompt_texts(PromptSource(path=str(path), field="question", limit=3, shuffle_seed=1))
    assert len(shuffled) == 3 and set(shuffled) <= set(full) and built[-1] is not True  # a shuffle loads every row
    with pytest.raises(PromptSourceError, match="no column 'text'"):
        load_prompt_texts(PromptSource(path=str(path), field="text", limit=2))


def test_prompts_are_tokenised_in_batches(words, monkeypatch):
    import jfcore.prompts

    monkeypatch.setattr(jfcore.prompts, "ENCODE_BATCH", 4)
    calls = []
    original = type(words).__call__
    monkeypatch.setattr(
        type(words), "__call__", lambda self, text, **k: calls.append(text) or original(self, text, **k)
    )
    source = PromptSource(path=str(builtin_prompts_path()), field="prompt", limit=10, chat_template=False)
    one_by_one = [words(text)["input_ids"] for _, text in load_prompt_texts(source)]
    calls.clear()
    prompt_set = encode_prompts(source, words)
    assert prompt_set.token_ids == one_by_one and [len(c) for c in calls] == [4, 4, 2]
