"""The step's rules in Python against the same rules in C, side by side in one process.

Decodes the same prompts on `bench.step_overhead`'s short-forward model with each in turn (order alternating per
round): "python" as the decoder ran before the rows in C (the row-by-row rules with the Python prompt lookup, batch
tensors for plain rows from 8 rows, or 64 with prompt lookup), "c" the C step (jfcore/decoding/native_rows.py).
Prints and writes the median host ms a step of each, their ratio, and whether tokens, forwards per row and
recorded trajectories were equal.

    python -m bench.rows_ab --method multiblock --rows 64 --rounds 16
    python -m bench.rows_ab --method ar --lookup-tokens 2 --rows 64
    python -m bench.rows_ab --method jacobi --record --rows 64          # as trajectory generation decodes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.common import RESULTS, prompts_for, short_forward_model
from jfcore.decoding import DecodeConfig
from jfcore.decoding.jacobi import BATCH_TENSOR_ROWS, LOOKUP_BATCH_TENSOR_ROWS, JacobiDecoder
from jfcore.decoding.lookup import PromptLookup


class PythonRules(JacobiDecoder):
    """The decoder before the rows in C: its rows' prompt lookup the Python one."""

    def new_row(self, *args, **kwargs):
        row = super().new_row(*args, **kwargs)
        if row.lookup is not None:
            row.lookup = PromptLookup(self.config.lookup_ngram, self.config.lookup_tokens, row.prompt)
        return row


def decoder(model, config: DecodeConfig, rules: str) -> JacobiDecoder:
    d = (PythonRules if rules == "python" else JacobiDecoder)(model, config, [], 0)
    if rules == "python":
        d.native_step = None
        one_block = config.blocks_in_flight == 1 and not config.recycling
        plain = one_block and (not config.lookup_tokens or d.block_size == 1)
        d.batch_tensors_from = (
            (LOOKUP_BATCH_TENSOR_ROWS if config.lookup_tokens else BATCH_TENSOR_ROWS) if plain else None
        )
    elif d.native_step is None:
        raise SystemExit(
            "the C step was not built (or does not apply to this method): pip install -e . with a C compiler"
        )
    return d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=["ar", "jacobi", "multiblock"], default="multiblock")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=16, help="decodes with each rule set")
    parser.add_argument("--lookup-tokens", type=int, default=0)
    parser.add_argument("--lookup-within", action="store_true")
    parser.add_argument("--record", action="store_true", help="record trajectories (jacobi), as trajectory generation")
    args = parser.parse_args()
    model = short_forward_model()
    prompts = prompts_for(args.rows, model.config.vocab_size, 0)
    config = DecodeConfig(
        method=args.method,
        max_new_tokens=args.max_new_tokens,
        lookup_tokens=args.lookup_tokens,
        lookup_within=args.lookup_within,
        record_trajectories=args.record,
    )
    host: dict[str, list[float]] = {"python": [], "c": []}
    outputs = {}
    for r in range(args.rounds):
        for rules in ("python", "c") if r % 2 == 0 else ("c", "python"):
            s = (out := decoder(model, config, rules).decode(prompts)).stats
            recorded = [[(b.start, b.states) for b in t] for t in out.trajectories or []]
            outputs.setdefault(rules, (out.sequences, s.forwards_per_row, recorded))
            host[rules].append((s.decode_seconds - s.forward_seconds) / s.forward_calls * 1e3)
    python, c = statistics.median(host["python"]), statistics.median(host["c"])
    result = {
        "method": config.describe() + (" recorded" if args.record else ""),
        "rows": args.rows,
        "new_tokens": args.max_new_tokens,
        "decodes_each": args.rounds,
        "python_host_ms": round(python, 3),
        "c_host_ms": round(c, 3),
        "c_over_python": round(c / python, 3),
        "same_tokens_and_forwards": outputs["python"] == outputs["c"],
        "python_all": [round(x, 3) for x in host["python"]],
        "c_all": [round(x, 3) for x in host["c"]],
    }
    print(
        f"{result['method']}, {args.rows} rows x {args.max_new_tokens} tokens, host ms a step (median of {args.rounds}): "
        f"python {python:.3f}, c {c:.3f}, c / python {c / python:.3f}; same tokens, forwards and trajectories: {result['same_tokens_and_forwards']}"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"rows-ab-{config.describe().replace(' ', '-')}-{args.rows}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
