"""Expert weight formats: safetensors (single or sharded), GGUF, and colibri's raw file.

``open_weights(path)`` picks the reader from the file and returns a validated
:class:`WeightSource` mapping ``(layer, expert)`` to the byte ranges of the expert's
``gate [I, H]``, ``up [I, H]`` and ``down [H, I]`` matrices (float8 experts: and their
128 x 128 block scales, ``FP8_BLOCKED``).
"""

from colibri.formats._base import (
    FP8_BLOCK,
    FP8_BLOCKED,
    ExpertLayout,
    ExpertWeights,
    FormatError,
    TensorInfo,
    TensorRef,
    WeightSource,
    expert_tensor,
    fp8_scale,
    is_fp8_scale,
)
from colibri.formats._open import open_weights
from colibri.formats._repack import repack

__all__ = [
    "FP8_BLOCK",
    "FP8_BLOCKED",
    "ExpertLayout",
    "ExpertWeights",
    "FormatError",
    "TensorInfo",
    "TensorRef",
    "WeightSource",
    "expert_tensor",
    "fp8_scale",
    "is_fp8_scale",
    "open_weights",
    "repack",
]
