#!/bin/sh
# A fuzz campaign: every target of tests/test_fuzz.py, EXAMPLES inputs each, PIECES times
# (each piece a fresh pytest session with fresh random inputs), appended to the ledger
# $COLIBRI_FUZZ_LEDGER (default build/fuzz/ledger.jsonl: a CI artifact, git-ignored). A piece
# that crashes (killed by a signal) or hangs (past PIECE_SECONDS) is recorded as such, and the
# script fails.
# Usage: .ci/fuzz.sh [EXAMPLES=2000] [PIECES=1]; run from the repository root.
set -u
EXAMPLES=${1:-2000}
PIECES=${2:-1}
PIECE_SECONDS=${PIECE_SECONDS:-3600}
LEDGER=${COLIBRI_FUZZ_LEDGER:-$(pwd)/build/fuzz/ledger.jsonl}
mkdir -p "$(dirname "$LEDGER")"
TMP=$(mktemp -d "${COLIBRI_FUZZ_TMP:-/dev/shm}/colibri-fuzz.XXXXXX" 2>/dev/null || mktemp -d)
trap 'rm -rf "$TMP"' EXIT
status=0
i=0
while [ "$i" -lt "$PIECES" ]; do
  i=$((i + 1))
  COLIBRI_FUZZ_EXAMPLES=$EXAMPLES COLIBRI_FUZZ_LEDGER=$LEDGER COLIBRI_FUZZ_TMP=$TMP \
    timeout "$PIECE_SECONDS" pytest -q -p no:randomly -m "not slow" tests/test_fuzz.py \
    -k "not ledger"
  rc=$?
  if [ "$rc" -ge 124 ]; then  # 124: timeout (a hang); 128+n: killed by signal n (a crash)
    hang=$([ "$rc" -eq 124 ] && echo 1 || echo 0)
    printf '{"crashes": %d, "date": "%s", "examples_per_target": %d, "failures": 0, "hangs": %d, "inputs": {}, "machine": "%s", "refused": {}}\n' \
      "$((1 - hang))" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$EXAMPLES" "$hang" "$(uname -m)" >> "$LEDGER"
    status=1
  elif [ "$rc" -ne 0 ]; then
    status=1
  fi
done
exit $status
