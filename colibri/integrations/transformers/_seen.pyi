"""Type stub of colibri.integrations.transformers._seen: a step's modules, compared anew."""

from typing import Any

class Seen:
    modules: tuple
    dtype: Any
    def __init__(
        self, modules: tuple, dtype: Any, names: tuple[str, ...], watched: tuple = ()
    ) -> None: ...
    def same(self, dtype: Any) -> bool: ...

def scalars(module: Any) -> tuple[tuple[str, Any], ...]: ...
