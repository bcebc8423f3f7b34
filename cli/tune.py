"""`jf-tune`: the fastest lossless decoding configuration for a model on this machine, written into the model's
jacobi_forcing.json (the tuning stage alone: tasks/tuning.py; docs/DESIGN.md, section 12).

    jf-tune --model runs/smollm2/training/latest/final      # tune a checkpoint; the tune goes into its jacobi_forcing.json
    jf-tune --model smollm2-135m-instruct --batch-sizes 1 8  # the base model (its converted copy holds the tune)
    jf-tune --model M --config tune.yaml --out runs/tune-m   # TuneConfig keys (e.g. max_minutes: 3); the report where you say
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from jfcore.config import ConfigError, from_dict
from jfcore.evaluation.benchmarks import BenchmarkConfig
from jfcore.models import ModelConfig, ModelLoadError
from jfcore.tuning.tuner import TuneConfig
from tasks.tuning import tune_checkpoint


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jf-tune", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", required=True, help="checkpoint folder, preset or .gguf file (the tune is written into it)"
    )
    p.add_argument("--out", default="runs/tuning", help="where the report goes (a folder per model, settings, machine)")
    p.add_argument("--config", help="YAML/JSON of TuneConfig keys (the recipe's `tuning` section)")
    p.add_argument("--batch-sizes", type=int, nargs="+", help="batch-size buckets (default 1)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per tuning prompt (default 96)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--threads", type=int, help="torch CPU threads (part of the machine's identity)")
    p.add_argument("--data-dir", help="shared data folder (default $JF_SHARED_DATA or ../shared/data)")
    p.add_argument(
        "--avoid",
        nargs="*",
        default=["humaneval", "mbpp", "gsm8k", "math500"],
        help="evaluation benchmarks the tuning split must not overlap (default: all four)",
    )
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        values = {}
        if args.config:
            from jfcore.config import load_file

            values = load_file(args.config)
        if args.batch_sizes:
            values["batch_sizes"] = args.batch_sizes
        if args.max_new_tokens:
            values["max_new_tokens"] = args.max_new_tokens
        config = from_dict(TuneConfig, values, "tuning")
        model = ModelConfig(name_or_path=args.model, dtype=args.dtype, device=device)
        avoid = [from_dict(BenchmarkConfig, {"name": name}, "--avoid") for name in args.avoid]
        progress = lambda line: print(line, file=sys.stderr, flush=True)  # stdout: the result alone
        result = tune_checkpoint(model, config, args.out, avoid, args.data_dir, log=progress)
    except (ConfigError, ModelLoadError, FileNotFoundError) as err:
        print(f"jf-tune: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result)))  # one line, the last: what a script reads
    return 0


if __name__ == "__main__":
    sys.exit(main())
