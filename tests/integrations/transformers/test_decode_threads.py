"""A model from ``from_pretrained`` runs a decoding step's torch operations on one thread
(colibri's pool does the parallel work) and gives torch its threads back after the step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

from _support.hf_families import build_model  # noqa: E402
from colibri.integrations.transformers import _linears, from_pretrained  # noqa: E402
from colibri.integrations.transformers._threads import DECODE_ROWS  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("threads")
    build_model("qwen3_moe").to(torch.bfloat16).save_pretrained(folder)
    return from_pretrained(folder, budget="64MiB", linears="colibri")


@pytest.fixture
def threads():
    """torch's thread count set to 2 for the test, put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _inside(model, ids) -> int:
    """torch's thread count while the first decoder layer runs on ``ids``."""
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda *_: seen.append(torch.get_num_threads())
    )
    try:
        with torch.no_grad():
            model(ids)
    finally:
        hook.remove()
    return seen[0]


@pytest.mark.parametrize("tokens", [1, DECODE_ROWS])
def test_a_decoding_step_runs_torch_on_one_thread(model, threads, tokens):
    assert _inside(model, torch.arange(5, 5 + tokens)[None]) == 1
    assert torch.get_num_threads() == 2


def test_a_prompt_keeps_torchs_threads(model, threads):
    assert _inside(model, torch.arange(5, 6 + DECODE_ROWS)[None]) == 2
    assert _inside(model, torch.arange(5, 9).repeat(3, 1)) == 2  # 3 x 4 tokens
    assert torch.get_num_threads() == 2


def test_the_users_thread_count_comes_back(model):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert _inside(model, torch.tensor([[7]])) == 1
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_a_step_that_raises_gives_the_threads_back(model, threads, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(model.model.layers[1].mlp, "forward", fail)
    with pytest.raises(RuntimeError, match="planted"), torch.no_grad():
        model(torch.tensor([[7]]))
    assert torch.get_num_threads() == 2


def test_auto_times_torch_as_a_decoding_step_runs_it(model, threads, monkeypatch):
    seen = []
    real = _linears.F.linear

    def counting(*args):
        seen.append(torch.get_num_threads())
        return real(*args)

    monkeypatch.setattr(_linears.F, "linear", counting)
    _linears._measure(model.lm_head, 2, 1)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2


def test_generate_keeps_one_thread_between_steps_and_gives_them_back(model, threads):
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda *_: seen.append(torch.get_num_threads())
    )
    real = torch.argmax  # greedy sampling between steps: torch's own small operations
    between = []

    def argmax(*args, **kwargs):
        between.append(torch.get_num_threads())
        return real(*args, **kwargs)

    try:
        torch.argmax = argmax
        with torch.no_grad():
            model.generate(torch.arange(5, 5 + 2 * DECODE_ROWS)[None], max_new_tokens=4,
                           min_new_tokens=4, do_sample=False)  # fmt: skip
    finally:
        torch.argmax = real
        hook.remove()
    assert seen == [2, 1, 1, 1]  # the prompt on torch's threads, then one
    assert between and set(between[1:]) == {1}
    assert torch.get_num_threads() == 2


def test_generate_that_raises_gives_the_threads_back(model, threads, monkeypatch):
    calls = [0]
    real = model.model.layers[1].mlp.forward

    def fail_late(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("planted")
        return real(*args, **kwargs)

    monkeypatch.setattr(model.model.layers[1].mlp, "forward", fail_late)
    with pytest.raises(RuntimeError, match="planted"), torch.no_grad():
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False)
    assert torch.get_num_threads() == 2


def test_colibri_keeps_its_threads_in_a_decoding_step(tmp_path, threads, monkeypatch):
    """colibri's kernels get the thread count torch had at load, not the one a decoding step
    gives torch (OpenMP's default, which colibri's would follow)."""
    folder = tmp_path / "m"
    build_model("qwen3_moe").to(torch.bfloat16).save_pretrained(folder)
    model = from_pretrained(folder, budget="64MiB", linears="colibri")
    seen = []
    compute = _linears.compute
    monkeypatch.setattr(_linears, "compute", lambda *a: seen.append(a[3]) or compute(*a))
    try:
        assert model.colibri.num_threads == 2
        assert _inside(model, torch.arange(5, 6)[None]) == 1
        assert seen and set(seen) == {2}
    finally:
        model.colibri.close()
