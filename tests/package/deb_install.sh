#!/usr/bin/env bash
# The .deb as a user gets it: builds it with cpack from BUILD_DIR, checks its
# control fields, extracts it into an empty prefix (dpkg-deb -x: nothing is
# installed into the system), builds tests/consumer against that prefix only
# (CMake package and pkg-config), and runs the installed programs from it.
#   deb_install.sh BUILD_DIR WORKDIR CMAKE_GENERATOR CXX [optional]
set -euo pipefail
build=$1 work=$2 generator=$3 cxx=$4 optional=${5:-}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*" >&2; exit 1; }

cpack --config "$build/CPackConfig.cmake" -G DEB -B "$work/cpack" >"$work/cpack.log" 2>&1 \
  || { cat "$work/cpack.log" >&2; fail "cpack -G DEB failed (log above)"; }
debs=("$work"/cpack/ddiloco_*.deb)
[ -f "${debs[0]}" ] || fail "cpack made no ddiloco_*.deb in $work/cpack"
deb=${debs[0]}
echo "built $(basename "$deb") ($(du -k "$deb" | cut -f1) KiB)"

version=$(dpkg-deb -f "$deb" Version)
depends=$(dpkg-deb -f "$deb" Depends)
echo "Version: $version"
echo "Depends: $depends"
want=$(sed -n 's/^#define DDILOCO_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' "$here/../../include/ddiloco/version.hpp" | paste -sd.)
case "$version" in "$want"|"$want"-*) ;; *) fail "package version '$version', version.hpp says '$want'" ;; esac
for dep in libzmq5 libstdc++6 libc6 fortunes; do
  case "$depends" in *"$dep"*) ;; *) fail "Depends lacks $dep: '$depends'" ;; esac
done

root=$work/root
dpkg-deb -x "$deb" "$root"
usr=$root/usr
for f in bin/ddiloco_syncer bin/ddiloco_learner bin/ddiloco_keygen bin/ddiloco_sim \
         include/ddiloco/ddiloco.hpp include/ddiloco/version.hpp include/ddiloco/transport/zmq.hpp \
         include/ddiloco/reference/char_lm.hpp lib/cmake/ddiloco/ddilocoConfig.cmake \
         lib/cmake/ddiloco/ddilocoZmqTargets.cmake share/pkgconfig/ddiloco.pc share/pkgconfig/ddiloco-zmq.pc \
         share/ddiloco/models/llama-1b.txt; do
  [ -e "$usr/$f" ] || fail "the package has no /usr/$f"
done
grep -q '^prefix=/usr$' "$usr/share/pkgconfig/ddiloco.pc" || fail "ddiloco.pc in the package does not say prefix=/usr"

# The installed programs, run from the extracted prefix.
"$usr/bin/ddiloco_syncer" --help >"$work/syncer-help.txt" || fail "ddiloco_syncer --help exited $?"
grep -q -- "--bind" "$work/syncer-help.txt" || fail "ddiloco_syncer --help does not list --bind"
for p in ddiloco_syncer ddiloco_learner ddiloco_keygen ddiloco_sim; do
  out=$("$usr/bin/$p" --version)
  [ "$out" = "$p $want" ] || fail "$p --version printed '$out', expected '$p $want'"
done
echo "ddiloco_syncer --help and every program's --version: ok ($want)"
(cd "$work" && "$usr/bin/ddiloco_keygen" k >/dev/null) && [ -s "$work/k.pub" ] || fail "ddiloco_keygen wrote no key"
# ddiloco_sim all finds its model lists in share/ddiloco/models next to its own
# bin/ (a short --hours keeps it quick), and a copy of it elsewhere says where it looked.
"$usr/bin/ddiloco_sim" all --hours 0.05 --out "$work/sim" >"$work/sim.log" 2>&1 \
  || { cat "$work/sim.log" >&2; fail "the installed ddiloco_sim all failed"; }
for m in llama-1b gemma-2b moe-small; do
  [ -s "$work/sim/plan_$m.md" ] || fail "ddiloco_sim all wrote no plan_$m.md"
done
mkdir -p "$work/elsewhere" && cp "$usr/bin/ddiloco_sim" "$work/elsewhere/"
if "$work/elsewhere/ddiloco_sim" all --out "$work/sim2" 2>"$work/sim2.log"; then
  fail "ddiloco_sim without its model lists did not fail"
fi
grep -q "cannot find the model lists.*$work/share/ddiloco/models.*--models DIR" "$work/sim2.log" \
  || fail "ddiloco_sim without its model lists said: $(cat "$work/sim2.log")"

# An external consumer against the extracted prefix only.
opt=OFF
[ "$optional" = optional ] && opt=ON
cmake -S "$here/../consumer" -B "$work/consumer" -G "$generator" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCONSUMER_MODE=find_package -DCONSUMER_OPTIONAL=$opt -DCMAKE_PREFIX_PATH="$usr" \
  -DCONSUMER_EXPECT_PREFIX="$usr" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$work/consumer-configure.log" 2>&1 \
  || { cat "$work/consumer-configure.log" >&2; fail "the consumer does not configure against $usr"; }
cmake --build "$work/consumer" >"$work/consumer-build.log" 2>&1 \
  || { cat "$work/consumer-build.log" >&2; fail "the consumer does not build against $usr"; }
(cd "$work/consumer" && ctest --output-on-failure) || fail "the consumer built against $usr does not run"
# pkg-config from the extracted prefix: --define-prefix rebases prefix=/usr on where the .pc file lies.
cflags=$(PKG_CONFIG_PATH="$usr/share/pkgconfig" pkg-config --define-prefix --cflags ddiloco)
case " $cflags " in *" -I$usr/include "*) ;; *) fail "pkg-config --define-prefix --cflags ddiloco = '$cflags'" ;; esac
echo "deb_install: ok"
