"""Device tensors in, correct results out (runs only where a GPU is present).

colibri routes on the CPU: device logits are copied to the host by their producer
(``__dlpack__(dl_device=(kDLCPU, 0), copy=True)``) and results come back on the host,
as torch CPU tensors, jax CPU arrays, or numpy arrays for cupy (which has no host arrays).
"""

import numpy as np
import pytest

import colibri
from _support import reference as ref
from colibri.layer import InMemoryExperts, MoELayer

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DSV3 = dict(scoring="sigmoid", num_groups=8, topk_groups=4, scale=2.5)


def check(ids, w, host_logits, k, **options):
    logits = np.asarray(host_logits, np.float64)
    ref.assert_same_routes(np.asarray(ids), np.asarray(w), logits, k, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_logits_are_copied_and_routed(dtype):
    x = torch.randn(1000, 64, device="cuda", dtype=dtype)
    ids, w = colibri.init(64, 4, scoring="sigmoid", num_groups=8, topk_groups=2).route(x)
    assert ids.device.type == "cpu" and w.device.type == "cpu"
    check(ids, w, x.float().cpu().numpy(), 4, scoring="sigmoid", num_groups=8, topk_groups=2)


def test_cuda_deepseek_v3_with_a_cuda_bias_through_route_from_dlpack():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 256, device="cuda", generator=g)
    bias = torch.randn(256, device="cuda", generator=g) * 0.1
    ctx = colibri.init(256, 8, correction_bias=bias, **DSV3)
    ids, w = colibri.route_from_dlpack(x, ctx)
    assert isinstance(ids, torch.Tensor) and ids.dtype == torch.int32
    check(ids, w, x.cpu().numpy(), 8, correction_bias=bias.cpu().numpy(), **DSV3)


def test_cuda_views_and_host_out_buffers():
    base = torch.randn(64, 3000, device="cuda")
    x = base.t()[::3]  # [1000, 64], strided in both dims on the device
    ctx = colibri.init(64, 2)
    ids, w = ctx.buffers(1000)
    ctx.route(x, out=(ids, w))
    check(ids, w, x.cpu().numpy(), 2)


def test_cuda_out_buffers_are_refused():
    x = torch.randn(10, 64, device="cuda")
    ids = torch.empty(10, 2, dtype=torch.int32, device="cuda")
    w = torch.empty(10, 2, device="cuda")
    with pytest.raises(BufferError, match=r"lives on cuda.*device='cpu'"):
        colibri.init(64, 2).route(x, out=(ids, w))


def test_cuda_hidden_states_through_the_layer():
    g = torch.Generator().manual_seed(0)
    E, H, inter, T = 8, 32, 16, 50
    gate, up = torch.randn(E, inter, H, generator=g), torch.randn(E, inter, H, generator=g)
    down = torch.randn(E, H, inter, generator=g)
    router = torch.randn(E, H, generator=g)
    layer = MoELayer(router.numpy(), InMemoryExperts(gate, up, down), 2)
    x = torch.randn(T, H, generator=g)
    want = layer(x.numpy())
    got = layer(x.cuda())
    assert got.device.type == "cpu"
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


def test_jax_gpu_arrays():
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax sees no GPU")
    host = np.random.default_rng(0).standard_normal((500, 26), dtype=np.float32)
    x = jax.device_put(host, gpu)
    try:
        ids, w = colibri.init(26, 2, num_groups=4).route(x)
    except BufferError as exc:  # jax without dl_device support: the error names the fix
        assert "jax.device_get" in str(exc)
        pytest.xfail(f"this jax cannot copy to the host through DLPack: {exc}")
    check(ids, w, host, 2, num_groups=4)


def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    host = np.random.default_rng(1).standard_normal((500, 64), dtype=np.float32)
    x = cupy.asarray(host)
    ids, w = colibri.init(64, 8, scoring="softmax").route(x)
    assert isinstance(ids, np.ndarray) and isinstance(w, np.ndarray)
    check(ids, w, host, 8)
