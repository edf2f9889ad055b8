"""MoELayer against a per-token torch reference and the transformers sparse MoE blocks."""

import contextlib

import numpy as np
import pytest
import torch

import colibri
from colibri.layer import ExpertWeights, InMemoryExperts, MoELayer

E, H, I, K = 8, 32, 24, 2


def numpy_router(top_k: int, normalize: bool = True):
    """softmax -> top-k (ties to the lower id) -> optional renormalisation, in numpy."""

    def route(logits):
        logits = np.asarray(logits, np.float64)
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ids = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
        w = np.take_along_axis(p, ids, 1)
        if normalize:
            w /= w.sum(1, keepdims=True)
        return ids.astype(np.int32), w.astype(np.float32)

    return route


def make_weights(seed=0, num_experts=E, hidden=H, inter=I):
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(num_experts, hidden, generator=g) * 0.5,
        "gate": torch.randn(num_experts, inter, hidden, generator=g) / hidden**0.5,
        "up": torch.randn(num_experts, inter, hidden, generator=g) / hidden**0.5,
        "down": torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5,
        "s_gate": torch.randn(2 * inter, hidden, generator=g) / hidden**0.5,
        "s_up": torch.randn(2 * inter, hidden, generator=g) / hidden**0.5,
        "s_down": torch.randn(hidden, 2 * inter, generator=g) / inter**0.5,
        "s_g": torch.randn(1, hidden, generator=g),
    }


ACTS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


def reference(x, w, act="silu", top_k=K, normalize=True, shared=False, shared_gate=False):
    """Loop over tokens in float64: the textbook MoE block."""
    x = x.double()
    f = ACTS[act]
    out = torch.zeros_like(x)
    probs = torch.softmax(x @ w["router"].double().T, dim=-1)
    for t in range(x.shape[0]):
        order = sorted(range(probs.shape[1]), key=lambda e: (-probs[t, e].item(), e))[:top_k]
        ws = probs[t, order]
        if normalize:
            ws = ws / ws.sum()
        for e, we in zip(order, ws, strict=True):
            h = f(w["gate"][e].double() @ x[t]) * (w["up"][e].double() @ x[t])
            out[t] += we * (w["down"][e].double() @ h)
        if shared:
            s = w["s_down"].double() @ (
                f(w["s_gate"].double() @ x[t]) * (w["s_up"].double() @ x[t])
            )
            if shared_gate:
                s = s * torch.sigmoid(w["s_g"].double() @ x[t])
            out[t] += s
    return out


def make_layer(w, act="silu", shared=False, shared_gate=False, normalize=True, **kw):
    experts = InMemoryExperts(w["gate"], w["up"], w["down"])
    return MoELayer(
        w["router"],
        experts,
        K,
        activation=act,
        router=numpy_router(K, normalize),
        shared_expert=ExpertWeights(w["s_gate"].numpy(), w["s_up"].numpy(), w["s_down"].numpy())
        if shared
        else None,
        shared_expert_gate=w["s_g"] if shared_gate else None,
        **kw,
    )


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("shared, shared_gate", [(False, False), (True, False), (True, True)])
def test_layer_matches_token_loop(act, shared, shared_gate):
    w = make_weights()
    x = torch.randn(33, H, generator=torch.Generator().manual_seed(1))
    layer = make_layer(w, act, shared, shared_gate)
    out = layer(x.numpy())
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (33, H)
    ref = reference(x, w, act, shared=shared, shared_gate=shared_gate)
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize(
    "dtype, tol",
    [(torch.float32, 2e-5), (torch.float64, 1e-6), (torch.float16, 4e-3), (torch.bfloat16, 3e-2)],
)
def test_torch_dtypes(dtype, tol):
    w = make_weights(2)
    x = torch.randn(17, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    layer = make_layer(w, "silu", shared=True, shared_gate=True)
    out = layer(x)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == x.shape
    ids, weights = layer.route(x)
    np.testing.assert_array_equal(
        ids, numpy_router(K)(x.double().numpy() @ w["router"].double().numpy().T)[0]
    )
    ref = reference(x, w, shared=True, shared_gate=True)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_expert_fn_in_torch_matches_numpy():
    w = make_weights(4)
    x = torch.randn(21, H, generator=torch.Generator().manual_seed(5))
    calls = []

    def torch_expert(e, rows, weights):
        assert isinstance(rows, torch.Tensor) and weights is not None
        calls.append(e)
        h = torch.nn.functional.silu(rows @ w["gate"][e].T) * (rows @ w["up"][e].T)
        return h @ w["down"][e].T

    numpy_out = make_layer(w)(x)
    torch_out = make_layer(w, expert_fn=torch_expert)(x)
    torch.testing.assert_close(torch_out, numpy_out, rtol=1e-5, atol=1e-5)
    assert calls == sorted(set(calls))  # each active expert once, ascending

    # weights can live entirely in the callable: no provider needed
    free = MoELayer(
        w["router"],
        None,
        K,
        router=numpy_router(K),
        expert_fn=lambda e, rows, _: torch_expert(e, rows, 0),
    )
    torch.testing.assert_close(free(x), numpy_out, rtol=1e-5, atol=1e-5)


class RecordingProvider:
    """A provider in the Pager's shape: float16 weights, records what is loaded."""

    def __init__(self, w, capacity=E, short=None):
        self.w = {k: v.numpy().astype(np.float16) for k, v in w.items()}
        self.capacity, self.slot_bytes = capacity, 3 * I * H * 2
        self.short = short  # refuse loads of more experts than this (views held elsewhere)
        self.requests, self.advised = [], []
        self.open = 0

    def advise(self, layer, expert_ids):
        self.advised.append((layer, [int(e) for e in expert_ids]))
        return len(expert_ids)

    @contextlib.contextmanager
    def load(self, layer, expert_ids):
        self.requests.append((layer, list(expert_ids)))
        if self.short is not None and len(expert_ids) > self.short:
            raise colibri.BudgetError(f"{len(expert_ids)} experts > {self.short} free slots")
        self.open += 1
        try:
            yield {
                e: ExpertWeights(self.w["gate"][e], self.w["up"][e], self.w["down"][e])
                for e in expert_ids
            }
        finally:
            self.open -= 1


def test_provider_protocol_loads_only_active_experts():
    w = make_weights(6)
    provider = RecordingProvider(w)
    router = numpy_router(K)
    layer = MoELayer(w["router"], provider, K, layer=3, router=router)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(7)).numpy()
    out = layer(x)
    ids, _ = router(x @ w["router"].numpy().T)
    assert provider.requests == [(3, sorted(set(ids.ravel().tolist())))]
    assert provider.open == 0
    w16 = {k: torch.from_numpy(v.astype(np.float32)) for k, v in provider.w.items()}
    w16["router"] = w["router"]  # only the expert weights are float16
    np.testing.assert_allclose(
        out, reference(torch.from_numpy(x), w16).numpy(), rtol=1e-4, atol=1e-4
    )


def _fp16_reference(provider, w, x):
    w16 = {k: torch.from_numpy(v.astype(np.float32)) for k, v in provider.w.items()}
    w16["router"] = w["router"]  # only the expert weights are float16
    return reference(torch.from_numpy(x), w16).numpy()


def test_provider_capacity_loads_in_chunks_and_reads_the_rest_ahead():
    """A store holding few experts at once (Pager.capacity) gets the step in chunks, and the
    experts of the later chunks are handed to its read-ahead before the first one loads."""
    w = make_weights(10)
    provider = RecordingProvider(w, capacity=3)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(2)).numpy()
    out = MoELayer(w["router"], provider, K, layer=2, router=numpy_router(K))(x)
    assert provider.requests == [(2, [0, 1, 2]), (2, [3, 4, 5]), (2, [6, 7])]  # all 8 active
    assert provider.advised == [(2, [3, 4, 5, 6, 7])]
    np.testing.assert_allclose(out, _fp16_reference(provider, w, x), rtol=1e-4, atol=1e-4)
    provider.requests, provider.advised = [], []
    again = MoELayer(w["router"], provider, K, layer=2, router=numpy_router(K), read_ahead=False)
    np.testing.assert_array_equal(again(x), out)  # chunking and read-ahead change no bit
    assert len(provider.requests) == 3 and provider.advised == []


def test_a_store_short_of_slots_is_asked_for_fewer_experts():
    """When views kept elsewhere leave fewer slots than the capacity (BudgetError), the
    engine halves its chunks until the store can serve them; the result is the same."""
    w = make_weights(11)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(4)).numpy()
    full = MoELayer(w["router"], RecordingProvider(w), K, router=numpy_router(K))(x)
    provider = RecordingProvider(w, capacity=8, short=2)
    out = MoELayer(w["router"], provider, K, router=numpy_router(K))(x)
    np.testing.assert_array_equal(out, full)
    assert [len(ids) for _, ids in provider.requests] == [8, 4, 2, 2, 2, 2]
    with pytest.raises(colibri.BudgetError, match="free slots"):
        MoELayer(w["router"], RecordingProvider(w, short=0), K, router=numpy_router(K))(x)


def test_a_store_must_declare_what_the_engine_uses():
    class LoadOnly:
        def load(self, layer, expert_ids):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="LoadOnly lacks capacity, slot_bytes, advise"):
        MoELayer(make_weights(1)["router"], LoadOnly(), K)


def test_multi_layer_in_memory_store_and_empty_batch():
    w0, w1 = make_weights(8), make_weights(9)
    experts = InMemoryExperts(*(torch.stack([w0[n], w1[n]]) for n in ("gate", "up", "down")))
    layer1 = MoELayer(w1["router"], experts, K, layer=1, router=numpy_router(K))
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer1(x).double(), reference(x, w1), rtol=2e-5, atol=2e-5)
    empty = layer1(np.zeros((0, H), np.float32))
    assert empty.shape == (0, H)
    with pytest.raises(IndexError, match="layer 2 out of range"):
        MoELayer(w1["router"], experts, K, layer=2, router=numpy_router(K))(x)


def test_bad_inputs_raise():
    w = make_weights()
    layer = make_layer(w)
    with pytest.raises(ValueError, match=r"\[T, 32\]"):
        layer(np.zeros((3, H + 1), np.float32))
    with pytest.raises(ValueError, match="hidden states must be float"):
        layer(np.zeros((3, H), np.int64))
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        make_layer(w, act="swish")
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 8\]"):
        MoELayer(w["router"], None, 9, expert_fn=lambda *a: None)
    with pytest.raises(ValueError, match="give experts"):
        MoELayer(w["router"], None, K, router=numpy_router(K))
    with pytest.raises(ValueError, match="InMemoryExperts"):
        InMemoryExperts(w["gate"], w["up"], w["gate"])
    bad_fn = MoELayer(
        w["router"], None, K, router=numpy_router(K), expert_fn=lambda e, rows, _: rows[:, :3]
    )
    with pytest.raises(ValueError, match=r"expert_fn\(\d\) returned shape"):
        bad_fn(np.ones((2, H), np.float32))
    with pytest.raises(ValueError, match="out of range"):  # a router returning bad ids
        MoELayer(
            w["router"],
            InMemoryExperts(w["gate"], w["up"], w["down"]),
            K,
            router=lambda logits: (
                np.full((logits.shape[0], K), E, np.int32),
                np.ones((logits.shape[0], K), np.float32),
            ),
        )(np.ones((2, H), np.float32))


# --- transformers sparse MoE blocks with copied weights ------------------------------------


def _torch_experts_to_colibri(experts):
    gate_up = experts.gate_up_proj.detach()
    inter = gate_up.shape[1] // 2
    return InMemoryExperts(gate_up[:, :inter], gate_up[:, inter:], experts.down_proj.detach())


def test_matches_transformers_mixtral_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    cfg = MixtralConfig(
        hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K
    )
    block = MixtralSparseMoeBlock(cfg).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 9, H)
    with torch.no_grad():
        ref = block(x)
    layer = MoELayer(block.gate.weight, _torch_experts_to_colibri(block.experts), K)
    out = layer(x.reshape(-1, H)).reshape(x.shape)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_matches_transformers_qwen2_moe_block():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    torch.manual_seed(1)
    cfg = Qwen2MoeConfig(
        hidden_size=H,
        moe_intermediate_size=I,
        num_experts=E,
        num_experts_per_tok=K,
        shared_expert_intermediate_size=40,
        norm_topk_prob=False,
    )
    block = Qwen2MoeSparseMoeBlock(cfg).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 5, H)
    with torch.no_grad():
        ref = block(x)
    se = block.shared_expert
    layer = MoELayer(
        block.gate.weight,
        _torch_experts_to_colibri(block.experts),
        K,
        normalize=False,  # Qwen2-MoE's norm_topk_prob=False, through colibri.init
        shared_expert=ExpertWeights(
            se.gate_proj.weight.detach().numpy(),
            se.up_proj.weight.detach().numpy(),
            se.down_proj.weight.detach().numpy(),
        ),
        shared_expert_gate=block.shared_expert_gate.weight,
    )
    out = layer(x.reshape(-1, H)).reshape(x.shape)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_default_router_is_colibri_routing():
    w = make_weights(11)
    x = torch.randn(29, H, generator=torch.Generator().manual_seed(12)).numpy()
    experts = InMemoryExperts(w["gate"], w["up"], w["down"])
    default = MoELayer(w["router"], experts, K)
    np.testing.assert_allclose(default(x), make_layer(w)(x), rtol=1e-6, atol=1e-6)
    ids, weights = default.route(x)
    ref_ids, ref_w = numpy_router(K)(x @ w["router"].numpy().T)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_w, rtol=1e-6)
    # a Context as router, and per-expert scales after renormalisation (Gemma4)
    scale = np.linspace(0.5, 2.0, E).astype(np.float32)
    ctx = colibri.init(E, K, expert_scale=scale)
    scaled = MoELayer(w["router"], experts, K, router=ctx)
    ids, weights = scaled.route(x)
    np.testing.assert_allclose(weights, ref_w * scale[ref_ids], rtol=1e-6)
    with pytest.raises(ValueError, match="conflict with an explicit router"):
        MoELayer(w["router"], experts, K, router=ctx, normalize=False)


@pytest.mark.parametrize("rows", [1, 3, 70])
@pytest.mark.parametrize("storage", ["float16", "bfloat16", "float32", "float64"])
def test_linear_converts_weight_blocks_exactly(rows, storage):
    from colibri.layer._expert import linear

    r = np.random.default_rng(rows)
    w32 = r.standard_normal((300, 1000)).astype(np.float32)  # several conversion blocks
    if storage == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        w = w32.astype(ml_dtypes.bfloat16)
    else:
        w = w32.astype(storage)
    x = r.standard_normal((rows, 1000)).astype(np.float32)
    expected = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(linear(x, w, storage), expected, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="does not match"):
        linear(x[:, :10], w, storage)


def test_exported():
    assert colibri.MoELayer is MoELayer and colibri.InMemoryExperts is InMemoryExperts


def test_jax_input_and_expert_fn():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    w = make_weights(13)
    x = np.random.default_rng(14).standard_normal((6, H)).astype(np.float32)
    gate, up, down = (jnp.asarray(w[n].numpy()) for n in ("gate", "up", "down"))

    def jax_expert(e, rows, _):
        assert isinstance(rows, jax.Array)
        return (jax.nn.silu(rows @ gate[e].T) * (rows @ up[e].T)) @ down[e].T

    layer = MoELayer(w["router"], None, K, expert_fn=jax_expert)
    out = layer(jnp.asarray(x))
    assert isinstance(out, jax.Array)
    np.testing.assert_allclose(
        np.asarray(out), reference(torch.from_numpy(x), w).numpy(), rtol=1e-4, atol=1e-4
    )


def test_expert_fn_may_answer_in_bfloat16():
    """An expert_fn returning bfloat16 (torch) is read as the values it holds, not as raw
    bits, and one returning a non-float dtype is refused by name."""
    w = make_weights(15)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(16))

    def torch_expert(e, rows, _):
        h = torch.nn.functional.silu(rows @ w["gate"][e].T) * (rows @ w["up"][e].T)
        return (h @ w["down"][e].T).to(torch.bfloat16)

    out = MoELayer(w["router"], None, K, expert_fn=torch_expert)(x)
    want = reference(x, w)
    torch.testing.assert_close(out.double(), want, rtol=2**-7, atol=2**-7 * want.abs().max())
    layer = MoELayer(w["router"], None, K, expert_fn=lambda e, rows, _: rows.int())
    with pytest.raises(ValueError, match=r"expert_fn\(\d+\)'s result must be float32"):
        layer(x)


def test_float8_weights_as_raw_bits_are_a_clear_error():
    """Without ml_dtypes, float8 experts arrive as their uint8 bits: never computed as ints."""
    from colibri.layer._expert import linear

    bits = np.full((4, 8), 0x38, np.uint8)  # 1.0 in float8 e4m3
    with pytest.raises(ValueError, match="F8_E4M3 held as raw uint8 bits: pip install ml-dtypes"):
        linear(np.ones((1, 8), np.float32), bits, "f8_e4m3")
