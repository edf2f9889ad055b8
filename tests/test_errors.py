"""Every misuse raises a precise exception naming the value and the fix; nothing crashes."""

import os
import platform
from pathlib import Path

import numpy as np
import pytest

import colibri

X = np.zeros((3, 8), np.float32)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(num_experts=0, top_k=1), ValueError, "num_experts must be >= 1"),
        (dict(num_experts=8.0, top_k=1), TypeError, "num_experts must be an int"),
        (dict(num_experts=True, top_k=1), TypeError, "num_experts must be an int"),
        (dict(num_experts=8, top_k=0), ValueError, r"top_k must be between 1 and 8 \(got 0\)"),
        (dict(num_experts=8, top_k=9), ValueError, r"top_k must be between 1 and 8 \(got 9\)"),
        (dict(num_experts=8, top_k=-2), ValueError, "top_k"),
        (
            dict(num_experts=8, top_k=5, num_groups=4),
            ValueError,
            "keeps the 1 smallest group.*only 2 experts; raise topk_groups",
        ),
        (dict(num_experts=26, top_k=8, num_groups=4, topk_groups=1), ValueError, "only 6 experts"),
        (
            dict(num_experts=8, top_k=1, num_groups=0),
            ValueError,
            "num_groups must be between 1 and 8",
        ),
        (
            dict(num_experts=8, top_k=1, num_groups=9),
            ValueError,
            "num_groups must be between 1 and 8",
        ),
        (
            dict(num_experts=8, top_k=1, num_groups=4, topk_groups=0),
            ValueError,
            "topk_groups must be between 1 and 4",
        ),
        (
            dict(num_experts=8, top_k=1, num_groups=4, topk_groups=5),
            ValueError,
            "topk_groups must be between 1 and 4",
        ),
        (
            dict(num_experts=7, top_k=1, num_groups=4, group_score="top2_sum"),
            ValueError,
            "top2_sum.*a group has 1",
        ),
        (dict(num_experts=8, top_k=1, group_score="sum"), ValueError, "group_score must be one of"),
        (dict(num_experts=8, top_k=1, scoring="relu"), ValueError, "scoring must be one of"),
        (dict(num_experts=8, top_k=1, norm_p=0.0), ValueError, "norm_p must be a finite positive"),
        (dict(num_experts=8, top_k=1, scale=float("nan")), ValueError, "scale must be a finite"),
        (dict(num_experts=8, top_k=1, ids_dtype="int16"), ValueError, "ids_dtype must be one of"),
        (
            dict(num_experts=8, top_k=1, normalize="yes"),
            TypeError,
            "normalize must be True or False",
        ),
        (
            dict(num_experts=8, top_k=1, routing_threads=0),
            ValueError,
            "routing_threads must be >= 1",
        ),
        (dict(num_experts=8, top_k=1, batch_size=0), ValueError, "batch_size must be >= 1"),
        (dict(num_experts=8, top_k=1, page_size_kb=6), ValueError, "power of two >= 4"),
        (dict(num_experts=8, top_k=1, page_size_kb=12), ValueError, "power of two >= 4"),
        (dict(num_experts=8, top_k=1, page_size_kb=2), ValueError, "page_size_kb must be >= 4"),
        (
            dict(num_experts=8, top_k=1, correction_bias=np.zeros(7)),
            ValueError,
            r"correction_bias must have shape \(8,\)",
        ),
        (
            dict(num_experts=8, top_k=1, correction_bias=np.zeros(8, np.int64)),
            TypeError,
            "correction_bias must be a floating-point",
        ),
        (
            dict(num_experts=8, top_k=1, correction_bias=np.full(8, np.nan)),
            ValueError,
            "correction_bias must be finite; expert 0",
        ),
        (dict(num_experts=8, top_k=1, expert_scale=np.ones((2, 4))), ValueError, "expert_scale"),
        (dict(num_experts=8, top_k=1, partition=[[0, 1, 2], [3, 4, 5, 6]]), ValueError, "expert"),
        (
            dict(num_experts=8, top_k=1, partition=[[0, 1, 2, 3], [3, 4, 5, 6, 7]]),
            ValueError,
            "expert",
        ),
        (
            dict(num_experts=9, top_k=1, partition=[[0, 1, 2, 3], [4, 5, 6, 7]]),
            ValueError,
            "covers 8 experts but num_experts=9",
        ),
    ],
)
def test_config_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        colibri.Config(**kwargs)


def test_unknown_option_names_the_closest():
    with pytest.raises(TypeError, match="unknown routing option 'topk_group'.*'topk_groups'"):
        colibri.init(8, 2, topk_group=1)
    with pytest.raises(TypeError, match="needs num_experts and top_k"):
        colibri.init(8)


@pytest.mark.parametrize(
    "logits,exc,match",
    [
        (np.zeros((3, 7), np.float32), ValueError, r"last dimension is 7 .* 8 experts"),
        (np.zeros((2, 3, 8), np.float32), ValueError, r"must be \[E\] or \[T, E\]"),
        (np.zeros((), np.float32), ValueError, r"must be \[E\] or \[T, E\]"),
        (np.zeros((3, 8), np.int64), TypeError, "floating point"),
        (np.zeros((3, 8), bool), TypeError, "floating point"),
        (np.zeros((3, 8), np.complex64), TypeError, "dtype"),
        (np.zeros((3, 8), ">f4"), TypeError, "big-endian"),
        ([[0.0] * 8], TypeError, "supports DLPack"),
        ("logits", TypeError, "supports DLPack"),
    ],
)
def test_route_errors(logits, exc, match):
    with pytest.raises(exc, match=match):
        colibri.init(8, 2).route(logits)


def test_ids_are_never_out_of_range_for_extreme_inputs():
    rng = np.random.default_rng(0)
    ctx = colibri.init(8, 3, scoring="sigmoid", correction_bias=np.full(8, -1e30, np.float32))
    for x in (
        np.full((4, 8), 3e38, np.float32),
        np.full((4, 8), -3e38, np.float32),
        rng.choice([np.inf, -np.inf, 0.0], size=(50, 8)).astype(np.float32),
    ):
        ids, w = ctx.route(x)
        assert ((ids >= 0) & (ids < 8)).all()
        assert all(len(set(r)) == 3 for r in ids.tolist())


def test_new_option_errors():
    with pytest.raises(ValueError, match="normalize_eps must be >= 0"):
        colibri.Config(num_experts=8, top_k=2, normalize_eps=-1e-6)
    with pytest.raises(ValueError, match="bias_on must be one of"):
        colibri.Config(num_experts=8, top_k=2, bias_on="weights")


def test_use_avx512_is_checked_against_the_cpu():
    from colibri import _core

    with pytest.raises(TypeError, match="use_avx512 must be None, True or False"):
        colibri.init(8, 2, use_avx512="yes")
    assert not colibri.init(8, 2, use_avx512=False).use_avx512
    # what the CPU offers, from the OS rather than from colibri's own detection
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else None
    runs = "avx512" in _core.build_info()["simd"]
    capped = os.environ.get("COLIBRI_SIMD", "") in ("scalar", "sse2", "avx2")  # a lower path
    if flags is not None and platform.machine() in ("x86_64", "AMD64"):
        assert runs == (" avx512f" in flags and not capped)
    assert colibri.init(8, 2).use_avx512 == runs  # None: wherever it runs
    if runs:
        assert colibri.init(8, 2, use_avx512=True).use_avx512
    else:
        with pytest.raises(ValueError, match="no AVX-512F"):
            colibri.init(8, 2, use_avx512=True)
