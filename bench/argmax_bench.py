"""The greedy choice over a decode step's logits: `max(-1).indices` against the decoder's `greedy_argmax`.

Every decode step reads the argmax of [batch, query width, vocabulary] logits; with Jacobi blocks the width is 16 or
more, so on a CPU this reduction costs as much as a small model's forward. The shapes below are the step-overhead
bench's (vocabulary 2048) and SmolLM2's (49152) at the batch sizes and widths the decoders use. Both results are
checked equal on every shape, including ties. Printed and written to JSON: milliseconds per call and the ratio.

    python -m bench.argmax_bench
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from bench.common import RESULTS
from jfcore.decoding.sampling import greedy_argmax

SHAPES = [
    (64, 1, 2048),
    (64, 16, 2048),
    (64, 42, 2048),
    (1, 1, 49152),
    (1, 16, 49152),
    (16, 16, 49152),
    (64, 1, 49152),
    (64, 16, 49152),
]


def _ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    print(f"{'shape':<18} {'max ms':>8} {'two-pass ms':>12} {'ratio':>6}")
    for shape in SHAPES:
        logits = torch.randn(shape)
        logits[..., -7:] = logits.amax(-1, keepdim=True)  # a tie at the end: the first index must still win
        if not torch.equal(greedy_argmax(logits), logits.max(-1).indices):
            raise SystemExit(f"greedy_argmax differs from max(-1).indices at {shape}")
        plain = _ms(lambda x=logits: x.max(-1).indices, args.repeats)
        two_pass = _ms(lambda x=logits: greedy_argmax(x), args.repeats)
        rows.append({"shape": list(shape), "max_ms": plain, "greedy_argmax_ms": two_pass, "ratio": plain / two_pass})
        print(f"{shape!s:<18} {plain:8.3f} {two_pass:12.3f} {plain / two_pass:6.2f}")
    out = args.out or RESULTS / f"argmax-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    host = {"machine": platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    out.write_text(json.dumps({"host": host, "results": rows}, indent=2))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
