"""``Seen``: what a decoding step read of its modules, compared anew, against every change
that must make a step read them again, and the ones that must not."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from colibri.integrations.transformers._seen import Seen  # noqa: E402

NAMES = ("forward", "_colibri_state")


class Norm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))
        self.variance_epsilon = 1e-6


def _modules():
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 4)
    linear.__dict__["_colibri_state"] = object()
    return linear, Norm(), torch.nn.LayerNorm(8)  # LayerNorm: "eps", a bias


def _change(what: str, linear, norm, layer_norm) -> None:
    with torch.no_grad():
        if what == "forward":
            linear.forward = lambda x: x
        elif what == "state":
            linear.__dict__["_colibri_state"] = object()
        elif what == "state removed":
            del linear.__dict__["_colibri_state"]
        elif what == "new parameter":
            linear.weight = torch.nn.Parameter(linear.weight.detach().clone())
        elif what == ".data":
            linear.weight.data = linear.weight.data.clone()
        elif what == "strides":  # the same memory read another way
            linear.weight.data = linear.weight.data.reshape(8, 4).t()
        elif what == "dtype":
            norm.half()
        elif what == "bias in place":
            linear.bias.add_(1)
        elif what == "bias removed":
            linear.bias = None
        elif what == "variance_epsilon":
            norm.variance_epsilon = 1e-5
        elif what == "eps":
            layer_norm.eps = 1e-3
        elif what == "parameters dict":
            linear._parameters = dict(linear._parameters)


CHANGES = [
    "forward",
    "state",
    "state removed",
    "new parameter",
    ".data",
    "strides",
    "dtype",
    "bias in place",
    "bias removed",
    "variance_epsilon",
    "eps",
    "parameters dict",
]


@pytest.mark.parametrize("what", CHANGES)
def test_a_change_a_step_depends_on_is_seen(what):
    modules = _modules()
    seen = Seen(modules, torch.bfloat16, NAMES)
    assert seen.same(torch.bfloat16)
    _change(what, *modules)
    assert not seen.same(torch.bfloat16)
    again = Seen(modules, torch.bfloat16, NAMES)  # what the step reads anew
    assert again.same(torch.bfloat16) and again.same(torch.bfloat16)


def test_what_a_step_does_not_depend_on_is_not_a_change():
    """The weights' values (read in place by the kernels), another module attribute, a
    hook; and another dtype is one."""
    linear, norm, layer_norm = modules = _modules()
    seen = Seen(modules, torch.float32, NAMES)
    with torch.no_grad():
        linear.weight.mul_(2)
        norm.weight.add_(1)
    linear.other = 3
    norm.register_forward_hook(lambda *_: None)
    assert seen.same(torch.float32)
    assert not seen.same(torch.bfloat16)
    assert not seen.same(torch.float32.to_complex())


def test_modules_without_parameters_or_weights():
    """Objects with no ``_parameters``, or no weight, compare by what they have."""

    class Plain:
        def __init__(self) -> None:
            self.eps = 0.5

    plain, empty = Plain(), torch.nn.ReLU()
    seen = Seen((plain, empty), None, NAMES)
    assert seen.same(None)
    plain.eps = 0.25
    assert not seen.same(None)
    assert seen.modules == (plain, empty) and seen.dtype is None


def test_watched_modules_plain_attributes_count():
    """A watched module's plain attributes (a router's ``top_k``) are compared by value;
    an unwatched module's, its ``training`` and private ones are not."""
    from colibri.integrations.transformers._seen import scalars

    linear, norm, layer_norm = modules = _modules()
    linear.top_k, linear.name, linear._private = 2, "gate", 1
    seen = Seen(modules, None, NAMES, (linear,))
    assert ("top_k", 2) in scalars(linear) and ("name", "gate") in scalars(linear)
    linear.eval()
    linear._private = 5
    norm.top_k = 9
    assert seen.same(None)
    linear.top_k = 1
    assert not seen.same(None)
    linear.top_k = 2
    assert seen.same(None)
    linear.name = None
    assert not seen.same(None)
