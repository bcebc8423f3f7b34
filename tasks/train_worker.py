"""One training process; `tasks.training` launches one per GPU (or CPU slot) with torchrun.

Usage: python -m torch.distributed.run --nproc_per_node N -m tasks.train_worker LAUNCH_JSON
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from jfcore.config import from_dict
from jfcore.contracts import FAILURE_PREFIX
from jfcore.training.config import TrainConfig
from jfcore.training.loop import train
from tasks.tracking import TrackingConfig, metric_logger


def main(argv: list[str]) -> None:
    faulthandler.enable()  # a native crash (SIGABRT, SIGSEGV) still shows where Python was
    launch = json.loads(Path(argv[0]).read_text())
    config = from_dict(TrainConfig, launch["training"], "training")
    on_metrics = None
    if launch.get("run_id") and os.environ.get("RANK", "0") == "0":
        on_metrics = metric_logger(from_dict(TrackingConfig, launch["tracking"], "tracking"), launch["run_id"])
    try:
        result = train(config, launch["deepspeed"], on_metrics)
    except Exception as err:  # leave the launcher the reason, which torchrun's summary drops
        rank = os.environ.get("RANK", "0")
        (Path(config.output_dir) / f"{FAILURE_PREFIX}rank{rank}.txt").write_text(f"{type(err).__name__}: {err}")
        raise
    # Leave the process group, then skip the interpreter's teardown: native threads (gloo's, DeepSpeed's ZeRO-3) still
    # alive at exit abort the process now and then ("terminate called without an active exception", exit code -6),
    # and the launcher would report a finished run as failed. Everything the run keeps is written by now (train()
    # returns after the final export; metrics go out synchronously). Only on success: ranks that failed may not reach
    # this collective teardown, and their traceback is what the launcher shows.
    dist.destroy_process_group()
    if os.environ.get("RANK", "0") == "0":
        print(
            f"training finished: {result.steps} steps (resumed from {result.resumed_from}); model in {result.final_dir}"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
