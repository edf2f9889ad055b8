"""The ``colibri`` command: one module per subcommand, each with ``add_arguments`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

# name, module, help; each module is imported only when its subcommand runs
COMMANDS = (
    ("info", "colibri.cli.info", "version, compiler, OpenMP, threads and SIMD paths"),
    ("demo", "colibri.cli.demo", "run an MoE model larger than its memory budget"),
    ("generate", "colibri.cli.generate", "generate from an MoE checkpoint under a memory budget"),
    ("partition", "colibri.cli.partition", "build a partition from usage statistics"),
    ("quantize", "colibri.cli.quantize", "rewrite a checkpoint with block-quantized experts"),
)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors reach :func:`main` as one line, like every other error."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


class _UsageError(ValueError):
    """A command line argparse refused."""


def _one_line(error: BaseException) -> str:
    """``error``'s message on one line (some list one problem per line)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    """Run ``colibri <command> ...``; returns the exit status.

    Every error of the user's making (an argument, a file, a checkpoint, a missing extra:
    colibri's exceptions, ``OSError``, ``ValueError``, ``ImportError``) is one line on stderr,
    ``colibri: error: <message>``, and exit status 2; Ctrl-C is status 130. No traceback.
    """
    from colibri._errors import ColibriError

    parser = _Parser(prog="colibri", description="MoE routing and expert paging.")
    commands = parser.add_subparsers(dest="command", required=True)
    try:
        for name, module, text in COMMANDS:
            mod = importlib.import_module(module)
            sub = commands.add_parser(name, help=text)
            mod.add_arguments(sub)
            sub.set_defaults(run=mod.run)
        args = parser.parse_args(argv)
        return args.run(args)
    except KeyboardInterrupt:
        print("colibri: interrupted", file=sys.stderr)
        return 130
    except (ColibriError, OSError, ValueError, ImportError) as error:
        print(f"colibri: error: {_one_line(error)}", file=sys.stderr)
        return 2
