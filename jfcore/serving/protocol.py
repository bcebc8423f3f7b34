"""The OpenAI request bodies the server accepts, validated: unknown fields are errors, out-of-range values get a
400 naming the field, and settings the server does not honour (penalties, logit bias, log-probabilities) are
refused with a message that says what is supported. Sampling (temperature, top_p, top_k, seed, n) is honoured
exactly: every method returns the tokens sequential sampling with the same seed returns
(jfcore/decoding/sampling.py)."""

from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jfcore.decoding.sampling import GREEDY, Sampling

MAX_CHOICES = 16  # n: choices per prompt


class BadRequest(ValueError):
    """A request the server refuses: HTTP status, OpenAI error type, message and the offending parameter."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None  # describes the caller only
    # Sampling: temperature 0 or absent is greedy (this server's default), then top_p and top_k do nothing.
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # not in OpenAI's API; vLLM's extension
    seed: int | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    # Refused unless they change nothing (see `unsupported`).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise BadRequest("'stop' takes at most 4 sequences", param="stop")
        return stops

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def unsupported(self) -> BadRequest | None:
        """Why the server cannot do what this request asks, if it cannot."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                return BadRequest(f"{name} is not supported by this server; send 0 or leave it out", param=name)
        if self.logit_bias:
            return BadRequest("logit_bias is not supported by this server", param="logit_bias")
        return None

    def choices(self) -> int:
        return self.n or 1

    def sampling(self) -> Sampling:
        """The request's sampling settings; a sampled request without a seed gets a random one."""
        if not self.temperature:
            return GREEDY
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        return Sampling(self.temperature, self.top_k or 0, self.top_p or 1.0, seed)


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def unsupported(self) -> BadRequest | None:
        if self.best_of not in (None, 1):
            return BadRequest("best_of is not supported by this server: send n for several choices", param="best_of")
        for name in ("echo", "logprobs", "suffix"):
            if getattr(self, name):
                return BadRequest(f"{name} is not supported by this server", param=name)
        return super().unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None

    def unsupported(self) -> BadRequest | None:
        if self.logprobs:
            return BadRequest("logprobs is not supported by this server", param="logprobs")
        return super().unsupported()

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable line from pydantic's errors, and the parameter the first one is about."""
    parts = []
    for err in errors[:3]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        if err.get("type") == "missing":
            parts.append(f"'{where}' is required")
        elif err.get("type") == "extra_forbidden":
            parts.append(f"unrecognized request argument: '{where}'")
        else:
            parts.append(f"'{where}': {err.get('msg')}")
    first = errors[0].get("loc", ()) if errors else ()
    param = str(first[0]) if first else None
    return "; ".join(parts) or "invalid request", param
