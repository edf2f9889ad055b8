"""Type stub of colibri.layer._step: a decoder layer's one-token step around its attention."""

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

WARM_MAX: int

def warm(*arrays: object) -> None: ...

class AttentionStep:
    H: int
    Hq: int
    Hkv: int
    D: int
    E: int
    kind: int
    def __init__(
        self,
        norm: tuple[np.ndarray, float],
        projections: tuple[tuple, tuple, tuple],
        q_norm: tuple[np.ndarray, float] | None,
        k_norm: tuple[np.ndarray, float] | None,
        o_proj: tuple,
        norm_post: tuple[np.ndarray, float],
        router: tuple | None,
        heads: tuple[int, int, int],
        dtype: str = "float32",
    ) -> None: ...
    def __call__(
        self,
        x: np.ndarray,
        cos: np.ndarray,
        sin: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        row: int,
        scale: float,
        x_out: np.ndarray,
        h: np.ndarray,
        logits: np.ndarray | None = None,
    ) -> None: ...
    def warm(self) -> None: ...
