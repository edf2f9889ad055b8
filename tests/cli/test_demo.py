"""`colibri demo`: a real transformers checkpoint (a tiny shape), written once, generated."""

import argparse

import pytest

from colibri.cli import demo

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
    assert demo.run(real_args(real_demo, "--no-read-ahead", "--batch-size", "2")) == 0
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
