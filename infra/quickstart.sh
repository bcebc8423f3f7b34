#!/usr/bin/env bash
# Command 1 of the README: install, start the local stack, register the deployments, and run the whole
# pipeline (`jacobi-forcing/full`) on the embedded default model; ends with the results table and the UIs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/setup.sh
.venv/bin/python infra/stack.py up
eval "$(.venv/bin/python infra/stack.py env)"
.venv/bin/prefect deployment run jacobi-forcing/full --watch
.venv/bin/python infra/stack.py results
