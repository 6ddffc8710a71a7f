#!/usr/bin/env bash
# pkg-config against an installed ddiloco: compiles tests/consumer's programs
# with the plain compiler command a Makefile user writes, then runs them.
#   pkg_config_compile.sh PREFIX CXX WORKDIR [optional]
# `optional` also builds the ZeroMQ / Eigen / reference-model consumer with
# `pkg-config ddiloco-zmq eigen3`.
set -euo pipefail
prefix=$1 cxx=$2 work=$3 optional=${4:-}
src=$(cd "$(dirname "$0")/../consumer" && pwd)
rm -rf "$work" && mkdir -p "$work"
export PKG_CONFIG_PATH="$prefix/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"

want=$(sed -n 's/^#define DDILOCO_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' "$prefix/include/ddiloco/version.hpp" | paste -sd.)
got=$(pkg-config --modversion ddiloco)
if [ "$got" != "$want" ]; then
  echo "FAIL: pkg-config --modversion ddiloco says '$got', the installed version.hpp says '$want'" >&2
  exit 1
fi
cflags=$(pkg-config --cflags ddiloco)
case " $cflags " in
  *" -I$prefix/include "*) ;;
  *) echo "FAIL: pkg-config --cflags ddiloco = '$cflags' does not name $prefix/include" >&2; exit 1 ;;
esac

set -x
# shellcheck disable=SC2046  # pkg-config prints several flags
"$cxx" -std=c++20 $(pkg-config --cflags ddiloco) "$src/main.cpp" -o "$work/consumer" $(pkg-config --libs ddiloco)
"$work/consumer"
if [ "$optional" = optional ]; then
  # shellcheck disable=SC2046
  "$cxx" -std=c++20 $(pkg-config --cflags ddiloco-zmq eigen3) "$src/optional_parts.cpp" -o "$work/consumer_optional" \
    $(pkg-config --libs ddiloco-zmq eigen3)
  "$work/consumer_optional"
fi
