"""Random valid quantized weight blocks and GGUF files of stacked experts, for the tests of
the quantized kernels and of the engine over them."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as G

from colibri.layer import _quant

GGUF_TYPES = {
    "q8_0": G.Q8_0, "q4_0": G.Q4_0, "q4_k": G.Q4_K, "q5_k": G.Q5_K, "q6_k": G.Q6_K,
    "iq4_xs": G.IQ4_XS, "mxfp4": G.MXFP4,
}  # fmt: skip
# where each format keeps its float16 scales (byte offsets in a block)
F16_FIELDS = {"q8_0": [0], "q4_0": [0], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208],
              "iq4_xs": [0], "mxfp4": []}  # fmt: skip
# the largest |level x sub-block scale| of each format: scales are drawn so weights are ~0.05
LEVELS = {"q8_0": 127, "q4_0": 8, "q4_k": 63 * 15, "q5_k": 63 * 31, "q6_k": 128 * 32,
          "iq4_xs": 32 * 127, "mxfp4": 1}  # fmt: skip


def random_blocks(rng, qtype, rows, blocks, finite=True):
    """Random blocks of ``qtype``; with ``finite``, every float16 scale a finite number."""
    size = _quant.BLOCK_BYTES[qtype]
    w = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    if finite:
        for at in F16_FIELDS[qtype]:
            scale = rng.uniform(-0.05, 0.05, (rows, blocks)) / LEVELS[qtype]
            scale = scale.astype(np.float16)
            w[:, :, at : at + 2] = scale.view(np.uint8).reshape(rows, blocks, 2)
        if qtype == "mxfp4":  # E8M0 scales around 2^-6
            w[:, :, 0] = rng.integers(118, 126, (rows, blocks))
    return w.reshape(rows, blocks * size)


def write_gguf(path, layers):
    """A GGUF file of stacked experts: layers[l] = (gate, up, down) raw blocks
    [E, rows, row_bytes] with their types."""
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for lay, mats in enumerate(layers):
        for name, (qtype, blocks) in zip(("gate", "up", "down"), mats, strict=True):
            w.add_tensor(f"blk.{lay}.ffn_{name}_exps.weight", blocks, raw_dtype=GGUF_TYPES[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
