"""``python -m colibri``: the ``colibri`` command (see :mod:`colibri.cli`)."""

import sys

from colibri.cli import main

if __name__ == "__main__":
    sys.exit(main())
