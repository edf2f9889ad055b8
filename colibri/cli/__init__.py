"""The ``colibri`` command: one module per subcommand, each with ``add_arguments`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name, module, help; each module is imported only when its subcommand runs
COMMANDS = (
    ("info", "colibri.cli.info", "version, compiler, OpenMP, threads and SIMD paths"),
    ("demo", "colibri.cli.demo", "run an MoE model larger than its memory budget"),
    ("generate", "colibri.cli.generate", "generate from an MoE checkpoint under a memory budget"),
    ("partition", "colibri.cli.partition", "build a partition from usage statistics"),
)


def spin_briefly() -> None:
    """Have OpenMP's idle threads sleep soon (``GOMP_SPINCOUNT=1000``) unless the user chose.

    torch's OpenMP workers spin for a while after each of its operations; on a machine with
    as many cores as threads, colibri's kernel that runs next shares a core with a spinner
    (bench/README.md has the figures). Takes effect only before torch loads its OpenMP (then
    it is too late, and nothing is changed)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("GOMP_SPINCOUNT", "1000")


def main(argv: list[str] | None = None) -> int:
    """Run ``colibri <command> ...``; returns the exit status."""
    spin_briefly()
    parser = argparse.ArgumentParser(prog="colibri", description="MoE routing and expert paging.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module, text in COMMANDS:
        mod = importlib.import_module(module)
        sub = commands.add_parser(name, help=text)
        mod.add_arguments(sub)
        sub.set_defaults(run=mod.run)
    args = parser.parse_args(argv)
    return args.run(args)
