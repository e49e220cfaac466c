#!/usr/bin/env bash
# Fetch, here (where pip reaches the registry), the wheels the GPU machine's image lacks, into
# .whl/ (git-ignored); the GPU scripts install them offline there (bench/gpu_lib.sh). The image
# has Python 3.12 and torch, click, rich, networkx, pytest and hypothesis; it lacks pulp, which
# only `solve --solver ilp` and the ILP tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "pulp>=2.7,<4"
ls -la .whl
