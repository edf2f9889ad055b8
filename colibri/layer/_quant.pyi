"""Type stub of colibri.layer._quant: block-quantized weights (include/colibri/quant.h) and
the fused quantized expert FFN (include/colibri/qffn.h)."""

import numpy as np

TYPES: dict[str, int]
TYPE_NAMES: dict[int, str]
BLOCK: dict[str, int]
BLOCK_BYTES: dict[str, int]
MXFP4_OSS: str
Q4_0X8: str
INTERLEAVE_FAST: bool
ACTIVATIONS: dict[str, int]

def linear_type(qtype: str, rows: int) -> int: ...
def interleave(w: np.ndarray) -> np.ndarray: ...
def row_values(qtype: str, row_bytes: int) -> int: ...
def dequantize(qtype: str, w: np.ndarray) -> np.ndarray: ...
def nonfinite_block(qtype: str, w: np.ndarray) -> int: ...
def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
def matmul(
    qtype: str,
    w: np.ndarray,
    x: np.ndarray,
    path: str | None = None,
    scales: np.ndarray | None = None,
) -> np.ndarray: ...
def linear(
    qtype: str,
    w: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    num_threads: int = 0,
    bias: np.ndarray | None = None,
    path: str | None = None,
    kind: int = 0,
) -> None: ...
def ffn(
    qtype: str,
    gate: np.ndarray,
    up: np.ndarray,
    down: np.ndarray,
    x: np.ndarray,
    act: str = "silu",
    num_threads: int = 0,
    path: str | None = None,
    down_type: str | None = None,
) -> np.ndarray: ...
def ffn_sum(
    x: np.ndarray,
    experts: list[tuple[np.ndarray, ...]],
    qtype: str,
    act: str,
    bounds: np.ndarray,
    rows: np.ndarray,
    scale: np.ndarray,
    y: np.ndarray,
    num_threads: int = 0,
    path: str | None = None,
    down_type: str | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> None: ...

SMALL_BLOCK_TYPES: tuple[str, ...]

def check_row_values(qtype: str, values: int) -> None: ...
def quantize(x: np.ndarray, qtype: str, num_threads: int = 0) -> np.ndarray: ...

class Held:
    num_experts: int
    hidden: int
    missing: list[int]
    active: list[int]
    def __init__(
        self, num_experts: int, hidden: int, act: str, max_rows: int, path: str | None = None
    ) -> None: ...
    def hold(
        self, e: int, mats: tuple[np.ndarray, np.ndarray, np.ndarray], qtype: str, down_type: str
    ) -> bool: ...
    def hold_half(
        self, e: int, mats: tuple[np.ndarray, np.ndarray, np.ndarray], kind: int
    ) -> bool: ...
    def step(
        self,
        x: np.ndarray,
        ids: np.ndarray,
        weights: np.ndarray,
        out: np.ndarray,
        kind: int,
        num_threads: int = 0,
        residual: np.ndarray | None = None,
        rounded: bool = False,
    ) -> int: ...
