"""Type stub of colibri.layer._rope: rotary position embedding of rows."""

import numpy as np

def rope(
    x: np.ndarray, cos: np.ndarray, sin: np.ndarray, kind: int, path: str | None = None
) -> None: ...
