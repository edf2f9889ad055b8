"""The RMSNorms of a ``from_pretrained`` model on colibri's kernel at decode sizes, against
each module's own forward, on a tiny bf16 qwen3_moe (hidden 32, two layers); and the probe
that keeps other norm formulas on their own forward.
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
from colibri.integrations.transformers import _norms, from_pretrained, patch, unpatch  # noqa: E402
from colibri.layer import _norm  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = build_model("qwen3_moe").to(torch.bfloat16)
    randomise_routers(model, [r.name for r in patch(model)])
    unpatch(model)
    with torch.no_grad():  # transformers initialises norm weights to ones
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 1.5)
    path = tmp_path_factory.mktemp("norms")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(folder):
    return (from_pretrained(folder, budget="64MiB", linears="colibri"),
            from_pretrained(folder, budget="64MiB", linears="torch"))  # fmt: skip


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    real = _norm.rms_norm

    def counting(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(_norm, "rms_norm", counting)  # what colibri.layer.rms_norm calls
    return calls


def _norm_names(model):
    return sorted(n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm"))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def test_every_norm_within_one_ulp_of_its_forward(models, kernel_calls):
    model, ref = models
    names = _norm_names(model)
    assert sorted(model.colibri.norms) == names and len(names) == 2 * 4 + 1  # q k in post; final
    assert ref.colibri.norms == []
    seen = []

    def check(module, args, out):
        want = type(module).forward(module, args[0])
        ulp = torch.finfo(want.dtype).eps * want.float().abs()
        assert out.dtype == want.dtype and out.shape == want.shape
        assert ((out.float() - want.float()).abs() <= ulp).all()
        seen.append(module)

    hooks = [m.register_forward_hook(check) for n, m in model.named_modules() if n in names]
    got = _logits(model, token_ids(3, batch=1, length=1))
    for hook in hooks:
        hook.remove()
    assert len(seen) == len(names) == len(kernel_calls)
    want = _logits(ref, token_ids(3, batch=1, length=1))
    assert (got - want).abs().max().item() <= 2.0**-6 * want.abs().max().item()


def test_long_inputs_and_gradients_run_their_forward(models, kernel_calls):
    norm = models[0].model.norm
    x = torch.randn(_norms.MAX_VALUES // 32 + 1, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(norm(x), type(norm).forward(norm, x))
        norm(x[: _norms.MAX_VALUES // 32])
    assert kernel_calls == [_norms.MAX_VALUES // 32]
    kernel_calls.clear()
    x = torch.randn(1, 32, dtype=torch.bfloat16, requires_grad=True)
    assert torch.equal(norm(x), type(norm).forward(norm, x))
    assert kernel_calls == []
    with torch.no_grad():
        norm(x)
    assert kernel_calls == [1]


def test_follows_the_weight_and_eps(models):
    norm = models[0].model.norm
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        before = norm(x)
        norm.weight.mul_(-2)
        assert torch.equal(norm(x), _norms.compute(x, norm.weight, norm.variance_epsilon))
        assert not torch.equal(norm(x), before)
        norm.weight.div_(-2)
        norm.weight.data = norm.weight.data.clone() * 3  # new memory, same Parameter
        assert torch.equal(norm(x), _norms.compute(x, norm.weight, norm.variance_epsilon))
        norm.weight.data /= 3
        norm.variance_epsilon = 10.0
        ulp = torch.finfo(torch.bfloat16).eps * before.float().abs().max()
        assert (norm(x).float() - before.float()).abs().max() > ulp
        norm.variance_epsilon = 1e-6


class LlamaLikeRMSNorm(torch.nn.Module):
    def __init__(self, n, eps=1e-6, one_plus=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.variance_epsilon, self.one_plus = eps, one_plus

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if self.one_plus:  # Gemma's
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


class ArgsRMSNorm(LlamaLikeRMSNorm):
    def forward(self, x, gate):  # Mamba-style gated norms take more than x
        return super().forward(x * gate)


def test_probe_keeps_other_formulas_on_their_forward():
    model = torch.nn.ModuleDict({
        "llama": LlamaLikeRMSNorm(64).to(torch.bfloat16),
        "gemma": LlamaLikeRMSNorm(64, one_plus=True).to(torch.bfloat16),
        "gated": ArgsRMSNorm(64).to(torch.bfloat16),
        "single": LlamaLikeRMSNorm(64),
        "no_eps": torch.nn.RMSNorm(64),  # torch's own: eps None, not taken
    })  # fmt: skip
    assert _norms.install(model) == ["llama", "single"]
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    gemma = model["gemma"]
    assert "forward" not in gemma.__dict__
    with torch.no_grad():
        assert torch.equal(model["llama"](x), _norms.compute(x, model["llama"].weight, 1e-6))
        assert model["llama"](x.float()).dtype == torch.float32  # another dtype: its forward


def test_compiles_in_one_graph(models):
    model = models[0]
    ids = token_ids(2, batch=1, length=3)
    want = _logits(model, ids)
    got, graphs = compiled_logits(model, ids)
    assert torch.equal(got, want)
    assert len(graphs) == 1
    assert graphs[0].code.count("torch.ops.colibri.rms_norm") == len(model.colibri.norms)
