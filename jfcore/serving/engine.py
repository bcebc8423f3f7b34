"""The serving engine: one thread decodes a batch of rows (`Scheduler`); requests join it at the next forward.

Handlers on the server's event loop `submit` requests and get their text back through the request's
`deliver` callback (called on the engine thread: hand it to the loop with `call_soon_threadsafe`). Between two
forwards the engine admits waiting requests (up to `max_batch_size` rows), drops cancelled ones, runs one
forward for every row and sends each request the text its new tokens complete. Every committed token is the
model's own choice for that row (greedy, or sampled with the row's own keyed noise), so a response never depends
on what else is in the batch (docs/SERVING.md).
"""

from __future__ import annotations

import copy
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from jfcore.decoding import DecodeConfig, special_tokens
from jfcore.decoding.decoder import Decoder
from jfcore.decoding.row import Row
from jfcore.decoding.sampling import GREEDY, Sampling
from jfcore.serving.metrics import ServingMetrics


class QueueFull(RuntimeError):
    """More requests wait than the engine's queue holds."""


@dataclass(frozen=True)
class Event:
    """What a request receives: new text, and at the end why it finished and what it cost."""

    text: str
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "cancelled", "error"
    completion_tokens: int = 0
    forwards: int = 0  # decode forwards this request's row took part in
    error: str | None = None


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    deliver: Callable[[Event], None]
    stop: Sequence[str] = ()
    sampling: tuple[Sampling, int] = (GREEDY, 0)  # its settings and sample index (one per choice)
    cancelled: bool = False  # set by the handler (client gone); the engine drops the row before its next forward
    submitted: float = field(default_factory=time.perf_counter)
    row: Row | None = None
    text: TextStream | None = None
    first_token_at: float | None = None


class TextStream:
    """Incremental detokenization: the text a request's tokens complete, with stop strings cut.

    The whole token list is decoded each time, so multi-token characters and merged spaces come out as the
    final text has them. A trailing partial character (U+FFFD) and any tail that could still grow into a stop
    string are held back until they are decided."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.sent = ""
        self.stopped = False

    def update(self, tokens: list[int], final: bool) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            text, final, self.stopped = text[: min(hits)], True, True
        if not final:
            hold = max((len(s) - 1 for s in self.stop), default=0)
            text = text[: len(text) - hold] if hold else text
            text = text.rstrip("\ufffd")
        if not text.startswith(self.sent):  # a tokenizer that rewrote earlier text: send only what is new
            text = self.sent if len(text) < len(self.sent) else self.sent + text[len(self.sent) :]
        delta, self.sent = text[len(self.sent) :], max(text, self.sent, key=len)
        return delta


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        config: DecodeConfig,
        *,
        max_batch_size: int = 16,
        max_queue: int = 64,
        metrics: ServingMetrics | None = None,
    ):
        eos, pad = special_tokens(model, None, tokenizer.pad_token_id)
        # Its own copy: a fast tokenizer used from two threads at once can fail ("Already borrowed").
        self.tokenizer = copy.deepcopy(tokenizer)
        self.config = config
        self.decoder = Decoder(model, config, eos, pad)
        self.live = self.decoder.scheduler()
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.metrics = metrics or ServingMetrics()
        self._waiting: deque[Request] = deque()
        self._serving: list[Request] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="jf-engine", daemon=True)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def submit(self, request: Request) -> None:
        """Queue a request; it joins the batch at the next forward with room. Raises QueueFull."""
        with self._wake:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (the queue holds {self.max_queue})")
            request.text = TextStream(self.tokenizer, request.stop)
            self._waiting.append(request)
            self.metrics.queue_depth.set(len(self._waiting))
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        request.cancelled = True
        with self._wake:
            self._wake.notify()

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._waiting or self._serving):
                    self._wake.wait()
                if self._stopping:
                    break
                joining = []
                while self._waiting and len(self._serving) + len(joining) < self.max_batch_size and self.live.joinable:
                    joining.append(self._waiting.popleft())
                self.metrics.queue_depth.set(len(self._waiting))
            try:
                self._admit([r for r in joining if not self._drop_cancelled(r)])
                gone = [r for r in self._serving if r.cancelled]
                if gone:
                    self.live.remove([r.row for r in gone])
                    for request in gone:
                        self._finish(request, "cancelled")
                if self._serving:
                    self.live.step()
                    self.metrics.forward_passes.inc()
                    for request in list(self._serving):
                        self._publish(request)
                self.metrics.batch_size.set(len(self._serving))
            except Exception as err:  # noqa: BLE001 (a failed forward ends the batch's requests, not the server)
                traceback.print_exc()
                unadmitted = [r for r in joining if r.row is None and not r.cancelled]
                self._fail([*self._serving, *unadmitted], f"{type(err).__name__}: {err}")
                self.live = self.decoder.scheduler()
        with self._wake:
            waiting, self._waiting = list(self._waiting), deque()
        self._fail([*self._serving, *waiting], "the server is shutting down")

    def _drop_cancelled(self, request: Request) -> bool:
        if request.cancelled:
            self._finish(request, "cancelled")
        return request.cancelled

    def _admit(self, joining: list[Request]) -> None:
        if not joining:
            return
        rows = self.live.add(
            [r.prompt for r in joining], [r.max_tokens for r in joining], [r.sampling for r in joining]
        )
        for request, row in zip(joining, rows):
            request.row = row
            self._serving.append(request)
            self.metrics.prompt_tokens.inc(len(request.prompt))
            self.metrics.shared_prefix_tokens.inc(row.shared_tokens)
            self._publish(request)

    def _publish(self, request: Request) -> None:
        """Send the request the text its new tokens complete; finish it at EOS, its budget or a stop string."""
        row = request.row
        delta = request.text.update(row.out, final=row.finished)
        if row.out and request.first_token_at is None:
            request.first_token_at = time.perf_counter()
            self.metrics.time_to_first_token.observe(request.first_token_at - request.submitted)
        if request.text.stopped and not row.finished:
            self.live.remove([row])
        if delta:
            request.deliver(Event(delta))
        if request.text.stopped:
            self._finish(request, "stop")
        elif row.finished:
            ended_with_eos = bool(row.out) and row.out[-1] in self.decoder.eos
            self._finish(request, "stop" if ended_with_eos else "length")

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        if request in self._serving:
            self._serving.remove(request)
        row = request.row
        tokens, forwards = (len(row.out), row.forwards) if row else (0, 0)
        self.metrics.finished(reason, tokens, forwards, time.perf_counter() - request.submitted)
        request.deliver(Event("", reason, tokens, forwards, error))

    def _fail(self, requests: list[Request], message: str) -> None:
        for request in requests:
            self._finish(request, "error", message)
