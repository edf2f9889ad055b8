"""The plan checks of ``ffn_sum`` (``colibri/layer/_plan.pxd``), one copy for the bfloat16,
quantized and float8 kernels: every bad plan is refused by all three with the same message."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.layer import _ffn, _fp8, _quant

T, H = 3, 32


def _call(module, experts, bounds, rows, scale):
    x, y = np.ones((T, H), np.float32), np.zeros((T, H), np.float32)
    bounds, rows = np.asarray(bounds, np.int64), np.asarray(rows, np.int64)
    scale = np.asarray(scale, np.float32)
    if module is _ffn:
        return _ffn.ffn_sum(x, experts, 2, 0, bounds, rows, scale, y, 0)
    if module is _quant:
        return _quant.ffn_sum(x, experts, "q8_0", "silu", bounds, rows, scale, y)
    return _fp8.ffn_sum(x, experts, "silu", bounds, rows, scale, y)


KERNELS = pytest.mark.parametrize("module", [_ffn, _quant, _fp8], ids=["bf16", "quant", "fp8"])


@KERNELS
@pytest.mark.parametrize(
    ("bounds", "rows", "scale", "message"),
    [
        ([0, 2], [0, 2], [1, 1], "bounds must be [3] from 0"),
        ([0, 1, 2, 3], [0, 2, 1], [1, 1, 1], "bounds must be [3] from 0"),
        ([1, 1, 2], [0, 2], [1, 1], "bounds must be [3] from 0"),
        ([0, 0, 2], [0, 2], [1, 1], "expert 0 has 0 rows (1 to 64)"),
        ([0, 2, 1], [0, 2], [1, 1], "expert 1 has -1 rows (1 to 64)"),
        ([0, 1, 66], [0] * 66, [1] * 66, "expert 1 has 65 rows (1 to 64)"),
        ([0, 1, 2], [0], [1, 1], "rows and scale must be [2] (bounds[-1])"),
        ([0, 1, 2], [0, 2], [1], "rows and scale must be [2] (bounds[-1])"),
        ([0, 1, 2], [0, 3], [1, 1], "row 3 outside x's 3 rows"),
        ([0, 1, 2], [-1, 0], [1, 1], "row -1 outside x's 3 rows"),
    ],
)  # fmt: skip
def test_a_bad_plan_is_refused_alike(module, bounds, rows, scale, message):
    # the plan is checked before any expert is looked at
    with pytest.raises(ValueError) as info:
        _call(module, [None, None], bounds, rows, scale)
    assert str(info.value) == f"ffn_sum(): {message}"


@KERNELS
def test_no_experts_is_a_no_op(module):
    assert _ffn.MAX_ROWS == _fp8.MAX_ROWS == 64  # the limit the messages name
    assert _call(module, [], [0], [], []) is None
