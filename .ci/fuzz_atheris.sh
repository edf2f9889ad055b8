#!/bin/sh
# A coverage-guided fuzz campaign (atheris): every target of tests/test_fuzz.py, RUNS inputs
# each, PIECES times, through the same contracts (tests/_support/contracts.py), appended to the
# ledger $COLIBRI_FUZZ_LEDGER (default build/fuzz/ledger.jsonl: a CI artifact, git-ignored,
# never a tracked file). Fails on any failure, crash or hang, whose input it saves in
# fuzz_findings/ beside the ledger. Needs the test and fuzz extras and torch; the loader's
# targets (checkpoint-config, checkpoint-index, checkpoint-partition) also transformers.
# Usage: .ci/fuzz_atheris.sh [RUNS=5000] [PIECES=1]; run from the repository root.
set -eu
RUNS=${1:-5000}
PIECES=${2:-1}
LEDGER=${COLIBRI_FUZZ_LEDGER:-$(pwd)/build/fuzz/ledger.jsonl}
if ! python -c "import atheris" 2>/dev/null; then
  echo "fuzz_atheris.sh: atheris is not installed: pip install -e '.[fuzz]'" >&2
  exit 1
fi
mkdir -p "$(dirname "$LEDGER")"
exec python tests/fuzz_atheris.py --runs "$RUNS" --pieces "$PIECES" --ledger "$LEDGER"
