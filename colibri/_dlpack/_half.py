"""bfloat16 on the numpy side, where it travels as uint16 bits (numpy has no bfloat16)."""

from __future__ import annotations

import numpy as np

__all__ = ["bf16_to_float32", "float32_to_bf16"]


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values (uint16 bits, or ml_dtypes' bfloat16) as float32: exact."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (nearest even; NaN stays a quiet NaN), as uint16 bits."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded
