"""colibri inside ``torch.compile``: the routing and the paged experts as custom operators.

A tiny qwen3_moe (2 layers, hidden 32) patched with colibri, and the same model saved and
loaded paged by ``from_pretrained`` under a budget below one layer's experts, compile in
one graph (``fullgraph=True`` raises on any graph break) whose colibri nodes are the
``colibri::route`` / ``colibri::experts`` operators; the compiled logits and generations
equal the eager ones (bit for bit with ``aot_eager``; inductor may fuse the rest of the
model differently: 1e-5), and the pager's counters show the experts were paged.
"""

from __future__ import annotations

import argparse
import copy
import gc
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

from _support.hf_families import (  # noqa: E402
    build_model,
    logits,
    randomise_routers,
    save_patched,
    token_ids,
)
from colibri.cli import generate as cli_generate  # noqa: E402
from colibri.integrations.transformers import from_pretrained, patch  # noqa: E402
from colibri.integrations.transformers._patch import _STATE  # noqa: E402

BUDGET = 48 * 1024  # four 4 KiB-paged experts of this model: less than a layer's eight
PROMPT = "hello world"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(folder, model)``: the checkpoint (with a tokenizer) and the resident model it was
    saved from, patched with colibri."""
    folder = tmp_path_factory.mktemp("compile")
    return folder, save_patched(build_model("qwen3_moe"), folder, "20KB")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: dynamo's recompile limit counts the compilations of a
    code object (the model class's forward) across every model of the process."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _paged(folder):
    model = from_pretrained(folder, budget=BUDGET, page_size_kb=4)
    assert model.colibri.pager.capacity < min(model.colibri.layers.values())
    return model


def _routing(model):
    return next(m.__dict__[_STATE].routing for m in model.modules() if _STATE in m.__dict__)


def test_paged_model_compiles_in_one_graph(tiny):
    """The fast test: dynamo alone (backend ``eager``) on the paged model."""
    folder, ref = tiny
    paged = _paged(folder)
    ids = token_ids(1)
    want = logits(paged, ids)
    torch.testing.assert_close(want, logits(ref, ids), rtol=0, atol=1e-5)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    paged.colibri.reset_stats()
    got = logits(torch.compile(paged, fullgraph=True, backend=backend), ids)
    assert torch.equal(got, want)
    assert len(graphs) == 1
    for op in ("colibri.route", "colibri.experts"):
        assert graphs[0].code.count(f"torch.ops.{op}") == 2, op  # one per layer
    stats = paged.colibri.stats
    assert stats.misses > 0 and stats.bytes_read > 0 and stats.resident_bytes <= BUDGET
    assert set(stats.per_layer) == set(paged.colibri.layers)
    paged.colibri.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_patched_model_aot_eager(tiny, family):
    """Patched (resident) models through aot_autograd: one graph, the same logits;
    deepseek_v3's selection bias reaches the operator as a live tensor (changed in place,
    the compiled routing follows, as eager routing does)."""
    if family == "qwen3_moe":
        model = tiny[1]
    else:
        model = build_model(family)
        randomise_routers(model, [r.name for r in patch(model)])
    ids = token_ids(2)
    explained = torch._dynamo.explain(model)(ids)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    assert explained.graphs[0].code.count("torch.ops.colibri.route") >= 1
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(logits(compiled, ids), logits(model, ids))
    if family == "deepseek_v3":
        biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        assert biases
        with torch.no_grad():
            for bias in biases:
                bias.copy_(bias.flip(0) * 3)
        assert torch.equal(logits(compiled, ids), logits(model, ids))


def _generate_args(folder, *extra):
    parser = argparse.ArgumentParser()
    cli_generate.add_arguments(parser)
    return parser.parse_args([str(folder), "--budget", str(BUDGET), "--page-size-kb", "4",
                              "--prompt", PROMPT, "--max-new-tokens", "4", "--no-stream",
                              *extra])  # fmt: skip


def _reference_text(folder, ref, new_tokens):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    encoded = tokenizer([PROMPT], return_tensors="pt")
    with torch.no_grad():
        out = ref.generate(**encoded, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
    return tokenizer.decode(out[0], skip_special_tokens=True)


@pytest.mark.slow
def test_generate_compile_flag(tiny):
    """``colibri generate --compile`` through the function the command calls (a fast backend
    here; the command itself uses inductor: see the slow test)."""
    folder, ref = tiny
    args = _generate_args(folder, "--compile")
    assert args.compile and not _generate_args(folder).compile
    model, tokenizer = cli_generate.load(args, args.budget)
    printed: list[str] = []
    try:
        cli_generate.generate(
            model, tokenizer, args, out=printed.append, compile_backend="aot_eager"
        )
        assert hasattr(model.forward, "_torchdynamo_orig_callable")  # really compiled
        assert printed[0] == _reference_text(folder, ref, 4)
        assert model.colibri.stats.misses > 0
    finally:
        model.colibri.close()


@pytest.mark.slow
def test_static_cache_decode_compiled(tiny):
    """A decode with a static KV cache, the forward compiled: transformers' own recipe."""
    folder, ref = tiny
    model = _paged(folder)
    ids = token_ids(2)
    greedy = dict(do_sample=False, max_new_tokens=4, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(ids, **greedy)
        cli_generate.compile_forward(model, "aot_eager")
        got = model.generate(ids, cache_implementation="static", **greedy)
    assert torch.equal(got, want)
    model.colibri.close()


def test_opcheck(tiny):
    folder, ref = tiny
    routing = _routing(ref)
    gen = torch.Generator().manual_seed(3)
    logits_ = torch.randn(5, routing.num_experts, generator=gen)
    torch.library.opcheck(torch.ops.colibri.route.default, (logits_, routing.handle, None, None))
    bias = torch.linspace(-1, 1, routing.num_experts)
    torch.library.opcheck(torch.ops.colibri.route.default, (logits_, routing.handle, bias, None))

    paged = _paged(folder)
    layer = min(paged.colibri.modules)
    state = paged.colibri.modules[layer].__dict__["_colibri_experts"]
    hidden = torch.randn(5, paged.config.hidden_size, generator=gen)
    ids = torch.randint(0, state.num_experts, (5, 2), generator=gen)
    weights = torch.rand(5, 2, generator=gen)
    torch.library.opcheck(torch.ops.colibri.experts.default, (hidden, ids, weights, state.handle))
    out = torch.ops.colibri.experts(hidden, ids, weights, state.handle)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype and out.abs().sum() > 0
    paged.colibri.close()


def test_handles_are_weak_and_per_copy():
    model = build_model("qwen3_moe")
    patch(model)
    handle = _routing(model).handle
    twin = copy.deepcopy(model)
    assert _routing(twin).handle != handle  # a copy routes with its own state
    logits_ = torch.randn(2, _routing(model).num_experts)
    torch.ops.colibri.route(logits_, handle)
    del model
    gc.collect()
    with pytest.raises(RuntimeError, match=f"handle {handle} names no live colibri route"):
        torch.ops.colibri.route(logits_, handle)
    torch.ops.colibri.route(logits_, _routing(twin).handle)


def _cxx() -> bool:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return shutil.which(get_cpp_compiler()) is not None
    except Exception:  # no compiler found, or torch without inductor's C++ backend
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _cxx(), reason="inductor needs a C++ compiler")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor(tiny, capsys):
    """The real compiler: the patched model's logits, and ``colibri generate --compile``."""
    from colibri.__main__ import main

    folder, ref = tiny
    ids = token_ids(4)
    compiled = torch.compile(ref, fullgraph=True)
    torch.testing.assert_close(logits(compiled, ids), logits(ref, ids), rtol=0, atol=1e-5)
    code = main(["generate", str(folder), "--budget", str(BUDGET), "--page-size-kb", "4",
                 "--prompt", PROMPT, "--max-new-tokens", "4", "--compile"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.splitlines()[1] == _reference_text(folder, ref, 4)
