"""Type stub of colibri.layer._step: a decoder layer's one-token step in two calls."""

import numpy as np

def enter(
    x: np.ndarray,
    norm: np.ndarray,
    eps: float,
    projections: tuple[tuple, tuple, tuple],
    q_norm: np.ndarray | None,
    q_eps: float,
    k_norm: np.ndarray | None,
    k_eps: float,
    cos: np.ndarray,
    sin: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    kind: int,
) -> None: ...
def leave(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    scale: float,
    o_proj: tuple,
    x: np.ndarray,
    norm: np.ndarray,
    eps: float,
    router: tuple | None,
    x_out: np.ndarray,
    h: np.ndarray,
    logits: np.ndarray,
    kind: int,
) -> None: ...
