"""The non-expert linears of a ``from_pretrained`` model on colibri's linear kernel
(``linears="colibri"``) against torch's ``F.linear`` (``linears="torch"``), on a tiny bf16
qwen3_moe (hidden 32, two layers).

Both engines accumulate the exact products of a row in float32, add the bias in float32 and
round once to bfloat16; only the summation order differs. For one linear with the same input
x, each float32 result is within (K + 1) u S of the exact one (u = 2^-24, S = sum |w x| +
|b|), and rounding each to bfloat16 moves it by at most half an ulp (2^-8 |y|): so
|colibri - torch| <= 2 (K + 1) u S + 2^-8 (|colibri| + |torch|), checked at every linear
call. Through the model these one-rounding differences feed later layers; the logits are
compared to LOGITS_BOUND (a few bf16 roundings, 2^-6 of the largest logit).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

from _support.hf_families import (  # noqa: E402
    build_model,
    compiled_logits,
    randomise_routers,
    token_ids,
)
from colibri.integrations.transformers import (  # noqa: E402
    _decode,
    _linears,
    from_pretrained,
    patch,
    patched_routers,
    unpatch,
)
from colibri.layer import _ffn  # noqa: E402

U = 2.0**-24
LOGITS_BOUND = 2.0**-6  # relative to the largest |logit|


def _save(folder, **overrides):
    model = build_model("qwen3_moe", **overrides).to(torch.bfloat16)
    randomise_routers(model, [r.name for r in patch(model)])
    unpatch(model)
    with torch.no_grad():  # transformers initialises biases to zeros
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("linears"), attention_bias=True)  # biases too


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True)


def _load(folder, linears):
    return from_pretrained(folder, budget="64MiB", linears=linears)


@pytest.fixture(scope="module")
def models(untied):
    """``(colibri, torch)``: the untied checkpoint with each engine's linears."""
    return _load(untied, "colibri"), _load(untied, "torch")


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times colibri's linear kernel runs (a list, one entry per call: its rows)."""
    calls = []
    real = _ffn.linear

    def counting(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(_ffn, "linear", counting)
    return calls


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def _check_close(got, want):
    bound = LOGITS_BOUND * want.abs().max().item()
    assert (got - want).abs().max().item() <= bound


def test_every_linear_within_one_bf16_rounding_of_torch(models, kernel_calls):
    """Each linear call on colibri's kernel against F.linear on the same input (the bound
    of the module docstring), the routers' logits too, and the logits against the
    torch-linears model's."""
    model, ref = models
    names = {name for choice in model.colibri.linears.values() for name in choice.modules}
    routers = {r.name for r in patched_routers(model)}
    assert {"lm_head", "model.layers.0.self_attn.q_proj"} <= names
    assert routers and routers <= names
    assert all(c.engine == "colibri" for c in model.colibri.linears.values())
    assert all(c.engine == "torch" for c in ref.colibri.linears.values())
    seen = []

    def check(module, args, out):
        x, w, b = args[0], module.weight, getattr(module, "bias", None)
        if isinstance(out, tuple):  # a router: its logits
            out = out[0]
        want = torch.nn.functional.linear(x, w, b)
        size = x.float().abs() @ w.float().abs().T + (0 if b is None else b.float().abs())
        bound = 2 * (w.shape[1] + 1) * U * size + 2.0**-8 * (out.float().abs() + want.float().abs())
        assert out.dtype == x.dtype
        assert ((out.float() - want.float()).abs() <= bound).all()
        seen.append(module)

    hooks = [m.register_forward_hook(check) for n, m in model.named_modules() if n in names]
    ids = token_ids(3, batch=1, length=4)
    got = _logits(model, ids)
    for hook in hooks:
        hook.remove()
    assert len(seen) == len(names) == len(kernel_calls)  # every one on colibri's kernel
    _check_close(got, _logits(ref, ids))
    _check_close(_logits(model, ids[:, :1]), _logits(ref, ids[:, :1]))  # one decoding row


def test_generate_gives_torchs_tokens(models):
    """Greedy generation: the same tokens, on prompts whose top-2 logits at every step are
    further apart than the logits bound (else a rounding could flip the argmax)."""
    model, ref = models
    compared = 0
    for seed in range(8):
        ids = token_ids(seed, batch=1, length=5)
        options = dict(max_new_tokens=2, do_sample=False, output_logits=True,
                       return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
        want = ref.generate(ids, **options)
        top2 = [(s.float().topk(2).values[0], s.abs().max()) for s in want.logits]
        if any(t[0] - t[1] <= 2 * LOGITS_BOUND * top for t, top in top2):
            continue  # near-tied: either token is right
        got = model.generate(ids, **options)
        assert torch.equal(got.sequences, want.sequences)
        compared += 1
    assert compared >= 3


def test_more_than_max_rows_go_to_torch(models, kernel_calls):
    """MAX_ROWS input rows run colibri's kernel; one more row runs torch's F.linear on every
    linear (the prefill of a longer prompt)."""
    model = models[0]
    count = sum(len(c.modules) for c in model.colibri.linears.values())
    rows = _linears.MAX_ROWS
    _logits(model, token_ids(1, batch=1, length=rows))
    assert kernel_calls == [rows] * count
    kernel_calls.clear()
    _logits(model, token_ids(1, batch=1, length=rows + 1))
    assert kernel_calls == []
    _logits(model, token_ids(1, batch=2, length=rows // 2 + 1))  # rows of all sequences
    assert kernel_calls == []


def test_tied_lm_head(tied, kernel_calls):
    """With tied embeddings the LM head runs colibri's kernel on the embedding's own memory
    (no copy): the logits match torch's, and follow an in-place change of the embedding."""
    model, ref = _load(tied, "colibri"), _load(tied, "torch")
    head = model.get_output_embeddings()
    assert head.weight is model.get_input_embeddings().weight
    assert any("lm_head" in c.modules and c.engine == "colibri"
               for c in model.colibri.linears.values())  # fmt: skip
    ids = token_ids(5, batch=1, length=3)
    _check_close(_logits(model, ids), _logits(ref, ids))
    assert kernel_calls
    with torch.no_grad():
        for m in (model, ref):
            m.get_input_embeddings().weight.mul_(-1)
    _check_close(_logits(model, ids), _logits(ref, ids))


def test_follows_changed_weights(untied, kernel_calls):
    """In-place changes of a weight and of a bias, and a weight replaced by another (new
    memory: read again): the logits follow as torch's do."""
    model, ref = _load(untied, "colibri"), _load(untied, "torch")
    count = sum(len(c.modules) for c in model.colibri.linears.values())
    ids = token_ids(6, batch=1, length=3)
    with torch.no_grad():
        for m in (model, ref):
            attention = m.model.layers[1].self_attn
            attention.q_proj.weight.mul_(2)
            attention.v_proj.bias.mul_(-4)
    _check_close(_logits(model, ids), _logits(ref, ids))
    with torch.no_grad():
        for m in (model, ref):
            m.lm_head.weight = torch.nn.Parameter(-m.lm_head.weight, requires_grad=False)
    kernel_calls.clear()
    _check_close(_logits(model, ids), _logits(ref, ids))
    assert len(kernel_calls) == count


def test_auto_records_its_measurement(untied):
    """``"auto"`` times both engines once per distinct shape and keeps the faster, on
    colibri's kernel for as many rows as it won at."""
    model = _load(untied, "auto")
    choices = model.colibri.linears
    assert (96, 32, "bfloat16") in choices  # the LM head
    stepped = set(_decode.stepped(model))  # the attention projections: one engine, summed
    group = [id(c) for c in choices.values() if stepped.issuperset(c.modules)]
    assert len(group) == 2  # q/o [32, 32] and k/v [16, 32]
    sums = [sum(getattr(c, t) * len(c.modules) for c in choices.values() if id(c) in group)
            for t in ("colibri_s", "torch_s")]  # fmt: skip
    for choice in choices.values():
        assert choice.colibri_s > 0 and choice.torch_s > 0
        assert choice.by_rows[1] == (choice.colibri_s, choice.torch_s)
        if id(choice) in group:
            assert choice.engine == ("colibri" if sums[0] < sums[1] else "torch")
            if choice.engine == "colibri" and choice.colibri_s >= choice.torch_s:
                assert choice.rows == 1  # taken along: one row, a decoding step's
                continue
            if choice.engine == "torch":
                assert choice.rows == 0
                continue
        assert choice.engine == ("colibri" if choice.colibri_s < choice.torch_s else "torch")
        if choice.engine == "torch":
            assert choice.rows == 0 and list(choice.by_rows) == [1]
            continue
        # the most rows at which colibri's kernel won; every larger count tried lost
        assert choice.rows in choice.by_rows and choice.rows <= _linears.MAX_ROWS
        ours, theirs = choice.by_rows[choice.rows]
        assert ours < theirs
        for rows, (ours, theirs) in choice.by_rows.items():
            assert rows <= choice.rows or ours >= theirs
        modules = dict(model.named_modules())
        for name in choice.modules:
            assert ("forward" in modules[name].__dict__) == (choice.engine == "colibri")


def test_auto_follows_the_timings(untied, monkeypatch, kernel_calls):
    """Timings made up per shape: colibri's kernel wins everywhere (q/o: MAX_ROWS rows), up to
    4 rows (the LM head), at one row (the routers) or nowhere, narrowly (k/v); the attention
    projections take one engine, colibri's, whose time summed over them wins; the forward
    follows each choice."""
    wins = {32: _linears.MAX_ROWS, 96: 4, 16: 0, 8: 1}  # out features -> most rows it wins at
    as_router = {}

    def made_up(module, num_threads, rows, alone=False):
        out = module.weight.shape[0]
        as_router.setdefault(out, set()).add(alone)
        return (1.0, 2.0) if rows <= wins[out] else (1.2 if out == 16 else 2.0, 1.0)

    monkeypatch.setattr(_linears, "_measure", made_up)
    model = _load(untied, "auto")
    choices = model.colibri.linears
    got = {key[0]: (c.engine, c.rows, sorted(c.by_rows)) for key, c in choices.items()}
    assert got == {32: ("colibri", 8, [1, 8]), 96: ("colibri", 4, [1, 4, 8]),
                   16: ("colibri", 1, [1]), 8: ("colibri", 1, [1, 2, 4, 8])}  # fmt: skip
    # the routers (8 experts) and the attention projections (q/o 32, k/v 16) are timed as a
    # decoding step calls them, inside its native call; the LM head through its forward
    assert as_router == {32: {True}, 96: {False}, 16: {True}, 8: {True}}
    _logits(model, token_ids(1, batch=1, length=4))
    assert len(kernel_calls) == 2 * 2 + 1  # q/o of two layers and the LM head
    kernel_calls.clear()
    _logits(model, token_ids(1, batch=1, length=5))
    assert len(kernel_calls) == 2 * 2  # the LM head's 5 rows went to torch
    kernel_calls.clear()
    _logits(model, token_ids(1, batch=1, length=1))
    # one row: a decoding step, every projection and router inside its native call
    assert len(kernel_calls) == 1


def test_auto_gives_the_attention_projections_one_engine(untied, monkeypatch, kernel_calls):
    """q/o win narrowly alone, k/v lose by far: summed, torch wins, and takes all four (a
    decoding step needs every projection on colibri's kernel, or runs none)."""

    def made_up(module, num_threads, rows, alone=False):
        return {32: (1.0, 1.1), 16: (5.0, 1.0)}.get(module.weight.shape[0], (1.0, 2.0))

    monkeypatch.setattr(_linears, "_measure", made_up)
    model = _load(untied, "auto")
    got = {key[0]: (c.engine, c.rows) for key, c in model.colibri.linears.items()}
    assert got == {32: ("torch", 0), 16: ("torch", 0), 96: ("colibri", 8), 8: ("colibri", 8)}
    _logits(model, token_ids(1, batch=1, length=1))
    assert len(kernel_calls) == 1 + 2  # no step: the LM head and the routers, no projection


def test_auto_times_a_router_as_a_decoding_step_calls_it(untied, monkeypatch, kernel_calls):
    """A router's kernel is timed alone (float32 rows in, no torch tensors converted): its
    logits come from inside the decoding step's native call, not from its forward."""
    model = _load(untied, "torch")

    def converting(*args):
        raise AssertionError("a router timed through its forward's conversions")

    monkeypatch.setattr(_linears, "compute", converting)
    ours, theirs = _linears._measure(model.model.layers[0].mlp.gate, 1, 2, alone=True)
    assert kernel_calls == [2] * (1 + _linears._REPEATS) and ours > 0 and theirs > 0
    with pytest.raises(AssertionError, match="conversions"):
        _linears._measure(model.model.layers[0].self_attn.q_proj, 1, 2)


def test_the_projections_a_decoding_step_computes():
    """The attention projections of the layers whose code a decoding step reproduces, and no
    others: a Mixtral's layers (no q/k norms) have no step."""
    model = build_model("qwen3_moe")
    want = [f"model.layers.{i}.self_attn.{p}" for i in range(len(model.model.layers))
            for p in ("q_proj", "k_proj", "v_proj", "o_proj")]  # fmt: skip
    assert _decode.stepped(model) == want
    assert _decode.stepped(build_model("mixtral")) == []


def test_compiles_in_one_graph(models):
    """Under torch.compile each linear is a ``colibri::linear`` node (fullgraph: no break)."""
    model = models[0]
    count = sum(len(c.modules) for c in model.colibri.linears.values())
    ids = token_ids(2, batch=1, length=3)
    want = _logits(model, ids)
    got, graphs = compiled_logits(model, ids)
    assert torch.equal(got, want)
    assert len(graphs) == 1
    assert graphs[0].code.count("torch.ops.colibri.linear") == count


def test_bad_option(tmp_path):
    """Refused before any file is read (the directory does not exist)."""
    with pytest.raises(ValueError, match=r"from_pretrained\(\): linears"):
        from_pretrained(tmp_path / "nowhere", budget="64MiB", linears="fast")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("native", [False, True])
def test_more_rows_than_the_kernel_takes_compute_in_float32_without_native_halves(
    native, dtype, monkeypatch
):
    """Past the kernel's rows, on a CPU that does not compute the half type natively, a
    linear computes in float32 rounded once (F.linear in float32, bit for bit), within one
    rounding of torch's own GEMM of that type; where it does, torch's own. Each type by its
    own flag: a CPU with native bfloat16 only (Zen 4) computes float16 in float32."""
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    other = {"bfloat16": "float16", "float16": "bfloat16"}[name]
    monkeypatch.setattr(_linears, "NATIVE_HALF", frozenset({name} if native else {other}))
    seen = []  # the dtype of each GEMM's input: the bits alone may not tell the paths apart

    class Spy:
        @staticmethod
        def linear(x, w, b=None):
            seen.append(x.dtype)
            return torch.nn.functional.linear(x, w, b)

    monkeypatch.setattr(_linears, "F", Spy)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(_linears.MAX_ROWS + 5, 96, generator=g).to(dtype)
    w = torch.randn(40, 96, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    out = _linears.many(x, w, b)
    theirs = torch.nn.functional.linear(x, w, b)
    assert seen == [dtype if native else torch.float32]
    if native:
        assert torch.equal(out, theirs)
        return
    assert torch.equal(out, torch.nn.functional.linear(x.float(), w.float(), b.float()).to(dtype))
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    step = exact.abs() * torch.finfo(dtype).eps + 1e-30  # one rounding, either side
    assert ((out.double() - exact).abs() <= step).all()
    assert ((theirs.double() - exact).abs() <= step * 2).all()
    assert torch.equal(_linears.many(x.float(), w.float(), b.float()),
                       torch.nn.functional.linear(x.float(), w.float(), b.float()))  # fmt: skip
    assert seen == [torch.float32] * 2
