#!/usr/bin/env bash
# scripts/kill_loop.sh: the seeded kill loop (docs/security.md, "Kill loop"),
# long or short. Runs tests/multiprocess/kill_loop.sh with the programs of a
# build folder: SIGKILLs of learners and of the syncer on a schedule drawn
# from the seed, each restarted at once, then asserts no hang, no honest
# duplicate, no double merge and that the final checkpoint loads.
#   scripts/kill_loop.sh [--kills N] [--seed S] [--build DIR]
# Defaults: 100 kills, seed 1, build/. ctest's mp_kill_loop runs 6.
set -euo pipefail
kills=100 seed=1 build=build
while [ $# -gt 0 ]; do
  case $1 in
    --kills) kills=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    -h | --help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "kill_loop.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
for name in ddiloco_syncer ddiloco_learner ddiloco_keygen; do
  [ -x "$build/programs/$name" ] || { echo "kill_loop.sh: $build/programs/$name not built (cmake --build $build --target $name)" >&2; exit 1; }
done
KILLS=$kills SEED=$seed exec bash "$root/tests/multiprocess/kill_loop.sh" \
  "$build/programs/ddiloco_syncer" "$build/programs/ddiloco_learner" "$build/programs/ddiloco_keygen"
