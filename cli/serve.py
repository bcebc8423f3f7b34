"""`jf-serve`: serve one model over an OpenAI-compatible API with the project's lossless parallel decoder.

    jf-serve --model models:/jacobi-forcing@champion          # the registry's champion (MLFLOW_TRACKING_URI)
    jf-serve --model runs/demo/work/training/latest/final     # a checkpoint folder
    jf-serve --model smollm2-135m-instruct --method ar        # the base model, one token per forward
    JF_API_KEY=secret jf-serve --model ...                    # every request needs 'Authorization: Bearer secret'

Decoding starts from the model's tune for this machine (its jacobi_forcing.json, written by jf-tune), for the
bucket of --max-batch-size rows; without one (or tuned elsewhere) from the untuned default, Jacobi at the block
size it was trained at, and the log says so. --method, --block-size, --num-blocks and --lookup-tokens override
either. Binds 127.0.0.1 unless --host says otherwise. See docs/SERVING.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from jfcore.config import ConfigError
from jfcore.environment import cache_dir
from jfcore.models import ModelConfig, ModelLoadError

REGISTRY_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:@(?P<alias>[\w-]+)|/(?P<version>\d+))")
API_KEY_ENV = "JF_API_KEY"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jf-serve", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="registry reference (models:/NAME@ALIAS or models:/NAME/VERSION), checkpoint dir, preset, .gguf or hub id",
    )
    p.add_argument("--served-model-name", help="the model id clients send (default: the registry name or folder name)")
    p.add_argument("--method", choices=["multiblock", "jacobi", "ar"], help="decoding method (default: the tune's)")
    p.add_argument("--block-size", type=int, help="tokens per block (default: the tune's, else the trained size)")
    p.add_argument("--num-blocks", type=int, help="blocks in flight (multiblock)")
    p.add_argument(
        "--rolling",
        action=argparse.BooleanOptionalAction,
        help="jacobi: a rolling window that never closes (default: the tune's)",
    )
    p.add_argument("--lookup-tokens", type=int, help="prompt-lookup candidate tokens (0: off)")
    p.add_argument(
        "--share-prefix-tokens",
        type=int,
        help="requests whose prompts open with at least this many equal tokens (a system prompt) share that prefix's "
        "KV cache, prefilled once (0: off; default 64)",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="completion budget when a request names none")
    p.add_argument("--max-batch-size", type=int, default=16, help="rows decoded together")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the batch; more get 429")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, if set)")
    p.add_argument("--tracking-uri", help="MLflow server for models:/ references (default: $MLFLOW_TRACKING_URI)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--attn", default="sdpa", help="attention implementation (sdpa, eager, flash_attention_2, ...)")
    return p


def resolve_model(reference: str, tracking_uri: str | None) -> tuple[str, str, tuple[str, ...]]:
    """(what to load, the served name, other accepted names) for a --model value; registry references are
    downloaded once into the cache folder."""
    found = REGISTRY_URI.fullmatch(reference)
    if not found:
        path = Path(reference)
        name = path.name if path.exists() else reference
        return reference, name, (reference,)
    from mlflow.exceptions import MlflowException

    from tasks.registry import fetch_version
    from tasks.tracking import TrackingConfig, client

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ConfigError(f"{reference} names a registered model: set --tracking-uri or MLFLOW_TRACKING_URI")
    name = found["name"]
    tracking = TrackingConfig(uri=uri, registered_model=name)
    try:
        version = found["version"] or client(tracking).get_model_version_by_alias(name, found["alias"]).version
        cache = cache_dir() / "served"
        checkpoint = fetch_version(tracking, version, cache)
    except MlflowException as err:
        raise ModelLoadError(f"cannot fetch {reference} from {uri}: {err.message}") from None
    print(f"{reference} is version {version}: {checkpoint}", flush=True)
    return str(checkpoint), name, (reference, f"models:/{name}/{version}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch
    import uvicorn

    from jfcore.jacobi_forcing_json import decoding_for
    from jfcore.machine import this_machine
    from jfcore.models import load_model, resolve_checkpoint
    from jfcore.serving.engine import Engine
    from jfcore.serving.server import ServedModel, create_app

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target, name, aliases = resolve_model(args.model, args.tracking_uri)
        for flag, value in (("--max-batch-size", args.max_batch_size), ("--max-queue", args.max_queue)):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        print(f"loading {args.model} ({args.dtype}, {device}) ...", flush=True)
        model_config = ModelConfig(name_or_path=target, dtype=args.dtype, device=device, attn_implementation=args.attn)
        model, tokenizer = load_model(model_config)
        explicit = {
            key: value
            for key, value in (
                ("method", args.method),
                ("block_size", args.block_size),
                ("num_blocks", args.num_blocks),
                ("rolling", args.rolling),
                ("lookup_tokens", args.lookup_tokens),
                ("share_prefix_tokens", args.share_prefix_tokens),
            )
            if value is not None
        }
        machine = this_machine(device, model.dtype)
        checkpoint = resolve_checkpoint(model_config)
        config = decoding_for(
            checkpoint if Path(checkpoint).is_dir() else None,
            machine,
            args.max_batch_size,
            explicit | {"max_new_tokens": args.max_tokens},
        )
    except (OSError, ConfigError) as err:
        print(f"jf-serve: error: {err}", file=sys.stderr)
        return 2
    context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    served = ServedModel(
        name=args.served_model_name or name,
        context_length=context,
        max_tokens=args.max_tokens,
        aliases=aliases,
        decoding={
            "method": config.method,
            "block_size": config.block_size,
            "rolling": config.rolling,
            "lookup_tokens": config.lookup_tokens,
            "share_prefix_tokens": config.share_prefix_tokens,
            "max_batch_size": args.max_batch_size,
        },
    )
    engine = Engine(model, tokenizer, config, max_batch_size=args.max_batch_size, max_queue=args.max_queue)
    app = create_app(engine.start(), tokenizer, served, api_key)
    what = config.describe()
    key = "an API key" if api_key else "no API key"
    print(f"serving '{served.name}' ({what}) on http://{args.host}:{args.port}/v1 with {key}", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
