#!/usr/bin/env bash
# CI: the extensions built with AddressSanitizer + UndefinedBehaviorSanitizer (meson's
# b_sanitize) and Cython's bounds checks on (debug_cython), then the tests that drive the
# compiled code: routing, DLPack intake, dispatch, pager, the quantized kernels and held
# experts' native step, and the fuzzers. Any sanitizer report fails the run (halt_on_error).
# Builds in a temporary virtual environment; nothing is left.
#
# Python itself is not instrumented, so libasan is preloaded; leak detection is off (CPython
# keeps its arenas until exit, which LeakSanitizer would report).
set -euo pipefail
cd "$(dirname "$0")/.."

work="$(mktemp -d "${TMPDIR:-/tmp}/colibri-sanitize.XXXXXX")"
# sanitizer reports go to files (pytest's output capture would swallow them on an abort)
trap 'cat "$work"/sanitizer.* >&2 2>/dev/null || true; rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
python -m pip install --quiet --upgrade pip
pip install --quiet meson-python meson ninja "Cython>=3.0.10" numpy
pip install --quiet --no-build-isolation \
  -Csetup-args=-Db_sanitize=address,undefined -Csetup-args=-Db_lundef=false \
  -Csetup-args=-Dbuildtype=debugoptimized -Csetup-args=-Ddebug_cython=true \
  -Cbuild-dir="$work/build" ".[test]" torch==2.13.0

libasan="$(${CC:-cc} -print-file-name=libasan.so)"
if [[ ! -e "$libasan" ]]; then
  echo "sanitize.sh: libasan.so not found (got '$libasan'); install the compiler's ASan runtime" >&2
  exit 2
fi

export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:log_path=$work/sanitizer"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$work/sanitizer"
export COLIBRI_FUZZ_EXAMPLES="${COLIBRI_FUZZ_EXAMPLES:-40}"  # tests/test_fuzz.py: fewer, slower here
# pytest from the repository root imports the installed, instrumented colibri (importlib mode).
# The memory tests are left out: ASan's shadow memory and quarantine are resident memory too
# (peak RSS, the read pool's RssAnon), and its shadow needs more address space than the
# RLIMIT_AS of the unlimited-budget test leaves ("Failed to mmap").
# So are the atheris driver's tests: libFuzzer's runtime aborts under a preloaded ASan (its
# __cxa_throw interceptor finds no real symbol), and atheris instruments Python, not our C.
LD_PRELOAD="$libasan" pytest -q -p no:cacheprovider \
  tests/routing/test_routing.py tests/dlpack/test_dlpack.py tests/layer/test_dispatch.py tests/pager/test_pager.py \
  tests/test_fuzz.py tests/test_threads.py tests/layer/test_held.py tests/layer/test_quant.py \
  tests/layer/test_attention.py tests/layer/test_norm.py tests/layer/test_rope.py tests/layer/test_step.py \
  tests/layer/test_warm.py \
  --deselect tests/pager/test_pager.py::test_streaming_8x_the_budget_keeps_peak_rss_bounded \
  --deselect tests/pager/test_pager.py::test_populate_commits_the_read_pool_at_once \
  -k "not test_a_budget_without_limit_is_capped_at_the_experts_in_the_files" \
  --deselect tests/test_fuzz.py::test_atheris_campaign_counts_every_input \
  --deselect tests/test_fuzz.py::test_atheris_campaign_records_a_broken_contract "$@"
