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
    from _support.hf_families import build_model, save_patched

    folder = tmp_path_factory.mktemp("gen")
    return folder, save_patched(build_model("qwen3_moe"), folder, "20KB")
