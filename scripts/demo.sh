#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs the building-block
# demo on a real model's tensor list (examples/models/llama-1b.txt by default).
#   scripts/demo.sh [tensor-list] [learners]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-deps.sh
launcher=()
if command -v ccache >/dev/null 2>&1; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" >/dev/null
cmake --build build -j "$(nproc)" --target demo
./build/examples/demo "$@"
