"""The `jacobi-forcing` deployments, registered on the Prefect server `PREFECT_API_URL` names.

- `full`: the whole pipeline on a recipe (default: the embedded SmolLM2 on CPU);
- `retrain`: the same on the recipe's `schedule.cron`, one run at a time (a run
  that comes due while one is going waits for it);
- `evaluation`: evaluation only, of the newest trained model against the base.

    python infra/deployments.py [--recipe configs/pipeline_smollm2_cpu.yaml] [--pool jacobi-forcing-local]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prefect import flow
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.schedules import Cron

from flows.jacobi_forcing import DEFAULT_RECIPE
from flows.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
ENTRYPOINT = "flows/jacobi_forcing.py:jacobi_forcing"
POOL = "jacobi-forcing-local"


def register(recipe: str = DEFAULT_RECIPE, pool: str = POOL) -> dict[str, str]:
    """Create or update the three deployments; returns name -> deployment id."""
    config = load_recipe(REPO / recipe if not Path(recipe).is_absolute() else recipe)  # refuse a bad recipe now
    source = flow.from_source(source=str(REPO), entrypoint=ENTRYPOINT)  # runs in the repository folder
    common = {"work_pool_name": pool, "build": False, "push": False, "print_next_steps": False, "ignore_warnings": True}
    ids = {
        "full": source.deploy(
            name="full",
            parameters={"recipe": recipe},
            tags=["pipeline"],
            description="The whole pipeline: trajectories, packing, training, evaluation, registry.",
            **common,
        ),
        "retrain": source.deploy(
            name="retrain",
            parameters={"recipe": recipe},
            schedules=[Cron(config.schedule.cron, timezone=config.schedule.timezone)],
            tags=["pipeline", "scheduled"],
            concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
            description=f"Scheduled retraining ({config.schedule.cron} {config.schedule.timezone}); never two at once.",
            **common,
        ),
        "evaluation": source.deploy(
            name="evaluation",
            parameters={"recipe": recipe, "stages": ["evaluation"]},
            tags=["evaluation"],
            description="Evaluate the newest trained model against the base.",
            **common,
        ),
    }
    return {name: str(i) for name, i in ids.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help="recipe path, relative to the repository")
    parser.add_argument("--pool", default=POOL, help="the process work pool the worker polls")
    args = parser.parse_args(argv)
    for name, deployment_id in register(args.recipe, args.pool).items():
        print(f"deployment jacobi-forcing/{name}: {deployment_id}")


if __name__ == "__main__":
    main()
