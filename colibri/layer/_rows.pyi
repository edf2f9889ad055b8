"""Type stub of colibri.layer._rows: the dispatch, gather and combine loops."""

import numpy as np

KIND_PLAIN: int
KIND_FLOAT16: int
KIND_BFLOAT16: int

def resolve_threads(num_threads: int | None) -> int: ...
def build_plan(
    ids: np.ndarray,
    num_experts: int,
    block_size: int,
    num_threads: int,
    counts: np.ndarray,
    offsets: np.ndarray,
    sorted_assignments: np.ndarray,
    inverse: np.ndarray,
) -> None: ...
def gather_rows(
    src: np.ndarray, sorted_assignments: np.ndarray, top_k: int, num_threads: int, dst: np.ndarray
) -> None: ...
def gather_rows_float32(
    src: np.ndarray,
    src_kind: int,
    sorted_assignments: np.ndarray,
    top_k: int,
    num_threads: int,
    dst: np.ndarray,
) -> None: ...
def combine_rows(
    expert_out: np.ndarray,
    src_kind: int,
    inverse: np.ndarray,
    weights: np.ndarray,
    num_threads: int,
    out: np.ndarray,
    dst_kind: int,
) -> None: ...
def to_float32(src: np.ndarray, src_kind: int, num_threads: int, dst: np.ndarray) -> None: ...
