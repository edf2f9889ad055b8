"""The build: OpenMP compiled in, headers shipped, the CLI answers."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import colibri
from colibri import _core


def test_openmp_is_compiled_in():
    # prange silently runs serially without OpenMP: a wheel that lost it must fail here
    assert colibri.openmp_enabled(), "colibri was built without OpenMP"
    assert _core.openmp_version() >= 200203
    assert colibri.max_threads() >= 1


def test_headers_are_installed():
    """Every header the public ones include, transitively (route.h pulls in route/*.h), is
    installed where colibri.get_include() says: a C caller's build finds them all."""
    include = colibri.get_include()
    todo, seen = ["colibri/route.h", "colibri/ffn.h", "colibri/dlpack.h", "colibri/half.h"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = os.path.join(include, name)
        assert os.path.isfile(path), f"{name} is not installed"
        with open(path) as f:
            todo += re.findall(r'^#\s*include\s+"(colibri/[^"]+)"', f.read(), re.MULTILINE)
    assert "colibri/route/rows.h" in seen and "colibri/pool.h" in seen


def test_info_command(tmp_path):
    # from tmp_path: `python -m` puts the current directory first on sys.path
    out = subprocess.run(
        [sys.executable, "-m", "colibri", "info"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout  # fmt: skip
    assert f"colibri {colibri.__version__}" in out
    assert "openmp on" in out and "compiler" in out and "threads" in out


def test_unbuilt_source_tree_says_what_to_run():
    root = Path(__file__).resolve().parents[1]
    if not (root / "colibri" / "_core.pyx").is_file():
        pytest.skip("tests run outside the source tree (an installed wheel)")
    if Path(colibri.__file__).resolve().parent == root / "colibri":
        pytest.skip("an editable install: the source tree is the package")
    done = subprocess.run(
        [sys.executable, "-c", "import colibri"], capture_output=True, text=True, cwd=root
    )
    assert done.returncode != 0
    assert "imported from its source tree" in done.stderr
    assert "pip install --no-build-isolation -e ." in done.stderr
