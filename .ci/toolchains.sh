#!/usr/bin/env bash
# Toolchains the platform tests use when present (they skip cleanly without them):
# aarch64 (cross gcc + qemu-user) and Windows (mingw-w64 + wine) builds of the C core, and
# clang-format for the C style check. Debian packages; a no-op where all are installed.
set -euo pipefail
need=()
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
command -v x86_64-w64-mingw32-gcc >/dev/null || need+=(gcc-mingw-w64-x86-64)
[ -x /usr/lib/wine/wine64 ] || command -v wine64 >/dev/null || need+=(wine64)
command -v clang-format >/dev/null || need+=(clang-format)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "toolchains: not root, cannot install ${need[*]}; their tests will skip" >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
