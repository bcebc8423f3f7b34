"""The OpenAI-compatible HTTP server in front of the engine (docs/SERVING.md).

POST /v1/completions and /v1/chat/completions (streamed as server-sent events when `stream` is true),
GET /v1/models, /health and /metrics. Errors come back in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, and never stop the server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from jfcore.serving.engine import Engine, Event, QueueFull
from jfcore.serving.engine import Request as EngineRequest
from jfcore.serving.protocol import BadRequest, ChatBody, CompletionBody, validation_message

OPEN_PATHS = {"/health"}  # answered without the API key (load balancers, orchestrators)


@dataclass(frozen=True)
class ServedModel:
    name: str  # the id clients send as "model"
    context_length: int | None  # prompt + completion tokens the model takes; None: unchecked
    max_tokens: int  # completion budget when a request names none (capped by the context)
    aliases: tuple[str, ...] = ()  # other names accepted as "model" (the registry reference, the path)
    decoding: dict = field(default_factory=dict)  # method and block size, shown by /health

    def knows(self, name: str) -> bool:
        return name == self.name or name in self.aliases


def create_app(engine: Engine, tokenizer, served: ServedModel, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="jf-serve", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = engine.metrics

    app.add_middleware(_Guard, api_key=api_key, metrics=metrics)

    @app.exception_handler(BadRequest)
    async def refused(_: Request, error: BadRequest) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(BadRequest(str(error.detail), error.status_code).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def crashed(_: Request, error: Exception) -> JSONResponse:
        message = f"the server failed on this request: {type(error).__name__}: {error}"
        return JSONResponse(BadRequest(message, 500, "server_error").body(), status_code=500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": served.name, **served.decoding}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": served.name, "object": "model", "created": 0, "owned_by": "jacobi-forcing"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionBody, served)
        prompts = [_token_ids(tokenizer, p) for p in _prompt_list(body.prompt)]
        return await _complete(request, engine, served, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _parse(request, ChatBody, served)
        if not getattr(tokenizer, "chat_template", None):
            raise BadRequest("this model's tokenizer has no chat template: use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as err:  # noqa: BLE001 (templates raise what they like, e.g. on roles they do not know)
            raise BadRequest(f"the chat template refused these messages: {err}", param="messages") from None
        prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return await _complete(request, engine, served, body, [prompt], chat=True)

    return app


class _Guard:
    """Checks the API key and counts error responses. A plain ASGI middleware: it passes `receive` through
    untouched, so handlers see the client's `http.disconnect` as it happens (`@app.middleware("http")` wraps it)."""

    def __init__(self, app, api_key: str | None, metrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                error = BadRequest(
                    "missing or wrong API key: send it as the header 'Authorization: Bearer <key>'",
                    401,
                    code="invalid_api_key",
                )
                return await _error(error, self.metrics)(scope, receive, send)

        async def counted(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.http_errors.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def _error(error: BadRequest, metrics) -> JSONResponse:
    metrics.http_errors.labels(str(error.status)).inc()
    return JSONResponse(error.body(), status_code=error.status)


async def _parse(request: Request, schema: type, served: ServedModel):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"the request body is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        body = schema.model_validate(data)
    except ValidationError as err:
        message, param = validation_message(err.errors())
        raise BadRequest(message, param=param) from None
    if not served.knows(body.model):
        raise BadRequest(
            f"the model '{body.model}' does not exist here: this server serves '{served.name}' (see GET /v1/models)",
            404,
            param="model",
            code="model_not_found",
        )
    problem = body.unsupported()
    if problem:
        raise problem
    return body


def _prompt_list(prompt) -> list:
    """One or several prompts: a string, token ids, or a list of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise BadRequest("'prompt' is empty", param="prompt")
    return list(prompt)


def _token_ids(tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if any(not 0 <= t < len(tokenizer) for t in prompt):
        raise BadRequest(f"'prompt' holds token ids outside the vocabulary (0..{len(tokenizer) - 1})", param="prompt")
    return prompt


def _budget(served: ServedModel, prompt_tokens: int, asked: int | None) -> int:
    """The completion's token budget, refusing what does not fit the model's context."""
    if prompt_tokens == 0:
        raise BadRequest("the prompt is empty: send at least one token", param="prompt")
    context = served.context_length
    if context is None:
        return asked or served.max_tokens
    if prompt_tokens >= context or (asked and prompt_tokens + asked > context):
        raise BadRequest(
            f"this model's maximum context length is {context} tokens; the request has {prompt_tokens} prompt "
            f"tokens and asks for {asked or 1} more: shorten the prompt or lower max_tokens",
            param="messages" if asked is None else "max_tokens",
            code="context_length_exceeded",
        )
    return asked or min(served.max_tokens, context - prompt_tokens)


async def _complete(
    request: Request, engine: Engine, served: ServedModel, body, prompts: list[list[int]], chat: bool
) -> Response:
    asked = body.token_budget() if chat else body.max_tokens
    budgets = [_budget(served, len(p), asked) for p in prompts]
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    sampling, n = body.sampling(), body.choices()
    # Choice i * n + k is prompt i's k-th sample: sample index k under the request's seed.
    requests = [
        EngineRequest(
            p,
            b,
            (lambda ev, c=i * n + k: loop.call_soon_threadsafe(events.put_nowait, (c, ev))),
            body.stops(),
            (sampling, k),
        )
        for i, (p, b) in enumerate(zip(prompts, budgets))
        for k in range(n)
    ]
    try:
        for r in requests:
            engine.submit(r)
    except QueueFull as err:
        for r in requests:
            engine.cancel(r)
        raise BadRequest(f"the server is busy: {err}; retry later", 429, "rate_limit_error") from None
    reply = _Reply(served.name, chat, [len(p) for p in prompts], engine.config.method)
    if body.stream:
        stream = _stream(reply, requests, events, engine, body.include_usage())
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        texts, ends = [""] * len(requests), [None] * len(requests)
        while None in ends:
            next_event = asyncio.ensure_future(events.get())
            await asyncio.wait({next_event, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not next_event.done():
                next_event.cancel()
                return Response(status_code=499)  # nobody is listening: the finally below frees the rows
            i, event = next_event.result()
            texts[i] += event.text
            if event.finish_reason:
                ends[i] = event
    finally:
        gone.cancel()
        for r in requests:
            engine.cancel(r)
    failed = next((e for e in ends if e.finish_reason == "error"), None)
    if failed:
        return JSONResponse(BadRequest(f"decoding failed: {failed.error}", 500, "server_error").body(), 500)
    return JSONResponse(reply.whole(texts, ends))


async def _stream(
    reply: _Reply, requests: list, events: asyncio.Queue, engine: Engine, include_usage: bool
) -> AsyncIterator[str]:
    ends: list[Event | None] = [None] * len(requests)
    try:
        if reply.chat:
            for i in range(len(requests)):
                yield _sse(reply.chunk(i, {"role": "assistant", "content": ""}))
        while None in ends:
            i, event = await events.get()
            if event.finish_reason == "error":
                yield _sse(BadRequest(f"decoding failed: {event.error}", 500, "server_error").body())
                return
            if event.text:
                yield _sse(reply.chunk(i, event.text))
            if event.finish_reason:
                ends[i] = event
                yield _sse(reply.chunk(i, None, event.finish_reason))
        if include_usage:
            yield _sse(reply.chunk(None, None) | {"usage": reply.usage(ends)})
        yield "data: [DONE]\n\n"
    finally:  # also when the client disconnects: its rows leave the batch before the next forward
        for r in requests:
            engine.cancel(r)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is read already: what `receive` gives next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _Reply:
    """OpenAI response and chunk objects for one request."""

    def __init__(self, model: str, chat: bool, prompt_tokens: list[int], method: str):
        self.model, self.chat, self.prompt_tokens, self.method = model, chat, prompt_tokens, method
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, ends: list[Event]) -> dict:
        completion = sum(e.completion_tokens for e in ends)
        prompt = sum(self.prompt_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def decoding(self, ends: list[Event]) -> dict:
        """How the completion was decoded: the speed figure a client can check (TPF, prefill excluded)."""
        tokens, forwards = sum(e.completion_tokens for e in ends), sum(e.forwards for e in ends)
        return {"method": self.method, "forwards": forwards, "tokens_per_forward": tokens / max(forwards, 1)}

    def whole(self, texts: list[str], ends: list[Event]) -> dict:
        if self.chat:
            choices = [
                {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": e.finish_reason}
                for i, (t, e) in enumerate(zip(texts, ends))
            ]
            head = self._head("chat.completion")
        else:
            choices = [
                {"index": i, "text": t, "finish_reason": e.finish_reason, "logprobs": None}
                for i, (t, e) in enumerate(zip(texts, ends))
            ]
            head = self._head("text_completion")
        return head | {"choices": choices, "usage": self.usage(ends), "decoding": self.decoding(ends)}

    def chunk(self, index: int | None, delta: str | dict | None, finish_reason: str | None = None) -> dict:
        if index is None:  # the closing usage chunk
            return self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": []}
        if self.chat:
            content = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": index, "delta": content, "finish_reason": finish_reason}
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": index, "text": delta or "", "finish_reason": finish_reason, "logprobs": None}
        return self._head("text_completion") | {"choices": [choice]}
