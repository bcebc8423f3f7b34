"""Serving benchmark: jf-serve under 1, 4 and 16 concurrent clients, AR against Jacobi decoding, for the base
model and (where given) a trained checkpoint, in ONE interleaved run.

One real server process per (model, method) is started up front; then, for every repeat and every
concurrency level, each server in turn gets the same requests from N client threads (the real `openai`
client, streaming chat completions). Servers wait idle while another is measured, so the host's speed drift
hits all of them alike.

    python -m bench.serve_bench --trained runs/campaign-cpu-long/train/final
    python -m bench.serve_bench --clients 1 4 --requests-per-client 1 --max-tokens 32   # a quick look
    python -m bench.serve_bench --clients 16 --system-examples 4 --share-prefix-tokens 0 64   # one system prompt

Columns (per model, method and concurrency): requests, completion tokens, total tokens/s (all tokens over the
round's wall time), p50/p95 request latency, p50/p95 time to first token, mean TPF (the server's own count:
completion tokens / row-forwards, prefill excluded) and speedup in tokens/s over AR on the same model and
concurrency. `same_as_ar` counts responses whose text equals AR's for the same prompt (greedy: all should).
`--system-examples N` gives every request one system prompt (N solved GSM8K train problems);
`--share-prefix-tokens` values each get their own servers (`share` column: the server's setting), so shared
and per-row prompt prefixes are measured side by side; speedups and `same_as_ar` compare with AR at the same
setting, and the JSON's `same_as_first_share` counts responses equal to the first setting's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import openai

from bench.common import RESULTS, few_shot_system
from jfcore.paths import default_data_dir, eval_prompts
from tests.support.serve_process import jf_serve, prometheus_value


@dataclass
class Round:
    model: str
    method: str
    clients: int
    requests: int
    completion_tokens: int
    seconds: float
    tokens_per_second: float
    latency_p50: float
    latency_p95: float
    ttft_p50: float
    ttft_p95: float
    tpf: float
    share: int | None = None  # the server's --share-prefix-tokens (None: its default)
    speedup_vs_ar: float | None = None
    same_as_ar: int | None = None
    same_as_first_share: int | None = None  # responses equal to the first --share-prefix-tokens setting's


def equal_answers(mine: list, theirs: list) -> int:
    """Responses of two settings' pooled runs (each a list of (stats, answers)) that are equal, prompt by prompt."""
    return sum(a == b for (_, x), (_, y) in zip(mine, theirs) for a, b in zip(x, y))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_request(
    client: openai.OpenAI, model: str, text: str, max_tokens: int, system: str | None = None
) -> tuple[str, float, float]:
    """(text, latency, time to first token) of one streamed chat completion."""
    start = time.perf_counter()
    first = None
    pieces = []
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                pieces.append(choice.delta.content)
    end = time.perf_counter()
    return "".join(pieces), end - start, (first or end) - start


def measure(
    url: str, served: str, prompts: list[str], clients: int, per_client: int, max_tokens: int, system: str | None
):
    """One round: `clients` threads, each sending `per_client` requests one after another."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=1800)
    tokens0, forwards0 = (prometheus_value(url, n) for n in ("jf_completion_tokens_total", "jf_row_forwards_total"))
    jobs = [[prompts[(c * per_client + k) % len(prompts)] for k in range(per_client)] for c in range(clients)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda texts: [one_request(client, served, t, max_tokens, system) for t in texts], jobs))
    seconds = time.perf_counter() - start
    tokens = prometheus_value(url, "jf_completion_tokens_total") - tokens0
    forwards = prometheus_value(url, "jf_row_forwards_total") - forwards0
    results = [r for client_results in done for r in client_results]
    texts = [t for t, _, _ in results]
    latencies, ttfts = [r[1] for r in results], [r[2] for r in results]
    stats = {
        "requests": len(results),
        "completion_tokens": int(tokens),
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "latency_p50": percentile(latencies, 0.5),
        "latency_p95": percentile(latencies, 0.95),
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p95": percentile(ttfts, 0.95),
        "tpf": tokens / max(forwards, 1),
    }
    return stats, texts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="smollm2-135m-instruct", help="the base model (preset, folder, ...)")
    p.add_argument("--trained", help="a trained checkpoint folder to serve beside the base model")
    p.add_argument("--methods", nargs="+", default=["ar", "jacobi"], choices=["ar", "jacobi", "multiblock"])
    p.add_argument("--block-size", type=int, help="Jacobi block size (default: each model's trained size, else 16)")
    p.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds per setting (figures are pooled)")
    p.add_argument("--system-examples", type=int, default=0, help="a system prompt of N solved GSM8K problems")
    p.add_argument(
        "--share-prefix-tokens", nargs="+", type=int, help="jf-serve settings to compare (default: its default only)"
    )
    p.add_argument("--out", type=Path, help="JSON results (default bench/results/serve-<time>.json)")
    args = p.parse_args(argv)
    if "ar" not in args.methods:
        p.error("--methods must include ar: speedups are relative to it")

    texts = [*eval_prompts("gsm8k", limit=8), *eval_prompts("humaneval", limit=8)]
    system = few_shot_system(args.system_examples, default_data_dir()) if args.system_examples else None
    shares = args.share_prefix_tokens or [None]
    models = {"base": args.base} | ({"trained": args.trained} if args.trained else {})
    work = RESULTS / "serve-logs"
    rounds: list[Round] = []
    with contextlib.ExitStack() as stack:
        servers = {}
        for label, model in models.items():
            for method in args.methods:
                for share in shares:
                    extra = ["--block-size", str(args.block_size)] if args.block_size else []
                    extra += ["--share-prefix-tokens", str(share)] if share is not None else []
                    command = ["--model", model, "--served-model-name", label, "--method", method, *extra]
                    command += ["--max-batch-size", str(max(args.clients))]
                    servers[label, method, share] = stack.enter_context(jf_serve(work, *command))
                    print(f"server up: {label} ({model}) {method} share {share}", flush=True)
        for (label, _, _), url in servers.items():  # warm-up: first calls pay one-off costs
            measure(url, label, texts, 1, 1, 8, system)
        pooled: dict[tuple, list] = {}
        for repeat in range(args.repeats):
            for clients in args.clients:
                order = list(servers)
                shift = (repeat + clients) % len(order)
                for label, method, share in order[shift:] + order[:shift]:
                    stats, answers = measure(
                        servers[label, method, share],
                        label,
                        texts,
                        clients,
                        args.requests_per_client,
                        args.max_tokens,
                        system,
                    )
                    pooled.setdefault((label, method, share, clients), []).append((stats, answers))
                    print(f"  {label} {method} share {share} x{clients}: {stats['tokens_per_second']:.1f} tok/s")
    for (label, method, share, clients), runs in sorted(pooled.items(), key=lambda item: (item[0][0], item[0][3])):
        stats = {k: statistics.mean(s[k] for s, _ in runs) for k in runs[0][0]}
        stats["requests"], stats["completion_tokens"] = (
            int(sum(s[k] for s, _ in runs)) for k in ("requests", "completion_tokens")
        )
        rounds.append(Round(label, method, clients, **stats, share=share))
    for r in rounds:
        same = (r.model, "ar", r.share, r.clients)
        ar = next(x for x in rounds if (x.model, x.method, x.share, x.clients) == same)
        r.speedup_vs_ar = r.tokens_per_second / ar.tokens_per_second
        mine, theirs = pooled[r.model, r.method, r.share, r.clients], pooled[same]
        r.same_as_ar = equal_answers(mine, theirs)
        if len(shares) > 1:
            r.same_as_first_share = equal_answers(mine, pooled[r.model, r.method, shares[0], r.clients])

    header = "model    method      share clients  reqs  tokens  tok/s   p50 lat  p95 lat  p50 TTFT  p95 TTFT  TPF   speedup  same_as_ar"
    print("\n" + header)
    for r in rounds:
        print(
            f"{r.model:<8} {r.method:<11} {r.share!s:>5} {r.clients:>7} {r.requests:>5} {r.completion_tokens:>7} "
            f"{r.tokens_per_second:>6.1f} {r.latency_p50:>8.2f} {r.latency_p95:>8.2f} {r.ttft_p50:>9.2f} "
            f"{r.ttft_p95:>9.2f} {r.tpf:>5.2f} {r.speedup_vs_ar:>7.2f}x {r.same_as_ar:>5}/{r.requests}"
        )
    out = args.out or RESULTS / f"serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    host = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": sys.version.split()[0]}
    out.write_text(json.dumps({"settings": settings, "host": host, "rounds": [asdict(r) for r in rounds]}, indent=2))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
