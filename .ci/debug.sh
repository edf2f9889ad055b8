#!/usr/bin/env bash
# CI: the whole test suite against the bounds-checked Cython build (meson option
# debug_cython: boundscheck on, so an out-of-range index in a .pyx raises IndexError instead
# of reading past a buffer). Builds in a temporary virtual environment; nothing is left.
set -euo pipefail
cd "$(dirname "$0")/.."

work="$(mktemp -d "${TMPDIR:-/tmp}/colibri-debug.XXXXXX")"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
python -m pip install --quiet --upgrade pip
pip install --quiet meson-python meson ninja "Cython>=3.0.10" numpy
pip install --quiet --no-build-isolation -Csetup-args=-Ddebug_cython=true \
  -Cbuild-dir="$work/build" ".[test]" torch==2.13.0 jax
# the option reached Cython (a wrong -C flag would silently build the release variant)
grep -q "boundscheck=True" "$work/build/build.ninja" || {
  echo "debug.sh: the extensions were not built with boundscheck=True" >&2; exit 2; }
pytest -q -p no:cacheprovider "$@"
