"""A tiny qwen3_moe checkpoint with a tokenizer, shared by the command-line tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``(folder, model)``: the checkpoint (20 KB shards, a character-level tokenizer) and
    the resident model it was saved from, patched with colibri (the reference)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from _support.hf_families import build_model, randomise_routers, save_tokenizer
    from colibri.integrations.transformers import patch, unpatch

    folder = tmp_path_factory.mktemp("gen")
    model = build_model("qwen3_moe")
    randomise_routers(model, [r.name for r in patch(model)])
    unpatch(model)
    model.save_pretrained(folder, max_shard_size="20KB")
    save_tokenizer(folder)
    patch(model)
    return folder, model
