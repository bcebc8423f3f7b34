"""The OpenAI request bodies the server accepts, validated: unknown fields are errors, and every setting that
would change the greedy output (sampling, several choices, penalties, log-probabilities) is refused with a
message that says what is supported."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


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
    # Accepted because they change nothing in greedy decoding, or only describe the caller.
    top_p: float | None = None
    seed: int | None = None
    user: str | None = None
    # Refused unless they ask for plain greedy decoding (see `greedy_problem`).
    temperature: float | None = None
    n: int | None = None
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

    def greedy_problem(self) -> BadRequest | None:
        """Why this request asks for something other than the greedy output, if it does."""
        if self.temperature not in (None, 0):
            return BadRequest(
                f"temperature={self.temperature} is not supported: this server decodes greedily (lossless Jacobi "
                "decoding reproduces the greedy output); send temperature 0 or leave it out",
                param="temperature",
            )
        if self.n not in (None, 1):
            return BadRequest(f"n={self.n} is not supported: greedy decoding has one answer; send n=1", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                return BadRequest(f"{name} is not supported: it would change the greedy output; send 0", param=name)
        if self.logit_bias:
            return BadRequest("logit_bias is not supported: it would change the greedy output", param="logit_bias")
        return None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def greedy_problem(self) -> BadRequest | None:
        if self.best_of not in (None, 1):
            return BadRequest("best_of is not supported: greedy decoding has one answer", param="best_of")
        for name in ("echo", "logprobs", "suffix"):
            if getattr(self, name):
                return BadRequest(f"{name} is not supported by this server", param=name)
        return super().greedy_problem()


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

    def greedy_problem(self) -> BadRequest | None:
        if self.logprobs:
            return BadRequest("logprobs is not supported by this server", param="logprobs")
        return super().greedy_problem()

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
