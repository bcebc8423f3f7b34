"""Each way of the CPU linear mode on a model's own weight shapes: microseconds of one product, side by side.

    python -m bench.linear_ways                                   # SmolLM2-135M's shapes, rows 1 2 4 8 16 32 128
    python -m bench.linear_ways --rows 1 3 5 8 --rounds 21

For every distinct linear weight shape of the model (its first weight of each shape, float32) and every row count,
the ways of jfcore/decoding/runner/linear.py (torch's `F.linear`, weight first, and the C kernel `rows` where it was
built) take turns over `--rounds` rounds; the median is kept. The weight is hot in cache here, unlike in a whole
forward, where each weight comes from memory once. `--sweep` times that instead: each way multiplies the rows by
every linear weight of the model in turn (the output embedding aside), as a forward's layers do, so the weights
come from memory (`bench.compile_curve` times whole forwards). `--kernels` times `rows` once per C kernel the host
runs (`rows:wide`, 16 lanes, where it has AVX-512; `rows:narrow`, 8 lanes, everywhere). Printed and written to JSON.

    python -m bench.linear_ways --sweep --rows 1 4 8 16 --rounds 15
    python -m bench.linear_ways --sweep --kernels --rows 1 2 4 8 16 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import RESULTS
from jfcore.decoding.runner.linear import WAYS, Way, _rows, rows_kernel
from jfcore.models import ModelConfig, load_model


def _ways(kernels: bool) -> dict[str, Way]:
    """The linear mode's ways; with `kernels`, `rows` once per C kernel this host runs, each switched to for its
    calls alone."""
    if not kernels or _rows is None:
        return dict(WAYS)
    ways = {name: way for name, way in WAYS.items() if name != "rows"}
    for kernel in _rows.kernels():

        def way(x, weight, bias, kernel=kernel):
            with rows_kernel(kernel):
                return WAYS["rows"](x, weight, bias)

        ways[f"rows:{kernel}"] = way
    return ways


@torch.inference_mode()
def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=ModelConfig().name_or_path)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128])
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--sweep", action="store_true", help="every weight in turn, from memory: milliseconds a sweep")
    p.add_argument("--kernels", action="store_true", help="time rows once per C kernel this host runs")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.ways = _ways(args.kernels)
    model, _ = load_model(ModelConfig(name_or_path=args.model, dtype="float32"))
    if args.sweep:
        return _sweep(model, args)
    weights = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weights.setdefault(tuple(module.weight.shape), module.weight)
    generator = torch.Generator().manual_seed(0)
    table: dict[str, dict[str, dict[str, float]]] = {}
    for shape, weight in weights.items():
        for rows in args.rows:
            x = torch.randn(rows, shape[1], generator=generator)
            times = {name: [] for name in args.ways}
            for name, way in args.ways.items():
                way(x, weight, None)  # first-call allocations
            for _ in range(args.rounds):
                for name, way in args.ways.items():
                    start = time.perf_counter()
                    way(x, weight, None)
                    times[name].append(time.perf_counter() - start)
            cell = {name: 1e6 * statistics.median(t) for name, t in times.items()}
            table.setdefault(f"{shape[0]}x{shape[1]}", {})[str(rows)] = cell
            ways = ", ".join(f"{name} {us:.0f}" for name, us in cell.items())
            print(f"{shape[0]}x{shape[1]} rows {rows}: {ways} us", flush=True)
    return _write(args, "linear-ways", {"microseconds": table})


def _sweep(model: torch.nn.Module, args: argparse.Namespace) -> Path:
    output = model.get_output_embeddings()
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not output]
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
    print(f"{len(weights)} weights, {megabytes:.0f} MB", flush=True)
    generator = torch.Generator().manual_seed(0)
    table: dict[str, dict[str, float]] = {}
    for rows in args.rows:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=generator) for w in weights}
        times = {name: [] for name in args.ways}
        for round_ in range(args.rounds + 1):  # round 0: first-call allocations, not kept
            for name, way in args.ways.items():
                start = time.perf_counter()
                for weight in weights:
                    way(inputs[weight.shape[1]], weight, None)
                if round_:
                    times[name].append(time.perf_counter() - start)
        table[str(rows)] = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        ways = ", ".join(f"{name} {ms:.1f}" for name, ms in table[str(rows)].items())
        print(f"rows {rows}: {ways} ms a sweep", flush=True)
    return _write(args, "linear-sweep", {"weights_mb": megabytes, "milliseconds": table})


def _write(args: argparse.Namespace, name: str, results: dict) -> Path:
    out = args.out or RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"model": args.model, "rounds": args.rounds, "threads": torch.get_num_threads(), "ways": list(args.ways)}
    out.write_text(json.dumps({"settings": settings, **results}, indent=2))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
