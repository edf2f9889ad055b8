"""``colibri`` (or ``python -m colibri``): info, the demo (main job) and partition tools."""

from __future__ import annotations

import argparse
import os
import platform
import sys


def _info(_args: argparse.Namespace) -> int:
    import numpy as np

    import colibri
    from colibri import _core

    build = _core.build_info()
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
        f"simd path {build['path']} (cpu {build['detected']}, COLIBRI_SIMD="
        f"{os.environ.get('COLIBRI_SIMD')}; expert kernel {build['ffn_path']})"
    )
    print(f"include {colibri.get_include()}")
    return 0


def _subcommand(module: str):
    """Load a subcommand module lazily: its optional dependencies stay optional."""
    import importlib

    return importlib.import_module(module)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="colibri", description="MoE routing and expert paging.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="version, compiler, OpenMP and threads").set_defaults(
        run=_info
    )
    for name, module, text in (
        ("demo", "colibri.demo", "run a seed-shaped MoE larger than its memory budget"),
        ("partition", "colibri._partition_cli", "build a partition from usage statistics"),
    ):
        try:
            mod = _subcommand(module)
        except ImportError:
            continue
        sub = commands.add_parser(name, help=text)
        mod.add_arguments(sub)
        sub.set_defaults(run=mod.run)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
