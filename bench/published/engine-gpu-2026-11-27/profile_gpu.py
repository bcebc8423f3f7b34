"""Where a 64-row step's host time goes on a GPU: cProfile and torch.profiler over one warm decode.

The script that made profile-168a85c.log (it ran from the repository root as .dev/prof.py; reformatted here):

    python profile_gpu.py <SmolLM2 config dir> cuda out.json     # prompts: .dev/prompts.json (README.md)

SmolLM2's architecture with seeded random weights, float32, 64 GSM8K training prompts (chat template), 32 new
tokens a row, EOS off; multiblock and Jacobi n16, each with CUDA graphs and eager.
"""

import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from jfcore.decoding import DecodeConfig, decode

config_dir, device, out = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
model.config._attn_implementation = "sdpa"
model = model.to(device).eval()
pool = json.loads(Path(".dev/prompts.json").read_text())["trajectories"]
prompts = [pool[i % len(pool)] for i in range(64)]
report = {}
for method in ("multiblock", "jacobi"):
    for compile_ in ["cuda_graphs", "off"] if device == "cuda" else ["off"]:
        config = DecodeConfig(method=method, block_size=16, max_new_tokens=32, compile=compile_)

        def run(config=config):
            return decode(model, prompts, config, eos_token_id=[], pad_token_id=0)

        run()  # warm: graph captures, allocator growth
        profiler = cProfile.Profile()
        profiler.enable()
        stats = run().stats
        profiler.disable()
        table = io.StringIO()
        pstats.Stats(profiler, stream=table).sort_stats("tottime").print_stats(30)
        key = f"{method}-{compile_}"
        head = (
            f"== {key}: steps {stats.forward_calls} decode {stats.decode_seconds * 1e3:.1f} ms "
            f"forward {stats.forward_seconds * 1e3:.1f} ms"
        )
        print(head)
        print(table.getvalue()[:6000])
        report[key] = head + "\n" + table.getvalue()
        if compile_ != "off":
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as p:
                run()
            ops = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            print(ops[:5000])
            report[key + "-torch"] = ops
Path(out).write_text(json.dumps(report, indent=1))
