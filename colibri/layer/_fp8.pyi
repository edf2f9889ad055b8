"""Type stub of colibri.layer._fp8: float8 (e4m3fn, 128 x 128 block scales) experts
(include/colibri/fp8.h)."""

import numpy as np

BLOCK: int
MAX_ROWS: int

def table() -> np.ndarray: ...
def scale_shape(rows: int, cols: int) -> tuple[int, int]: ...
def dequantize(w: np.ndarray, scale: np.ndarray) -> np.ndarray: ...
def find_nonfinite(w: np.ndarray, scale: np.ndarray) -> tuple[str, int, int] | None: ...
def matmul(
    w: np.ndarray, scale: np.ndarray, x: np.ndarray, path: str | None = None
) -> np.ndarray: ...
def ffn(
    gate: np.ndarray,
    up: np.ndarray,
    down: np.ndarray,
    scales: tuple[np.ndarray, np.ndarray, np.ndarray],
    x: np.ndarray,
    act: str = "silu",
    num_threads: int = 0,
    path: str | None = None,
) -> np.ndarray: ...
def ffn_sum(
    x: np.ndarray,
    experts: list[tuple[np.ndarray, ...]],
    act: str,
    bounds: np.ndarray,
    rows: np.ndarray,
    scale: np.ndarray,
    y: np.ndarray,
    num_threads: int = 0,
    path: str | None = None,
) -> None: ...
