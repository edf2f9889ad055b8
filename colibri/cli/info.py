"""``colibri info``: version, compiler, OpenMP, threads and the SIMD paths this CPU runs."""

from __future__ import annotations

import argparse
import os
import platform

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``colibri info`` takes no options."""


def run(_args: argparse.Namespace) -> int:
    import numpy as np

    import colibri
    from colibri import _core, layer

    build = _core.build_info()  # routing's kernels; the expert kernels' paths from layer
    print(f"colibri {colibri.__version__} (distribution colibri-moe)")
    print(f"python {platform.python_version()} on {platform.system()} {platform.machine()}")
    print(f"numpy {np.__version__}")
    print(f"compiler {build['compiler']}")
    print(
        f"openmp {'on' if colibri.openmp_enabled() else 'OFF'}"
        + (f" (_OPENMP {_core.openmp_version()})" if colibri.openmp_enabled() else "")
    )
    print(
        f"threads {colibri.max_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"{os.cpu_count()} cpus)"
    )
    print(f"simd {build['simd']}")
    print(
        f"simd path {colibri.simd_path()} (cpu {layer.detected_path()}, COLIBRI_SIMD="
        f"{os.environ.get('COLIBRI_SIMD')}; expert kernel {layer.ffn_path()})"
    )
    print(f"include {colibri.get_include()}")
    return 0
