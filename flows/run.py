"""Run the flow from a shell, on any machine: no Prefect server, MLflow server or Ray cluster needed.

    python -m flows.run configs/campaign/smoke.yaml
    python -m flows.run configs/campaign/gpu.yaml --stages trajectories --curriculum n16   # one stage at a time
    python -m flows.run configs/pipeline_smollm2_cpu.yaml --set training.max_steps=100 --set tracking.uri=null

Without PREFECT_API_URL, Prefect runs the flow against a temporary local server of its own (a subprocess that
ends with the run); with it, the run shows in that server's UI like a deployment's; where Prefect is not
installed the flow and its tasks run as plain Python calls (tasks/orchestration.py). MLflow logging follows the
recipe's `tracking.uri` (leave it out for none; a folder or sqlite:/// file needs no server), and `ray.address:
none` runs each stage's workers as local processes without Ray. Every stage writes under `work_dir` where the
next stage, a rerun or another machine picks it up (docs/PIPELINE.md, "Without servers, stage by stage").
"""

from __future__ import annotations

import argparse
import logging
import sys

from flows.recipe import STAGES
from jfcore.config import ConfigError, apply_overrides, load_file
from jfcore.models import ModelLoadError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="a recipe file (YAML or JSON), e.g. configs/campaign/smoke.yaml")
    parser.add_argument("--stages", nargs="+", metavar="STAGE", help=f"default all: {' '.join(STAGES)}")
    parser.add_argument("--curriculum", nargs="+", metavar="NAME", help="only these curriculum stages (default all)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe value")
    parser.add_argument("--fresh", action="store_true", help="start new training runs instead of resuming")
    args = parser.parse_args(argv)
    from flows.jacobi_forcing import jacobi_forcing  # after argument errors: importing Prefect takes seconds
    from tasks.orchestration import PREFECT

    if not PREFECT:  # the stages' log lines, which Prefect would otherwise print
        logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(message)s", datefmt="%H:%M:%S")

    try:
        recipe = apply_overrides(load_file(args.recipe), args.set) if args.set else args.recipe
        jacobi_forcing(recipe, stages=args.stages, resume=not args.fresh, curriculum=args.curriculum)
    except (ConfigError, ModelLoadError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
