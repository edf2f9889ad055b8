"""CUDA tensors in, correct results out (runs only where torch sees a GPU)."""

import numpy as np
import pytest

import colibri
from tests import reference as ref

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_logits_are_copied_and_routed(dtype):
    x = torch.randn(1000, 64, device="cuda", dtype=dtype)
    ids, w = colibri.init(64, 4, scoring="sigmoid", num_groups=8, topk_groups=2).route(x)
    host = x.float().cpu().numpy()
    ref_ids, ref_w, keys = ref.route(host, 4, scoring="sigmoid", num_groups=8, topk_groups=2)
    ref.assert_same_routes(np.asarray(ids.cpu()), np.asarray(w.cpu()), ref_ids, ref_w, keys)
