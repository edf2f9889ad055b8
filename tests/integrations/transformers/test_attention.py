"""A ``from_pretrained`` model's decoding steps on colibri's attention kernel, against the
formula in float64 on every call a generation makes (padded batch, masks as sdpa gets them),
against sdpa's generated tokens, and the calls that stay on sdpa's function.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

from transformers import AttentionInterface  # noqa: E402

from _support.hf_families import build_model, save_bfloat16, token_ids  # noqa: E402
from colibri.integrations.transformers import _attention, from_pretrained  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_bfloat16(tmp_path_factory.mktemp("attention"))


@pytest.fixture(scope="module")
def model(folder):
    return from_pretrained(folder, budget="64MiB")


def _prompt():
    ids = token_ids(seed=3, batch=2, length=7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: masked keys in every step of the second row
    return ids, mask


def _reference(query, key, value, mask, scale):
    """float64 ``[B, T, Hq, D]``: the formula, key/value head h // G, a bool mask; a row
    with every key masked gives zeros, as sdpa's."""
    q, k, v = (t.double() for t in (query, key, value))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = scale * q @ k.transpose(-1, -2)
    if mask is not None:
        s = s.masked_fill(~mask[..., : k.shape[2]], float("-inf"))
    return (s.softmax(-1).nan_to_num(0.0) @ v).transpose(1, 2)


def test_every_decoding_step_is_the_formula(model, monkeypatch):
    assert model.colibri.attention == "colibri"
    assert model.config._attn_implementation == "colibri"
    calls = []

    def checking(module, query, key, value, attention_mask, **kwargs):
        out, weights = _attention.forward(module, query, key, value, attention_mask, **kwargs)
        if query.shape[2] <= _attention.MAX_QUERIES:  # the kernel's calls
            want = _reference(query, key, value, attention_mask, kwargs["scaling"])
            rounded = want.to(torch.bfloat16).double()
            ulp = torch.finfo(torch.bfloat16).eps * rounded.abs().clamp_min(1e-30)
            assert out.shape == want.shape and out.dtype == query.dtype
            assert ((out.double() - want).abs() <= ulp).all()
            calls.append((query.shape[0], query.shape[2], key.shape[2]))
        return out, weights

    monkeypatch.setitem(AttentionInterface._global_mapping, _attention.NAME, checking)
    ids, mask = _prompt()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    layers = model.config.num_hidden_layers
    assert len(calls) == 6 * layers  # the prompt (7 rows, padded ones fully masked), 5 steps
    assert sorted({(b, t) for b, t, _ in calls}) == [(2, 1), (2, 7)]
    assert max(n for *_, n in calls) == 12


def test_generates_sdpa_tokens(model):
    ids, mask = _prompt()
    with torch.no_grad():
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        try:
            model.set_attn_implementation("sdpa")
            theirs = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        finally:
            model.set_attn_implementation(_attention.NAME)
    assert torch.equal(ours, theirs)


def _qkv(batch=1, t=1, length=9, grad=False):
    g = torch.Generator().manual_seed(t + length)
    q = torch.randn(batch, 8, t, 16, generator=g, requires_grad=grad)
    k = torch.randn(batch, 2, length, 16, generator=g)
    v = torch.randn(batch, 2, length, 16, generator=g)
    return q, k, v


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize(
    "case",
    ["long query", "causal without mask", "gradient", "dropout", "position bias", "head mask",
     "float64"],
)  # fmt: skip
def test_other_calls_run_sdpa(case, monkeypatch):
    sdpa, kernel = [], []
    monkeypatch.setattr(_attention, "_sdpa", lambda *a, **k: sdpa.append(1) or (a[1], None))
    monkeypatch.setattr(_attention, "attention", lambda *a, **k: kernel.append(1))
    q, k, v = _qkv(t=9 if case == "long query" else 2)
    mask, kwargs = torch.ones(1, 1, q.shape[2], 9, dtype=torch.bool), {}
    if case == "causal without mask":
        mask = None
    elif case == "gradient":
        q.requires_grad_(True)
    elif case == "dropout":
        kwargs["dropout"] = 0.1
    elif case == "position bias":
        kwargs["position_bias"] = torch.zeros(1, 8, 2, 9)
    elif case == "head mask":
        mask = mask.expand(1, 8, 2, 9)
    elif case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    _attention.forward(_Module(), q, k, v, mask, **kwargs)
    assert sdpa == [1] and kernel == []
    _attention.forward(_Module(), *_qkv(t=2), torch.ones(1, 1, 2, 9, dtype=torch.bool))
    assert kernel == [1]  # the same call, decode-sized: the kernel


def test_float_masks_and_a_batch_match_the_formula():
    q, k, v = _qkv(batch=2, t=2, length=11)
    bias = torch.zeros(2, 1, 2, 11)
    bias[0, 0, 0, 6:] = torch.finfo(torch.float32).min
    bias[1, 0, :, :2] = float("-inf")
    out, _ = _attention.forward(_Module(), q, k, v, bias, scaling=0.3)
    want = _reference(q, k, v, bias > -1e30, 0.3)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-6)


def test_torch_linears_and_other_attention_keep_their_own(folder):
    kept = from_pretrained(folder, budget="64MiB", linears="torch")
    assert kept.colibri.attention is None and kept.config._attn_implementation == "sdpa"
    eager = build_model("qwen3_moe")
    eager.set_attn_implementation("eager")
    assert not _attention.install(eager) and eager.config._attn_implementation == "eager"
