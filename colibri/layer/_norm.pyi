"""Type stub of colibri.layer._norm: RMSNorm over rows."""

import numpy as np

KIND_PLAIN: int
KIND_FLOAT16: int
KIND_BFLOAT16: int

def rms_norm(
    x: np.ndarray,
    weight: np.ndarray,
    eps: float,
    out: np.ndarray,
    kind: int,
    path: str | None = None,
) -> None: ...
