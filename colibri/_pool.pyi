"""Type stub of colibri._pool: the process's one worker pool."""

from typing import Any

POOL: Any
