"""One decode step's time t(q) on a GPU for q new positions (batch 1, a 200-token cache), eager vs CUDA graphs,
float32 and bfloat16: the slot batch's forward plus the argmax read back, median of 12 after 3 warm-ups. The
architecture comes from a config dir (weights are random: the time does not depend on them).

    python -m bench.gpu_cost_curve CONFIG_DIR > cost_curve.json
"""

import json
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from jfcore.decoding.runner.compiled import fixed_forward
from jfcore.decoding.runner.slots import SlotBatch


def main(config_dir: str) -> dict:
    """t(q) in ms for every dtype, forward mode and q; printed as JSON on stdout, each mode's figures on stderr."""
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(config_dir)
    res = {}
    with torch.inference_mode():
        for dt in ("float32", "bfloat16"):
            m = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dt)).cuda().eval()
            m.config._attn_implementation = "sdpa"
            for mode in ("off", "cuda_graphs"):
                s = SlotBatch(m, 1, compact=False, fixed_forward=fixed_forward(m, mode))
                ctx = 200
                p = torch.randint(0, 49152, (1, ctx))
                v = torch.ones(1, ctx, dtype=torch.bool)
                s.forward(p, v, torch.arange(ctx)[None])
                s.keep(v)
                for q in (1, 2, 4, 8, 16, 32):
                    ts = []
                    for r in range(15):
                        t = torch.randint(0, 49152, (1, q))
                        torch.cuda.synchronize()
                        a = time.perf_counter()
                        s.forward(t, torch.ones(1, q, dtype=torch.bool), torch.arange(ctx, ctx + q)[None]).max(
                            -1
                        ).indices.cpu()
                        torch.cuda.synchronize()
                        ts.append(time.perf_counter() - a)
                        s.keep(torch.zeros(1, q, dtype=torch.bool))
                    res[f"{dt} {mode} q{q}"] = round(sorted(ts[3:])[6] * 1000, 3)
                print({k: v for k, v in res.items() if f"{dt} {mode}" in k}, file=sys.stderr, flush=True)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
