"""Prompt sets for trajectory generation: where prompts come from and how they become token ids.

A `PromptSource` is a hub dataset id (+ config, split), a local JSONL/Parquet file or folder, or
"builtin" (the project's own coding and math questions, packaged). Prompts longer than
`max_prompt_tokens` (chat template included) are skipped and counted, never truncated; `limit`
counts source rows, so a set holds `limit - skipped_too_long` prompts.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from jfcore.chat import encode_chat
from jfcore.config import check

BUILTIN = "builtin"
_SUFFIXES = {".jsonl": "json", ".jsonl.gz": "json", ".json": "json", ".json.gz": "json", ".parquet": "parquet"}


class PromptSourceError(ValueError):
    """A prompt source cannot be read or does not hold usable prompts."""


@dataclass(frozen=True, kw_only=True)
class PromptSource:
    path: str = BUILTIN  # hub dataset id, local .jsonl/.jsonl.gz/.json/.parquet file or folder, or "builtin"
    config: str | None = None  # hub config name (hub ids only)
    split: str = "train"  # hub split (local files are one split)
    field: str = "prompt"  # column holding the prompt text
    id_field: str | None = None  # column holding a stable id; default: the row index ("id" for builtin)
    limit: int | None = None  # rows taken (after shuffling); None = all
    shuffle_seed: int | None = None  # shuffle the rows deterministically before `limit`
    system_prompt: str | None = None  # system turn for the chat template
    chat_template: bool = True  # apply the tokenizer's chat template when it has one
    max_prompt_tokens: int = 512  # longer prompts are skipped and counted, never truncated

    def __post_init__(self) -> None:
        check(bool(self.path.strip()), "PromptSource.path: must not be empty")
        for name in ("split", "field", "id_field"):
            check(getattr(self, name) != "", f"PromptSource.{name}: must not be empty")
        check(self.limit is None or self.limit > 0, f"PromptSource.limit: must be positive, got {self.limit}")
        check(self.shuffle_seed is None or self.shuffle_seed >= 0, "PromptSource.shuffle_seed: must be >= 0")
        check(self.max_prompt_tokens > 0, "PromptSource.max_prompt_tokens: must be positive")
        check(self.system_prompt is None or self.chat_template, "PromptSource.system_prompt: needs chat_template: true")
        builtin_ok = self.path != BUILTIN or (self.config, self.split) == (None, "train")
        check(builtin_ok, "PromptSource: 'builtin' has no config and only the split 'train'")


@dataclass
class PromptSet:
    ids: list[str]
    texts: list[str]
    token_ids: list[list[int]]
    skipped_too_long: int = 0

    def __len__(self) -> int:
        return len(self.ids)

    def fingerprint(self) -> str:
        """Short digest of the ids and token ids: changes whenever any prompt the model sees changes."""
        digest = hashlib.sha256()
        for prompt_id, ids in zip(self.ids, self.token_ids):
            digest.update(json.dumps([prompt_id, ids]).encode())
        return digest.hexdigest()[:16]

    def keys(self) -> list[str]:
        """One digest per prompt over its id and token ids: what trajectory stores know a decoded prompt by,
        so an edited prompt is decoded again even when its id stays."""
        return [
            hashlib.sha256(json.dumps([i, ids]).encode()).hexdigest()[:16] for i, ids in zip(self.ids, self.token_ids)
        ]


def builtin_prompts_path() -> Path:
    """The packaged builtin prompt file (fields id, prompt, kind)."""
    return Path(str(resources.files("jfcore").joinpath("data/builtin_prompts.jsonl")))


def load_prompt_texts(source: PromptSource) -> list[tuple[str, str]]:
    """(prompt_id, text) pairs of `source`, shuffled and limited as configured.

    With a `limit` and no shuffle, a hub dataset or a single file is streamed: only its first `limit` rows
    are read (no full download). A shuffle needs every row, so it loads the whole source."""
    id_field = source.id_field or ("id" if source.path == BUILTIN else None)
    streamed = _streamed(source)
    if streamed is not None:
        rows, columns, name = streamed
        order = list(range(len(rows)))
        column = lambda key: [row[key] for row in rows]
    else:
        dataset, name = _load(source)
        columns = dataset.column_names if len(dataset) else []
        order = list(range(len(dataset)))
        if source.shuffle_seed is not None:
            random.Random(source.shuffle_seed).shuffle(order)
        order = order[: source.limit]
        selected = dataset if order == list(range(len(dataset))) else dataset.select(order)
        column = lambda key: list(selected[key])
    if not order or not columns:
        raise PromptSourceError(f"prompt source '{source.path}' holds no rows")
    for missing in {source.field, id_field} - {None, *columns}:
        available = ", ".join(columns)
        raise PromptSourceError(f"prompt source '{source.path}' has no column '{missing}'; available: {available}")
    texts = column(source.field)
    keys = column(id_field) if id_field else order  # default id: the row index in the source
    pairs, seen = [], set()
    for key, text in zip(keys, texts):
        if key is None:
            raise PromptSourceError(f"prompt source '{source.path}': a row has no id in '{id_field}'")
        if not isinstance(text, str) or not text.strip():
            raise PromptSourceError(
                f"prompt source '{source.path}': row {key!r} has no text in '{source.field}': {text!r}"
            )
        prompt_id = f"{name}:{key}"
        if prompt_id in seen:
            raise PromptSourceError(f"prompt source '{source.path}': id '{key}' in column '{id_field}' is not unique")
        seen.add(prompt_id)
        pairs.append((prompt_id, text))
    return pairs


def encode_prompts(source: PromptSource, tokenizer) -> PromptSet:
    """Token ids of every prompt of `source`, through the chat template when asked for and available."""
    use_template = source.chat_template and bool(getattr(tokenizer, "chat_template", None))
    if source.system_prompt is not None and not use_template:
        raise PromptSourceError("PromptSource.system_prompt is set but the tokenizer has no chat template")
    result = PromptSet([], [], [])
    pairs = load_prompt_texts(source)
    for start in range(0, len(pairs), ENCODE_BATCH):
        chunk = pairs[start : start + ENCODE_BATCH]
        if use_template:
            encoded = [encode_chat(tokenizer, text, source.system_prompt) for _, text in chunk]
        else:  # one call per batch: fast tokenizers encode it in parallel
            encoded = [list(ids) for ids in tokenizer([text for _, text in chunk])["input_ids"]]
        _keep(result, chunk, encoded, source.max_prompt_tokens)
    return result


ENCODE_BATCH = 1024


def _keep(result: PromptSet, pairs: list[tuple[str, str]], encoded: list[list[int]], max_tokens: int) -> None:
    for (prompt_id, text), ids in zip(pairs, encoded):
        if len(ids) > max_tokens:
            result.skipped_too_long += 1
            continue
        result.ids.append(prompt_id)
        result.texts.append(text)
        result.token_ids.append(ids)


def _looks_local(path: str) -> bool:
    # Hub ids are "name" or "org/name"; an existing path, anything else, or a data-file name is local.
    hub_like = re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", path) is not None
    return Path(path).expanduser().exists() or not hub_like or path.endswith(tuple(_SUFFIXES))


def _data_files(path: Path) -> list[Path]:
    files = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p)) if path.is_dir() else [path]
    if not files:
        raise PromptSourceError(f"prompt folder {path} holds no {'/'.join(_SUFFIXES)} files")
    if not _kind(path) and not path.is_dir():
        raise PromptSourceError(f"prompt file {path}: unsupported type; use one of {', '.join(_SUFFIXES)}")
    if len({_kind(f) for f in files}) > 1:
        raise PromptSourceError(f"prompt folder {path} mixes JSON and Parquet files; keep one kind per folder")
    return files


def _kind(path: Path) -> str | None:
    return next((kind for suffix, kind in _SUFFIXES.items() if path.name.endswith(suffix)), None)


def _reason(err: BaseException | None, files: list[Path]) -> str:
    # datasets fails on files without rows (a bare StopIteration for JSON, a batch-size error for Parquet)
    # and wraps the useful message (a JSON parse error and its row) in a generic one.
    if _no_rows(files):
        return "it holds no rows"
    messages: list[str] = []
    while err is not None:
        if str(err) and str(err) not in messages:
            messages.append(str(err))
        err = err.__cause__ or err.__context__
    return ": ".join(messages)


def _no_rows(files: list[Path]) -> bool:
    import pyarrow.parquet as pq

    try:
        return all(pq.read_metadata(f).num_rows == 0 if _kind(f) == "parquet" else not _read(f).strip() for f in files)
    except (OSError, ValueError):  # unreadable: datasets' own message says why
        return False


def _read(path: Path) -> str:
    with (gzip.open if path.name.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        return f.read()


def _streamed(source: PromptSource) -> tuple[list[dict], list[str], str] | None:
    """The first `limit` rows of a hub dataset or a single local file, read as a stream; None where the whole
    source must be loaded (no limit, a shuffle, or a folder of files)."""
    if source.limit is None or source.shuffle_seed is not None:
        return None
    import datasets

    hub = source.path != BUILTIN and not _looks_local(source.path)
    if hub:
        where, name = source.path, ":".join(p for p in (source.path, source.config, source.split) if p)
        args, kwargs = (source.path, source.config), {"split": source.split}
    else:
        path = builtin_prompts_path() if source.path == BUILTIN else Path(source.path).expanduser()
        if not path.is_file() or not _kind(path) or source.config is not None or source.split != "train":
            return None  # folders, and the errors `_load` words
        where, name = str(path), BUILTIN if source.path == BUILTIN else re.sub(r"(\.[a-z]+)+$", "", path.name)
        args, kwargs = (_kind(path),), {"data_files": [str(path)], "split": "train"}
    try:
        stream = datasets.load_dataset(*args, **kwargs, streaming=True)
        rows = list(itertools.islice(stream, source.limit))
    except Exception as err:  # offline, unknown id, malformed rows: the same advice as a full load
        if hub:
            raise PromptSourceError(
                f"could not stream dataset '{where}' from the hub (offline?): {err}; "
                "download it or point `path` at a local JSONL/Parquet file"
            ) from err
        raise PromptSourceError(f"could not read prompts from {where}: {_reason(err, [Path(where)])}") from err
    columns = list(stream.column_names or (rows[0] if rows else []))
    return rows, columns, name


def _load(source: PromptSource):
    """The dataset of `source` and the name its prompt ids start with."""
    import datasets

    if source.path != BUILTIN and not _looks_local(source.path):
        try:
            dataset = datasets.load_dataset(source.path, source.config, split=source.split)
        except Exception as err:  # offline, unknown id, bad config or split: all say the same to the user
            raise PromptSourceError(
                f"could not load dataset '{source.path}' from the hub (offline?): {err}; "
                "download it or point `path` at a local JSONL/Parquet file"
            ) from err
        return dataset, ":".join(p for p in (source.path, source.config, source.split) if p)
    path = builtin_prompts_path() if source.path == BUILTIN else Path(source.path).expanduser()
    if not path.exists():
        raise PromptSourceError(f"prompt file or folder '{source.path}' does not exist")
    if source.config is not None or source.split != "train":
        raise PromptSourceError(f"prompt source '{source.path}' is local: `config` and `split` apply to hub ids only")
    files = _data_files(path)
    try:
        parts = [datasets.load_dataset(_kind(f), data_files=[str(f)], split="train") for f in files]
    except Exception as err:  # malformed JSON, a truncated Parquet file
        raise PromptSourceError(f"could not read prompts from {path}: {_reason(err, files)}") from err
    return _concatenate(parts, files, source), BUILTIN if source.path == BUILTIN else re.sub(
        r"(\.[a-z]+)+$", "", path.name
    )


def _concatenate(parts: list, files: list[Path], source: PromptSource):
    """One dataset of a folder's files; files with other columns beside the prompt's contribute just it (and its id)."""
    import datasets

    if len(parts) == 1:
        return parts[0]
    if any(p.column_names != parts[0].column_names for p in parts):
        wanted = [c for c in (source.field, source.id_field) if c]
        for f, part in zip(files, parts):
            for column in wanted:
                if column not in part.column_names:
                    raise PromptSourceError(
                        f"prompt file {f} has no column '{column}'; available: {', '.join(part.column_names)}"
                    )
        parts = [p.select_columns(wanted) for p in parts]
    return datasets.concatenate_datasets(parts)
