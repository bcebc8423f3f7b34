"""Serving benchmark: jf-serve under 1, 4 and 16 concurrent clients, AR against Jacobi decoding, for the base
model and (where given) a trained checkpoint, in ONE interleaved run.

One real server process per (model, method) is started up front; then, for every repeat and every
concurrency level, each server in turn gets the same requests from N client threads (the real `openai`
client, streaming chat completions). Servers wait idle while another is measured, so the host's speed drift
hits all of them alike.

    python -m bench.serve_bench --trained runs/campaign-cpu-long/train/final
    python -m bench.serve_bench --clients 1 4 --requests-per-client 1 --max-tokens 32   # a quick look

Columns (per model, method and concurrency): requests, completion tokens, total tokens/s (all tokens over the
round's wall time), p50/p95 request latency, p50/p95 time to first token, mean TPF (the server's own count:
completion tokens / row-forwards, prefill excluded) and speedup in tokens/s over AR on the same model and
concurrency. `same_as_ar` counts responses whose text equals AR's for the same prompt (greedy: all should).
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

from jfcore.paths import eval_prompts
from tasks.serve_process import jf_serve, prometheus_value

RESULTS = Path(__file__).resolve().parent / "results"


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
    speedup_vs_ar: float | None = None
    same_as_ar: int | None = None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_request(client: openai.OpenAI, model: str, text: str, max_tokens: int) -> tuple[str, float, float]:
    """(text, latency, time to first token) of one streamed chat completion."""
    start = time.perf_counter()
    first = None
    pieces = []
    for chunk in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, stream=True
    ):
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                pieces.append(choice.delta.content)
    end = time.perf_counter()
    return "".join(pieces), end - start, (first or end) - start


def measure(url: str, served: str, prompts: list[str], clients: int, per_client: int, max_tokens: int):
    """One round: `clients` threads, each sending `per_client` requests one after another."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=1800)
    tokens0, forwards0 = (prometheus_value(url, n) for n in ("jf_completion_tokens_total", "jf_row_forwards_total"))
    jobs = [[prompts[(c * per_client + k) % len(prompts)] for k in range(per_client)] for c in range(clients)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda texts: [one_request(client, served, t, max_tokens) for t in texts], jobs))
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
    p.add_argument("--out", type=Path, help="JSON results (default bench/results/serve-<time>.json)")
    args = p.parse_args(argv)
    if "ar" not in args.methods:
        p.error("--methods must include ar: speedups are relative to it")

    texts = [*eval_prompts("gsm8k", limit=8), *eval_prompts("humaneval", limit=8)]
    models = {"base": args.base} | ({"trained": args.trained} if args.trained else {})
    work = RESULTS / "serve-logs"
    rounds: list[Round] = []
    with contextlib.ExitStack() as stack:
        servers = {}
        for label, model in models.items():
            for method in args.methods:
                extra = ["--block-size", str(args.block_size)] if args.block_size else []
                command = ["--model", model, "--served-model-name", label, "--method", method, *extra]
                command += ["--max-batch-size", str(max(args.clients))]
                servers[label, method] = stack.enter_context(jf_serve(work, *command))
                print(f"server up: {label} ({model}) {method}", flush=True)
        for (label, _), url in servers.items():  # warm-up: first calls pay one-off costs
            measure(url, label, texts, 1, 1, 8)
        pooled: dict[tuple, list] = {}
        for repeat in range(args.repeats):
            for clients in args.clients:
                order = list(servers)
                shift = (repeat + clients) % len(order)
                for label, method in order[shift:] + order[:shift]:
                    stats, answers = measure(
                        servers[label, method], label, texts, clients, args.requests_per_client, args.max_tokens
                    )
                    pooled.setdefault((label, method, clients), []).append((stats, answers))
                    print(f"  {label} {method} x{clients}: {stats['tokens_per_second']:.1f} tok/s", flush=True)
    for (label, method, clients), runs in sorted(pooled.items(), key=lambda item: (item[0][0], item[0][2])):
        stats = {k: statistics.mean(s[k] for s, _ in runs) for k in runs[0][0]}
        stats["requests"], stats["completion_tokens"] = (
            int(sum(s[k] for s, _ in runs)) for k in ("requests", "completion_tokens")
        )
        rounds.append(Round(label, method, clients, **stats))
    for r in rounds:
        ar = next(x for x in rounds if (x.model, x.method, x.clients) == (r.model, "ar", r.clients))
        r.speedup_vs_ar = r.tokens_per_second / ar.tokens_per_second
        mine, theirs = pooled[r.model, r.method, r.clients], pooled[r.model, "ar", r.clients]
        r.same_as_ar = sum(a == b for (_, x), (_, y) in zip(mine, theirs) for a, b in zip(x, y))

    header = "model    method      clients  reqs  tokens  tok/s   p50 lat  p95 lat  p50 TTFT  p95 TTFT  TPF   speedup  same_as_ar"
    print("\n" + header)
    for r in rounds:
        print(
            f"{r.model:<8} {r.method:<11} {r.clients:>7} {r.requests:>5} {r.completion_tokens:>7} "
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
