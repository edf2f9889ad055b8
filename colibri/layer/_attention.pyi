"""Type stub of colibri.layer._attention: attention of a few query rows over a cache."""

import numpy as np

def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    out: np.ndarray,
    kind: int,
    mask: np.ndarray | None = None,
    path: str | None = None,
    threads: int = 0,
) -> None: ...
