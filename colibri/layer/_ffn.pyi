"""Type stub of colibri.layer._ffn: the fused expert FFN kernel and the one SIMD dispatch."""

import numpy as np

PATHS: tuple[str, ...]
MAX_ROWS: int
ACTIVATIONS: dict[str, int]
WEIGHT_KINDS: dict[str, int]

def simd_env_check() -> None: ...
def simd_path() -> str: ...
def detected_path() -> str: ...
def has_avx512fp16() -> bool: ...
def runnable_paths() -> tuple[str, ...]: ...
def ffn_path() -> str: ...
def path_index(path: str | None) -> int: ...
def ffn(
    x: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    down: np.ndarray,
    kind: int,
    act: int,
    y: np.ndarray,
    num_threads: int,
    path: str | None = None,
) -> None: ...
def ffn_sum(
    x: np.ndarray,
    experts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    kind: int,
    act: int,
    bounds: np.ndarray,
    rows: np.ndarray,
    scale: np.ndarray,
    y: np.ndarray,
    num_threads: int,
    path: str | None = None,
) -> None: ...
def read_pass(words: np.ndarray, num_threads: int = 0) -> int: ...
def linear(
    x: np.ndarray,
    w: np.ndarray,
    kind: int,
    y: np.ndarray,
    num_threads: int,
    bias: np.ndarray | None = None,
    path: str | None = None,
) -> None: ...
