#!/usr/bin/env bash
# Installs the Debian packages ddiloco's build, tests, demo and benchmarks need.
# Uses apt-get when it can (root, or passwordless sudo); otherwise prints the
# exact command to run and exits non-zero.
set -euo pipefail
packages=(cmake ninja-build pkgconf g++ clang libclang-rt-14-dev libeigen3-dev xtensor-dev catch2
          libbenchmark-dev libzmq3-dev cppzmq-dev libtorch-dev fortunes python3-matplotlib
          prometheus-cpp-dev prometheus  # --metrics of the programs; the server for its test
          nlohmann-json3-dev  # JSON of <ddiloco/safetensors.hpp>: --init FILE.safetensors, ddiloco_export
          dpkg-dev  # dpkg-dev: dpkg-shlibdeps, for the .deb's Depends (cpack)
          python3-dev pybind11-dev python3-numpy python3-torch python3-pytest  # the Python package and its tests
          curl)  # the metrics test queries Prometheus' HTTP API
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "ddiloco: installing missing packages: ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  echo "ddiloco: cannot install packages without root. Run:" >&2
  echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
