"""The ``colibri`` command: one module per subcommand, each with ``add_arguments`` and ``run``."""

from __future__ import annotations

import argparse
import importlib

# name, module, help; each module is imported only when its subcommand runs
COMMANDS = (
    ("info", "colibri.cli.info", "version, compiler, OpenMP, threads and SIMD paths"),
    ("demo", "colibri.cli.demo", "run an MoE model larger than its memory budget"),
    ("generate", "colibri.cli.generate", "generate from an MoE checkpoint under a memory budget"),
    ("partition", "colibri.cli.partition", "build a partition from usage statistics"),
)


def main(argv: list[str] | None = None) -> int:
    """Run ``colibri <command> ...``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="colibri", description="MoE routing and expert paging.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module, text in COMMANDS:
        mod = importlib.import_module(module)
        sub = commands.add_parser(name, help=text)
        mod.add_arguments(sub)
        sub.set_defaults(run=mod.run)
    args = parser.parse_args(argv)
    return args.run(args)
