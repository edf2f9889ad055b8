"""colibri.layer.warm: the idle helper's prefetch between kernel calls changes no result,
whatever it is handed (memory freed or unmapped meanwhile, arrays far larger than the
caches), and bad arguments are named."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from colibri.layer import WARM_MAX, half_linear, quant_linear, quantize, warm
from colibri.layer._step import WARM_MAX as STEP_WARM_MAX


def _weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((512, 256)).astype(np.float32)
    q = quantize(w, "q8_0")
    bits = (rng.integers(0, 2**14, (512, 256)) | 0x3C00).astype(np.uint16)  # float16, finite
    xs = [rng.standard_normal((1, 256)).astype(np.float32) for _ in range(8)]
    return q, bits, xs


def test_calls_right_after_a_warm_give_their_results():
    """A warm of 64 MiB (the helper still prefetching when the next call starts, every time)
    before each of 200 two-thread calls: each result is the one-thread call's, bit for bit
    (a warm's chunks must never count as the call's)."""
    q, bits, xs = _weights()
    big = np.ones(64 << 20, np.uint8)
    want = [(quant_linear(x, q, "q8_0", None, 1), half_linear(x, bits, "float16", None, 1))
            for x in xs]  # fmt: skip
    for i in range(200):
        x = xs[i % len(xs)]
        warm(big, q, bits)
        got_q = quant_linear(x, q, "q8_0", None, 2)
        warm(big)
        got_h = half_linear(x, bits, "float16", None, 2)
        np.testing.assert_array_equal(got_q, want[i % len(xs)][0])
        np.testing.assert_array_equal(got_h, want[i % len(xs)][1])


def test_warms_and_calls_from_several_threads():
    """Python threads warming and calling at once (a warm finds the helpers taken, or hands
    them work another thread's call takes over): every result is right."""
    from concurrent.futures import ThreadPoolExecutor

    q, _, xs = _weights(1)
    big = np.ones(16 << 20, np.uint8)
    want = [quant_linear(x, q, "q8_0", None, 1) for x in xs]

    def call(i: int) -> np.ndarray:
        warm(big, q)
        return quant_linear(xs[i % len(xs)], q, "q8_0", None, 2)

    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(call, range(300)))
    for i, y in enumerate(got):
        np.testing.assert_array_equal(y, want[i % len(xs)])


_GONE = r"""
import gc, mmap, sys
import numpy as np
from colibri.layer import quant_linear, quantize, warm

rng = np.random.default_rng(0)
q = quantize(rng.standard_normal((256, 256)).astype(np.float32), "q8_0")
x = rng.standard_normal((1, 256)).astype(np.float32)
want = quant_linear(x, q, "q8_0", None, 1)
quant_linear(x, q, "q8_0", None, 2)  # the helper started and spinning
with open(sys.argv[1], "wb") as f:
    f.truncate(32 << 20)
for _ in range(50):
    with open(sys.argv[1], "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(m, np.uint8)
    freed = np.ones(8 << 20, np.uint8)  # its own mapping: unmapped when freed
    warm(view, freed)
    del view, freed
    m.close()  # unmapped while the helper may still prefetch it
    gc.collect()
    assert (quant_linear(x, q, "q8_0", None, 2) == want).all()
print("alive")
"""


def test_a_warm_of_memory_unmapped_meanwhile_is_harmless(tmp_path):
    """Arrays freed and files unmapped right after their warm: the helper's prefetches of
    addresses no longer mapped never fault (in a child process, so a crash would be seen)."""
    out = subprocess.run([sys.executable, "-c", _GONE, str(tmp_path / "weights.bin")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["alive"]


def test_bad_arguments_are_named():
    assert WARM_MAX == STEP_WARM_MAX == 8
    a = np.zeros(64, np.float32)
    warm()  # nothing to warm
    warm(*[a] * WARM_MAX)
    with pytest.raises(ValueError, match=r"warm\(\): at most 8 arrays \(got 9\)"):
        warm(*[a] * 9)
    with pytest.raises(ValueError, match=r"warm\(\): array 1 must be C-contiguous"):
        warm(a, np.zeros((8, 8))[:, ::2])
    with pytest.raises(TypeError, match=r"warm\(\): array 0 must be an array .* \(got object\)"):
        warm(object())
    warm(b"bytes", bytearray(16), memoryview(a), np.zeros(0))  # any buffer, empty ones too
