"""What the stage CLIs (`jf-train`, `jf-eval`) share: a recipe of sections and `--set` overrides in, one line per
bad input out."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping

from jfcore.config import load_sections


def stage_main(
    argv: list[str] | None,
    description: str,
    sections: Mapping[str, type],
    run: Callable[[dict], object],
    errors: tuple[type[BaseException], ...],
) -> object:
    """Parse `--config RECIPE` and `--set KEY=VALUE` overrides (the first section is required), run the stage,
    and turn `errors` into `error: ...` and exit status 1 instead of a traceback."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help=f"YAML or JSON with sections {', '.join(sections)}")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a recipe value, e.g. --set {next(iter(sections))}.seed=1 (repeatable; values are YAML)",
    )
    args = parser.parse_args(argv)
    try:
        return run(load_sections(args.config, sections, required=(next(iter(sections)),), overrides=args.set))
    except errors as err:
        sys.exit(f"error: {err}")
