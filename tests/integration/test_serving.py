"""jf-serve as a real process, spoken to with the real `openai` client: every response equals the model's
greedy `generate` output whatever shares the batch, sampled responses equal sequential sampling with the same
seed (n choices, one sample index each), streamed text equals the whole text, a client that goes away (streamed
or not) frees its row within a second, bad requests get OpenAI-shaped errors, and the API key is enforced."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from jfcore.decoding.reference import sample_sequentially
from jfcore.decoding.sampling import Sampling
from jfcore.models import ModelConfig, load_model
from tests.support.serve_process import jf_serve, prometheus_value
from tests.support.tiny_models import TINY_CHAT_TEMPLATE, save_tiny_checkpoint

KEY = "test-key-3f9a"
NAME = "tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # A wide init: peaked logits, so batching's float32 rounding cannot flip a greedy argmax by accident.
    folder = save_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny") / "ck", initializer_range=0.3, chat_template=TINY_CHAT_TEMPLATE
    )
    return folder, *load_model(ModelConfig(name_or_path=str(folder)))


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    folder, _, _ = tiny
    # A rolling window: the widest per-row state the batch scheduler has to carry between requests.
    args = ["--model", str(folder), "--served-model-name", NAME, "--method", "jacobi", "--block-size", "4", "--rolling"]
    with jf_serve(tmp_path_factory.mktemp("serve"), *args, "--max-batch-size", "8", api_key=KEY) as url:
        yield url


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def greedy_text(model, tokenizer, prompt_ids: list[int], max_tokens: int) -> tuple[str, int]:
    """The text and token count `generate(do_sample=False)` gives (float32, one unpadded prompt)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
    new = out[0, len(prompt_ids) :].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id) + 1]
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
    )


def ask(c: openai.OpenAI, kind: str, text: str, max_tokens: int, stream: bool) -> tuple[str, int | None]:
    """One request through the openai client; streamed chunks are concatenated."""
    if kind == "chat":
        messages = [{"role": "user", "content": text}]
        if not stream:
            reply = c.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens, temperature=0)
            return reply.choices[0].message.content, reply.usage.completion_tokens
        chunks = c.chat.completions.create(
            model=NAME, messages=messages, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}
        )
        pieces, usage = [], None
        for chunk in chunks:
            pieces += [ch.delta.content or "" for ch in chunk.choices]
            usage = chunk.usage.completion_tokens if chunk.usage else usage
        return "".join(pieces), usage
    if not stream:
        reply = c.completions.create(model=NAME, prompt=text, max_tokens=max_tokens)
        return reply.choices[0].text, reply.usage.completion_tokens
    chunks = c.completions.create(model=NAME, prompt=text, max_tokens=max_tokens, stream=True)
    return "".join(chunk.choices[0].text for chunk in chunks), None


def words(n: int, start: int = 6) -> str:
    return " ".join(f"w{start + (7 * i) % 100}" for i in range(n))


def test_concurrent_requests_each_equal_greedy(server, tiny):
    """8 concurrent requests of different lengths (completions and chat, streamed and not) share the batch;
    each equals its own greedy output, and the forwards really were shared."""
    _, model, tokenizer = tiny
    cases = [
        (kind, words(3 + 5 * i, start=6 + i), 20 + 25 * i, stream)
        for i, (kind, stream) in enumerate([(k, s) for k in ("completion", "chat") for s in (False, True)] * 2)
    ]
    rows_before = prometheus_value(server, "jf_row_forwards_total", KEY)
    calls_before = prometheus_value(server, "jf_forward_passes_total", KEY)
    c = client(server)
    with ThreadPoolExecutor(len(cases)) as pool:
        replies = list(pool.map(lambda case: ask(c, *case), cases))
    for (kind, text, max_tokens, stream), (got, count) in zip(cases, replies):
        ids = chat_ids(tokenizer, text) if kind == "chat" else tokenizer(text)["input_ids"]
        expected, expected_count = greedy_text(model, tokenizer, ids, max_tokens)
        assert got == expected, (kind, stream, max_tokens)
        assert count in (None, expected_count)
    rows = prometheus_value(server, "jf_row_forwards_total", KEY) - rows_before
    calls = prometheus_value(server, "jf_forward_passes_total", KEY) - calls_before
    assert calls < rows, f"{calls} forward calls served {rows} row-forwards: the requests never shared a batch"


def test_requests_opening_alike_share_their_prefix_and_each_equal_greedy(server, tiny):
    """Concurrent completions opening with one long text (a system prompt) read its KV from a shared prefix, made
    from the first admitted row's cache (the metric counts the prompt tokens not prefilled), and each still
    equals its own greedy output."""
    _, model, tokenizer = tiny
    opening = words(90, start=11)
    texts = [f"{opening} {words(2 + 3 * i, start=40 + i)}" for i in range(6)]
    lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
    common = len(tokenizer(opening)["input_ids"])
    assert common >= 64
    shared_before = prometheus_value(server, "jf_shared_prefix_tokens_total", KEY)
    c = client(server)
    first = c.completions.create(model=NAME, prompt=texts[0], max_tokens=60, stream=True)  # admitted alone
    pieces = [next(iter(first)).choices[0].text]
    with ThreadPoolExecutor(len(texts) - 1) as pool:
        replies = list(pool.map(lambda t: ask(c, "completion", t, 30, False), texts[1:]))
        pieces += [chunk.choices[0].text for chunk in first]
    shared = prometheus_value(server, "jf_shared_prefix_tokens_total", KEY) - shared_before
    assert common <= shared < sum(lengths[1:])  # shared by some (by all 5 unless the first finished too soon)
    assert "".join(pieces) == greedy_text(model, tokenizer, tokenizer(texts[0])["input_ids"], 60)[0]
    for text, (got, _) in zip(texts[1:], replies):
        assert got == greedy_text(model, tokenizer, tokenizer(text)["input_ids"], 30)[0]


def test_streamed_chunks_concatenate_to_the_whole_text(server):
    c = client(server)
    for kind in ("completion", "chat"):
        whole, _ = ask(c, kind, words(9), 60, stream=False)
        streamed, _ = ask(c, kind, words(9), 60, stream=True)
        assert streamed == whole and whole


def test_stop_sequences_cut_the_text(server, tiny):
    _, model, tokenizer = tiny
    text = words(5)
    full, _ = greedy_text(model, tokenizer, tokenizer(text)["input_ids"], 40)
    stop = full.split()[3]  # a word the greedy output reaches
    reply = client(server).completions.create(model=NAME, prompt=text, max_tokens=40, stop=[stop])
    assert reply.choices[0].text == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_client_that_disconnects_mid_stream_leaves_the_others_correct(server, tiny):
    _, model, tokenizer = tiny
    cancelled_before = prometheus_value(server, 'jf_requests_total{finish_reason="cancelled"}', KEY)
    others = [words(4 + i, start=20 + i) for i in range(3)]
    c = client(server)

    def leave_early() -> int:
        body = {"model": NAME, "prompt": words(6), "max_tokens": 1900, "stream": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        seen = 0
        with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers, timeout=60) as r:
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break  # leaving the block closes the connection mid-stream
        return seen

    with ThreadPoolExecutor(4) as pool:
        leaving = pool.submit(leave_early)
        replies = list(pool.map(lambda t: ask(c, "completion", t, 80, stream=True), others))
        assert leaving.result() == 3
    for text, (got, _) in zip(others, replies):
        assert got == greedy_text(model, tokenizer, tokenizer(text)["input_ids"], 80)[0]
    deadline = time.time() + 30
    cancelled = lambda: prometheus_value(server, 'jf_requests_total{finish_reason="cancelled"}', KEY)
    while cancelled() == cancelled_before or prometheus_value(server, "jf_batch_size", KEY) != 0:
        assert time.time() < deadline, "the disconnected stream's row was never cancelled and removed"
        time.sleep(0.2)
    assert ask(c, "completion", words(3), 10, stream=False)[0]  # and the server still serves


def test_sampled_choices_equal_sequential_sampling_and_repeat_with_their_seed(server, tiny):
    """temperature, top_p, top_k, seed and n through the openai client: each of the n choices is the prompt's
    sequential sample with sample index = its choice index; the same seed gives the same choices again, another
    seed other ones; streamed choices equal the whole ones."""
    _, model, tokenizer = tiny
    c = client(server)
    messages = [{"role": "user", "content": words(5)}]
    extra = {"top_k": 40}

    def choices(seed: int, stream: bool = False) -> list[str]:
        kwargs = {"model": NAME, "messages": messages, "max_tokens": 24, "temperature": 1.6, "top_p": 0.95}
        kwargs |= {"seed": seed, "n": 3}
        if not stream:
            reply = c.chat.completions.create(**kwargs, extra_body=extra)
            assert [ch.index for ch in reply.choices] == [0, 1, 2]
            return [ch.message.content for ch in reply.choices]
        texts = [""] * 3
        for chunk in c.chat.completions.create(**kwargs, stream=True, extra_body=extra):
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
        return texts

    first = choices(7)
    ids = chat_ids(tokenizer, words(5))
    settings = Sampling(temperature=1.6, top_k=40, top_p=0.95, seed=7)
    for k, text in enumerate(first):
        tokens = sample_sequentially(model, ids, 24, settings, k, [tokenizer.eos_token_id])
        assert text == tokenizer.decode(tokens, skip_special_tokens=True), k
    assert len(set(first)) > 1  # the choices are different samples
    assert choices(7) == first and choices(7, stream=True) == first
    assert choices(8) != first
    greedy = greedy_text(model, tokenizer, ids, 24)[0]
    reply = c.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0, seed=3, top_p=0.5)
    assert reply.choices[0].message.content == greedy  # temperature 0: top_p and seed change nothing


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_frees_its_row_within_a_second(server, stream):
    """A request whose client closes the connection mid-decode, streamed or not: its row leaves the batch within
    1 s of the close."""
    cancelled_before = prometheus_value(server, 'jf_requests_total{finish_reason="cancelled"}', KEY)
    body = {"model": NAME, "prompt": words(6), "max_tokens": 1900, "stream": stream}
    headers = {"Authorization": f"Bearer {KEY}"}
    if stream:
        with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers, timeout=60) as r:
            for seen, _ in enumerate(line for line in r.iter_lines() if line.startswith("data: ")):
                if seen == 2:
                    break  # leaving the block closes the connection mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting and closes its connection
            httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=1.0)
    closed = time.time()
    cancelled = lambda: prometheus_value(server, 'jf_requests_total{finish_reason="cancelled"}', KEY)
    while cancelled() == cancelled_before or prometheus_value(server, "jf_batch_size", KEY) != 0:
        assert time.time() - closed < 1.0, "the gone client's row was still in the batch a second after it left"
        time.sleep(0.05)


def post(url: str, body: bytes, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize(
    ("body", "status", "words_in_message", "code"),
    [
        ({"model": NAME}, 400, "'prompt' is required", None),
        ({"prompt": "w1"}, 400, "'model' is required", None),
        ({"model": "gpt-4", "prompt": "w1"}, 404, "does not exist", "model_not_found"),
        ({"model": NAME, "prompt": words(2100)}, 400, "maximum context length is 2048", "context_length_exceeded"),
        ({"model": NAME, "prompt": "w1", "max_tokens": 2048}, 400, "maximum context length", "context_length_exceeded"),
        ({"model": NAME, "prompt": "w1", "temperature": -0.1}, 400, "'temperature': Input should be greater", None),
        ({"model": NAME, "prompt": "w1", "temperature": 2.5}, 400, "'temperature': Input should be less", None),
        ({"model": NAME, "prompt": "w1", "top_p": 0}, 400, "'top_p': Input should be greater than 0", None),
        ({"model": NAME, "prompt": "w1", "top_p": 1.5}, 400, "'top_p': Input should be less", None),
        ({"model": NAME, "prompt": "w1", "top_k": -1}, 400, "'top_k': Input should be greater", None),
        ({"model": NAME, "prompt": "w1", "n": 0}, 400, "'n': Input should be greater", None),
        ({"model": NAME, "prompt": "w1", "n": 17}, 400, "'n': Input should be less than or equal to 16", None),
        ({"model": NAME, "prompt": "w1", "seed": "x"}, 400, "'seed'", None),
        ({"model": NAME, "prompt": "w1", "best_of": 3}, 400, "best_of is not supported", None),
        ({"model": NAME, "prompt": "w1", "presence_penalty": 0.5}, 400, "presence_penalty is not supported", None),
        ({"model": NAME, "prompt": "w1", "max_tokens": 0}, 400, "max_tokens", None),
        ({"model": NAME, "prompt": "w1", "frobnicate": True}, 400, "unrecognized request argument: 'frobnicate'", None),
        ({"model": NAME, "prompt": [5, 999]}, 400, "outside the vocabulary", None),
        ({"model": NAME, "prompt": ""}, 400, "prompt is empty", None),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, words_in_message, code):
    got, reply = post(server, json.dumps(body).encode())
    assert got == status
    assert words_in_message in reply["error"]["message"]
    assert reply["error"]["code"] == code and reply["error"]["type"]
    named = [k for k in body if k not in ("model", "prompt")]  # a bad setting: the error names it
    assert reply["error"]["param"] == (named[0] if named and status == 400 else reply["error"]["param"])


def test_malformed_json_and_the_server_keeps_serving(server):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        status, reply = post(server, raw)
        assert status == 400 and ("JSON" in reply["error"]["message"]), raw
    status, reply = post(server, json.dumps({"model": NAME, "prompt": "w1 w2", "max_tokens": 5}).encode())
    assert status == 200 and reply["usage"]["completion_tokens"] == 5


def test_openai_client_sees_the_errors(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="nope", prompt="w1")
    with pytest.raises(openai.BadRequestError, match="'top_p': Input should be greater than 0"):
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "w1"}], temperature=1, top_p=0)


def test_api_key_is_enforced(server):
    assert post(server, json.dumps({"model": NAME, "prompt": "w1"}).encode(), key=None)[0] == 401
    status, reply = post(server, json.dumps({"model": NAME, "prompt": "w1"}).encode(), key="wrong")
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()
    assert [m.id for m in client(server).models.list().data] == [NAME]
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(f"{server}/metrics", timeout=10)
    with urllib.request.urlopen(f"{server}/health", timeout=10) as response:  # open to health checks
        health = json.loads(response.read())
    assert (health["block_size"], health["rolling"]) == (4, True)


def test_full_queue_answers_429(tiny, tmp_path):
    """One row decoding and one waiting fill this server: the next request is turned away, not queued forever."""
    folder, _, _ = tiny
    args = ["--model", str(folder), "--served-model-name", NAME, "--max-batch-size", "1", "--max-queue", "1"]
    with jf_serve(tmp_path, *args) as url:
        body = json.dumps({"model": NAME, "prompt": words(4), "max_tokens": 1800}).encode()
        started = threading.Barrier(6)

        def send():
            started.wait()
            return post(url, body, key=None)

        with ThreadPoolExecutor(6) as pool:
            statuses = sorted(status for status, _ in pool.map(lambda _: send(), range(6)))
        assert statuses[0] == 200 and statuses[-1] == 429, statuses
        assert post(url, body, key=None)[0] == 200  # once the queue drains the server takes work again


@pytest.mark.slow
def test_smollm2_concurrent_chats_equal_greedy(tmp_path):
    """The real model: 8 concurrent chats on real benchmark questions (multiblock, the trained default), each
    the text greedy `generate` gives."""
    from jfcore.chat import encode_chat
    from jfcore.paths import eval_prompts

    texts = [*eval_prompts("gsm8k", limit=3), *eval_prompts("humaneval", limit=3), *eval_prompts("mbpp", limit=2)]
    budgets = [16 + 6 * i for i in range(len(texts))]
    model, tokenizer = load_model(ModelConfig(name_or_path="smollm2-135m-instruct"))
    with jf_serve(tmp_path, "--model", "smollm2-135m-instruct", "--method", "multiblock") as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)

        def chat(i: int) -> str:
            messages = [{"role": "user", "content": texts[i]}]
            if i % 2:
                chunks = c.chat.completions.create(
                    model="smollm2-135m-instruct", messages=messages, max_tokens=budgets[i], stream=True
                )
                return "".join(ch.delta.content or "" for chunk in chunks for ch in chunk.choices)
            reply = c.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=budgets[i])
            return reply.choices[0].message.content

        with ThreadPoolExecutor(len(texts)) as pool:
            replies = list(pool.map(chat, range(len(texts))))
        for text, budget, got in zip(texts, budgets, replies):
            assert got == greedy_text(model, tokenizer, encode_chat(tokenizer, text), budget)[0]
        assert prometheus_value(url, "jf_forward_passes_total") < prometheus_value(url, "jf_row_forwards_total")


def test_serves_the_registry_champion_at_its_trained_block_size(tiny, tmp_path):
    """`--model models:/NAME@champion` fetches the version the alias names from a real MLflow server; the block
    size comes from the model's own jacobi_forcing.json, and its answers are still greedy."""
    from tasks.registry import CHAMPION
    from tasks.tracking import TrackingConfig, client, log_model_by_path, stage_run
    from tests.support.servers import mlflow_server

    folder, model, tokenizer = tiny
    trained = tmp_path / "trained"
    shutil.copytree(folder, trained)
    (trained / "jacobi_forcing.json").write_text(json.dumps({"block_size": 6, "steps": 1}))
    with mlflow_server(tmp_path / "mlflow") as uri:
        tracking = TrackingConfig(uri=uri, experiment="serve-tests", registered_model="jf-serve-tiny")
        run_id = stage_run(tracking, tmp_path / "stage", "training", {})
        version = log_model_by_path(tracking, run_id, trained, tmp_path / "stage")["version"]
        client(tracking).set_registered_model_alias("jf-serve-tiny", CHAMPION, version)
        args = ["--model", "models:/jf-serve-tiny@champion", "--tracking-uri", uri, "--method", "jacobi"]
        with jf_serve(tmp_path / "serve", *args) as url:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
                health = json.loads(response.read())
            assert (health["model"], health["block_size"]) == ("jf-serve-tiny", 6)
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            for name in ("jf-serve-tiny", "models:/jf-serve-tiny@champion", f"models:/jf-serve-tiny/{version}"):
                reply = c.completions.create(model=name, prompt=words(5), max_tokens=30)
                assert reply.choices[0].text == greedy_text(model, tokenizer, tokenizer(words(5))["input_ids"], 30)[0]
    missing = jf_serve_error(["--model", "models:/jf-serve-tiny@champion"], tmp_path)
    assert "MLFLOW_TRACKING_URI" in missing


def jf_serve_error(args: list[str], folder) -> str:
    """What jf-serve prints when it refuses to start (it must exit, not hang)."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    done = subprocess.run(
        [sys.executable, "-m", "cli.serve", *args], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr
    return done.stderr


def test_a_missing_model_is_a_clear_error(tmp_path):
    assert "does not exist" in jf_serve_error(["--model", str(tmp_path / "no-such-checkpoint")], tmp_path).lower()
