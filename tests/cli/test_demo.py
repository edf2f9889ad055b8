"""`python -m colibri demo`: the real model (a tiny shape) and the synthetic variant."""

import argparse
import re

import numpy as np
import pytest

import colibri
from colibri.cli import _synthetic_demo, demo

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
            "--synthetic",
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
    inter = _synthetic_demo.demo_shape(2 << 20, 2, 64)
    path = _synthetic_demo.ensure_weight_file(tmp_path, 2, 64, inter, seed=0, progress=False)
    gates = _synthetic_demo._router_weights(2, 64, 0)
    stream = _synthetic_demo._token_stream(12, 64, 0)
    with colibri.Pager(path, budget_bytes=8 << 20) as big:
        with big.load(1, range(_synthetic_demo.NUM_EXPERTS)) as experts:
            stacked = [
                np.stack([getattr(experts[e], m) for e in range(_synthetic_demo.NUM_EXPERTS)])
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
        _synthetic_demo.demo_shape(1000, 4, 2048)


# --------------------------------------------------------------------------------------
# The real model, at a tiny shape.

TINY = ["--layers", "2", "--hidden", "64", "--expert-intermediate", "32", "--vocab", "600",
        "--max-new-tokens", "6", "--no-progress", "--threads", "1",
        "--page-size-kb", "4"]  # tiny experts: 64 KiB pages would not fit the budget  # fmt: skip


def real_args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(["--cache-dir", str(tmp_path), *TINY, *extra])


@pytest.fixture(scope="module")
def real_demo(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("tokenizers")
    return tmp_path_factory.mktemp("demo")


def test_real_demo_writes_once_and_generates(real_demo, capsys):
    assert demo.run(real_args(real_demo)) == 0
    out = capsys.readouterr().out
    (folder,) = [p for p in real_demo.iterdir() if p.name.startswith("demo-qwen3moe")]
    assert not [p for p in real_demo.iterdir() if "partial" in p.name]
    for label in ("2 MoE layers x 26 experts", "prefill", "decode", "hit rate",
                  "read per decoded token", "recall", "peak RSS", "budget of"):  # fmt: skip
        assert label in out, label
    stamp = (folder / "model.safetensors.index.json").stat().st_mtime_ns
    assert demo.run(real_args(real_demo, "--no-prefetch", "--batch-size", "2")) == 0
    assert (folder / "model.safetensors.index.json").stat().st_mtime_ns == stamp  # cached


def test_real_demo_is_a_transformers_checkpoint(real_demo):
    """transformers itself loads what the demo wrote; the paged model gives its logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from colibri.integrations.transformers import from_pretrained, patch

    folder = demo.ensure_checkpoint(real_demo, demo.DemoShape(2, 64, 32, 600), progress=False)
    shape = demo.DemoShape(2, 64, 32, 600)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "The colibri is a small bird"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    resident = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert resident.dtype == torch.bfloat16
    assert resident.config.num_experts == 26 and resident.config.num_experts_per_tok == 2
    patch(resident)
    paged = from_pretrained(folder, budget=shape.expert_bytes // 8, page_size_kb=4)
    ids = tokenizer([text], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want, got = resident(ids).logits.float(), paged(ids).logits.float()
    # bf16: two rounded products here, one fused there (see test_checkpoint's bf16 test)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    assert paged.colibri.expert_bytes == shape.expert_bytes >= 8 * paged.colibri.pager.budget_bytes


def test_real_demo_partition(real_demo, capsys):
    assert demo.run(real_args(real_demo, "--partition", "2")) == 0
    assert "Static Expert Partitioning into 2 groups" in capsys.readouterr().out


def test_default_demo_shape():
    shape = demo.DemoShape()
    assert (shape.num_experts, shape.top_k, shape.layers) == (26, 2, 15)
    assert 2.5 * (1 << 30) < shape.expert_bytes < 3.5 * (1 << 30)  # several GiB
