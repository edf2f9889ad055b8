"""The quantizers ``colibri.layer._quant.quantize`` (include/colibri/quantize.h).

References: the ``gguf`` package's numpy quantizers, bit for bit, where it has one (Q8_0,
Q4_0, MXFP4); for the K-quants and IQ4_XS (which gguf-py cannot quantize) the round trip
``dequantize(quantize(x))``, with ``gguf.quants.dequantize`` reading the blocks, within a
per-type bound of ``x`` and, where the type allows, exactly reproducing already-representable
values.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri.layer import _quant

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as G  # noqa: E402

TYPES = list(_quant.TYPES)
# Relative RMS error of Gaussian rows measured with these quantizers (seed 0, 64 x 1024):
# q8_0 0.0054, q4_0 0.0862, q4_k 0.0715, q5_k 0.0363, q6_k 0.0178, iq4_xs 0.0770,
# mxfp4 0.1156; the bounds leave ~15% of headroom.
BOUND = {"q8_0": 0.0065, "q4_0": 0.1, "q4_k": 0.085, "q5_k": 0.042, "q6_k": 0.021,
         "iq4_xs": 0.09, "mxfp4": 0.135}  # fmt: skip
# Types whose quantizer maps its own dequantized Gaussian rows back to exactly those values.
STABLE = ["q8_0", "q4_0", "q4_k", "mxfp4"]


def _rows(seed=0, rows=64, cols=1024, scale=0.05):
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * scale
    x[1, :256] = 0.0  # an all-zero block of every size
    x[2, :32] = 0.3  # a block of equal values (ties for the largest |x|)
    x[3, 40] = 5.0  # an outlier
    return x


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "mxfp4"])
def test_bits_of_gguf_quantizers(qtype):
    x = _rows()
    got = _quant.quantize(x, qtype)
    want = gguf.quants.quantize(x, getattr(G, qtype.upper()))
    assert got.shape == want.shape and got.dtype == np.uint8
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", TYPES)
def test_round_trip_within_bound(qtype):
    x = _rows(1)
    blocks = _quant.quantize(x, qtype)
    assert blocks.shape == (64, 1024 // _quant.BLOCK[qtype] * _quant.BLOCK_BYTES[qtype])
    back = gguf.quants.dequantize(blocks, getattr(G, qtype.upper()))
    np.testing.assert_array_equal(back, _quant.dequantize(qtype, blocks))
    gauss = slice(4, None)  # the Gaussian rows
    err = np.linalg.norm(back[gauss] - x[gauss]) / np.linalg.norm(x[gauss])
    assert err < BOUND[qtype], err
    assert not back[1, :256].any()  # zeros stay zeros
    assert np.isfinite(back).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_representable_values(qtype):
    """Quantizing already-dequantized values: exactly the same values for the types whose
    search lands on the same scales again; within 1% for q5_k, q6_k and iq4_xs (their grid
    of candidate scales may pick another that fits as well). An outlier's block is not
    stable in any K-quant (its 6-bit sub-block scales are rounded again)."""
    once = _quant.dequantize(qtype, _quant.quantize(_rows(2)[4:], qtype))
    twice = _quant.dequantize(qtype, _quant.quantize(once, qtype))
    if qtype in STABLE:
        np.testing.assert_array_equal(twice, once)
    else:
        assert np.linalg.norm(twice - once) / np.linalg.norm(once) < 0.01


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "iq4_xs"])
def test_half_inputs_and_threads(qtype):
    x = _rows(3, rows=16)
    want = _quant.quantize(x.astype(np.float16).astype(np.float32), qtype)
    np.testing.assert_array_equal(_quant.quantize(x.astype(np.float16), qtype), want)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(
        _quant.quantize(bf, qtype, num_threads=1),
        _quant.quantize(bf.astype(np.float32), qtype, num_threads=3),
    )


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values(bad):
    x = _rows(rows=4)
    x[2, 77] = bad
    with pytest.raises(ValueError, match=r"NaN or inf \(first at row 2, column 77"):
        _quant.quantize(x, "q4_k")


def test_row_lengths():
    x = np.ones((2, 96), np.float32)
    with pytest.raises(ValueError, match=r"q4_k quantizes rows in blocks of 256 values, but "
                       r"these rows hold 96 .*32-value blocks \(q8_0, q4_0, mxfp4\)"):  # fmt: skip
        _quant.quantize(x, "q4_k")
    with pytest.raises(ValueError, match=r"hold 40 .*no colibri type fits"):
        _quant.quantize(np.ones((2, 40), np.float32), "q8_0")
    with pytest.raises(TypeError, match="2-D float32, float16 or bfloat16"):
        _quant.quantize(np.ones((2, 32), np.float64), "q8_0")
    with pytest.raises(ValueError, match="must be one of"):
        _quant.quantize(np.ones((2, 32), np.float32), "q3_k")
    assert _quant.quantize(np.ones((0, 256), np.float32), "q6_k").shape == (0, 210)


def test_the_block_tables_agree():
    """The tables the reader (formats) and the command keep of quant.h's types."""
    from colibri.cli.quantize import TYPES as CHOICES
    from colibri.formats.safetensors import QUANTIZED_BLOCKS

    assert {t: (_quant.BLOCK[t], _quant.BLOCK_BYTES[t]) for t in TYPES} == QUANTIZED_BLOCKS
    assert tuple(TYPES) == CHOICES
