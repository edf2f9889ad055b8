"""The build: OpenMP compiled in, headers shipped, the CLI answers."""

import os
import subprocess
import sys

import colibri
from colibri import _core


def test_openmp_is_compiled_in():
    # prange silently runs serially without OpenMP: a wheel that lost it must fail here
    assert colibri.openmp_enabled(), "colibri was built without OpenMP"
    assert _core.openmp_version() >= 200203
    assert colibri.max_threads() >= 1


def test_headers_are_installed():
    include = colibri.get_include()
    for name in ("route.h", "dlpack.h", "half.h"):
        assert os.path.isfile(os.path.join(include, "colibri", name))


def test_info_command():
    out = subprocess.run(
        [sys.executable, "-m", "colibri", "info"], capture_output=True, text=True, check=True
    ).stdout
    assert f"colibri {colibri.__version__}" in out
    assert "openmp on" in out and "compiler" in out and "threads" in out
