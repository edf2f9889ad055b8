"""Expert weight formats: safetensors (single or sharded), GGUF, and colibri's raw file.

``open_weights(path)`` picks the reader from the file and returns a validated
:class:`WeightSource` mapping ``(layer, expert)`` to the byte ranges of the expert's
``gate [I, H]``, ``up [I, H]`` and ``down [H, I]`` matrices.
"""

from colibri.formats._base import (
    ExpertLayout,
    ExpertWeights,
    FormatError,
    TensorInfo,
    TensorRef,
    WeightSource,
    expert_tensor,
)
from colibri.formats._open import open_weights
from colibri.formats._repack import repack

__all__ = [
    "ExpertLayout",
    "ExpertWeights",
    "FormatError",
    "TensorInfo",
    "TensorRef",
    "WeightSource",
    "expert_tensor",
    "open_weights",
    "repack",
]
