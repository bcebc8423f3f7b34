"""Turning text prompts into token ids the way the model was tuned to read them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def encode_chat(tokenizer, text: str, system: str | None = None) -> list[int]:
    """Token ids of `text` as a user turn plus the assistant header, via the model's
    chat template; plain tokenization when the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(text, add_special_tokens=True)["input_ids"]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # Newer tokenizers return a BatchEncoding-like mapping, older ones a plain list.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def read_jsonl(path: str | Path, field: str, limit: int | None = None) -> list[str]:
    """The `field` of the first `limit` records of a JSONL file (gzip allowed)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    texts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if field not in record:
                raise KeyError(f"{path}:{line_no}: no field '{field}' (fields: {', '.join(record)})")
            texts.append(record[field])
            if limit is not None and len(texts) >= limit:
                break
    return texts
