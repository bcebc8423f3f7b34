"""The fixed-shape path's step split on a CPU: CUDA graphs' mechanics with `capture=False` (inputs copied into
static buffers, rows and query widths padded to buckets, the eager model run on them), 64 rows, 30 thin layers.

    PYTHONPATH=<tree> python fixed_shape_split.py <tree>     # <tree>: the checkout whose jfcore is measured
"""

import sys

import torch

sys.path.insert(0, sys.argv[1])

from bench.step_overhead import prompts_for, short_forward_model
from jfcore.decoding import DecodeConfig
from jfcore.decoding.graphs import GraphForward
from jfcore.decoding.jacobi import JacobiDecoder

torch.set_num_threads(2)
model = short_forward_model(layers=30)
runner = GraphForward(model, capture=False)
prompts = prompts_for(64, 2048, 64)
for method in ("multiblock", "jacobi", "ar"):
    config = DecodeConfig(method=method, block_size=1 if method == "ar" else 16, max_new_tokens=32)
    runs = []
    for _ in range(3):
        decoder = JacobiDecoder(model, config, [], 0)
        decoder.fixed_forward = runner
        stats = decoder.decode(prompts).stats
        runs.append(
            (stats.decode_seconds / stats.forward_calls * 1e3, stats.forward_seconds / stats.forward_calls * 1e3)
        )
    step, forward = sorted(runs)[1]
    print(f"{method}: step {step:.2f} ms forward {forward:.2f} host {step - forward:.2f}")
