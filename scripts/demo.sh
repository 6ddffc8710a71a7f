#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs the chaos demo (docs/chaos_demo.md):
# four learners of the reference model under a failure tape, four methods at equal token budgets,
# in simulated cluster time. Writes results/chaos/{results.csv,curves.csv,results.md} and, if
# matplotlib imports, results/chaos/loss_vs_time.png.
#   scripts/demo.sh [chaos_demo options: --steps N --seed S --quick --out DIR ...]
# The building-block demo on a real tensor list is still there: ./build/examples/demo
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-deps.sh
launcher=()
if command -v ccache >/dev/null 2>&1; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >/dev/null
cmake --build build -j "$(nproc)" --target chaos_demo
out=results/chaos
args=("$@")
for ((i = 0; i < ${#args[@]}; ++i)); do
  if [[ "${args[$i]}" == "--out" && $((i + 1)) -lt ${#args[@]} ]]; then out="${args[$((i + 1))]}"; fi
done
./build/examples/chaos_demo "$@"
echo "CSV: $out/results.csv, $out/curves.csv; table: $out/results.md"
if /usr/bin/python3 -c 'import matplotlib' >/dev/null 2>&1; then
  /usr/bin/python3 examples/plot_chaos.py "$out"
  echo "PNG: $out/loss_vs_time.png"
else
  echo "matplotlib does not import in /usr/bin/python3: no PNG (install python3-matplotlib)"
fi
