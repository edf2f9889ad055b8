"""`python -m colibri demo` with a tiny file: runs, caches, and pages the right weights."""

import argparse
import re

import numpy as np
import pytest

import colibri
from colibri import demo

needs_core = pytest.mark.skipif(
    not all(hasattr(colibri, name) for name in ("Pager", "init")),
    reason="needs colibri.Pager and colibri.init (pager and routing core)",
)


def demo_args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(
        [
            "--cache-dir",
            str(tmp_path),
            "--file-size",
            "2MB",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--tokens",
            "24",
            "--no-progress",
            *extra,
        ]
    )


def test_parse_size():
    assert demo.parse_size("2GB") == 2 << 30
    assert demo.parse_size("512MiB") == 512 << 20
    assert demo.parse_size("1.5k") == 1536
    assert demo.parse_size("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        demo.parse_size("lots")


@needs_core
def test_demo_runs_and_caches_the_file(tmp_path, capsys):
    assert demo.run(demo_args(tmp_path)) == 0
    out = capsys.readouterr().out
    for label in ("tokens/s", "hit rate", "read/token", "peak RSS", "budget"):
        assert label in out
    files = sorted(tmp_path.glob("demo-*.colibri"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    hits = re.search(r"hit rate\s*: ([0-9.]+)%", out)
    assert hits is not None and 0.0 <= float(hits.group(1)) <= 100.0
    assert demo.run(demo_args(tmp_path, "--policy", "fifo", "--batch-size", "4")) == 0
    assert files[0].stat().st_mtime_ns == mtime  # cached, not rewritten


@needs_core
def test_demo_partition(tmp_path, capsys):
    if not hasattr(colibri, "Partition"):
        pytest.skip("needs colibri.Partition")
    assert demo.run(demo_args(tmp_path, "--partition", "2")) == 0
    assert "partition into 2 groups" in capsys.readouterr().out


@needs_core
def test_paged_layer_matches_in_memory(tmp_path):
    """The demo file through a small-budget Pager gives the same outputs as in memory."""
    inter = demo.demo_shape(2 << 20, 2, 64)
    path = demo.ensure_weight_file(tmp_path, 2, 64, inter, seed=0, progress=False)
    gates = demo._router_weights(2, 64, 0)
    stream = demo._token_stream(12, 64, 0)
    with colibri.Pager(path, budget_bytes=8 << 20) as big:
        with big.load(1, range(demo.NUM_EXPERTS)) as experts:
            stacked = [
                np.stack([getattr(experts[e], m) for e in range(demo.NUM_EXPERTS)])
                for m in ("gate", "up", "down")
            ]
        resident = colibri.InMemoryExperts(*stacked)
    weight, bias = gates[1]
    ref = colibri.MoELayer(weight, resident, 2, gate_bias=bias, activation="gelu_tanh")(stream)
    with colibri.Pager(path, budget_bytes=4 * 64 * 1024, policy="lru") as pager:
        layer = colibri.MoELayer(weight, pager, 2, layer=1, gate_bias=bias, activation="gelu_tanh")
        out = np.concatenate([layer(stream[t : t + 1]) for t in range(len(stream))])
        assert pager.stats.misses > 0
    # one token at a time (gemv) vs the whole batch (gemm): same math, other rounding
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_too_small_file_is_refused():
    with pytest.raises(ValueError, match="too small"):
        demo.demo_shape(1000, 4, 2048)
