"""A decoding step of a whole decoder layer without transformers' module calls.

A model from :func:`from_pretrained` runs each token's decoder layer as some forty torch
operations and module calls (norms, projections, views, transposes, rotary embedding's ten
elementwise operations, the MoE block's wrappers), each a few microseconds of Python and
dispatch, several times that when the weights streaming through the caches have evicted the
interpreter's state. For a layer whose code colibri knows (the ``forward`` of the layer, its
attention and its MoE block, and the rotary embedding, checked by fingerprint as routers
are), a step of one token of one sequence computes what ``layer(...)`` would, in a few
calls. When every kernel of the attention half is colibri's (norms, projections quantized or
on colibri's linear kernel, the attention over the cache), two native calls around the cache
update, :func:`colibri.layer.pre_attention` and :func:`colibri.layer.post_attention` (which
also computes the router's logits when its linear is colibri's), then the routing (for
colibri's softmax routers, their context called directly into numpy arrays) and, once a
budget that holds every expert holds the layer's, one call of its
:class:`colibri.layer.HeldExperts` that adds the residual too (else the experts' forward).
What these calls take of the modules (weights' bits, epsilons, the routing) is read once and
read again only when a module changes. Otherwise colibri's kernels are called directly
where the modules' forwards would call them, the other modules' forwards one by one
(:meth:`_Layer.calls`), :func:`colibri.layer.rope` for the rotary embedding. The values
between the calls are numpy views. The result is the layer's own, bit for bit.

The decoder model itself (its forward and the decorators around it known by fingerprint too)
runs such a token as its forward would, the embedding, the rotary embedding and the final
norm as module calls, but each layer's step called directly: none of the wrappers' work a
token (merging the config's defaults, setting up output capture, the module call of each
layer: 0.1 ms of a 6 ms Q4_0 token of the demo's model on a Zen 4).

Every other call (a prompt, a batch, gradients, a compiled graph, a module with hooks, for
instance when transformers records attentions or router logits, or a forward replaced after
loading) runs the layer's own ``forward`` (the model's own, for the model).
"""

from __future__ import annotations

import sys
import types

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from colibri.integrations.transformers import _attention, _experts, _linears, _norms, _patch
from colibri.integrations.transformers._families import _fingerprint
from colibri.integrations.transformers._ops import HALF_NAMES, values_of
from colibri.integrations.transformers._seen import Seen
from colibri.layer import (
    AttentionStep,
    attention,
    post_attention,
    pre_attention,
    quant_linear,
    rms_norm,
    rope,
    warm,
)

__all__ = ["install"]

_STATE = "_colibri_decode"
_ROOM = "_colibri_room"  # a DynamicLayer's _Room

# The code a step reproduces, by fingerprint (_families._fingerprint): transformers 5.x's
# Qwen3-MoE layer (its attention and layer forward are Qwen3's too).
_KNOWN = {
    "layer": frozenset({"4c8db5469287"}),
    "attention": frozenset({"3500b11ad4d3"}),
    "moe": frozenset({"dcdb4c3469b6"}),
    "rotary": frozenset({"efe5fb4ba37f"}),
}
# The model's forward and the decorators around it (merge_with_config_defaults,
# capture_outputs), outermost first: fingerprints of their code objects.
_MODEL = frozenset({("6bf5344e4d2d", "e63a7f99a3a6", "0c52c3a260ba")})
# The keyword arguments a model's step takes, each off (None or False): what capture_outputs
# records, and what it reads to return a tuple
_OUTPUTS = ("output_attentions", "output_hidden_states", "output_router_logits")
_DTYPES = {torch.float32: "float32", **HALF_NAMES}
# A module's own forward and colibri's states of it (_linears', _norms', _patch's)
_SOURCES = ("forward", _linears._STATE, _norms._STATE, _patch._STATE)
# The attention's projections, the linears a step computes inside its native call
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _handles() -> int | None:
    """torch's count of hook handles made so far (``RemovableHandle.next_id``: every
    ``register_*_hook`` makes one, so no hook was added since it last read the same); None
    where torch keeps no such count."""
    return getattr(RemovableHandle, "next_id", None)


def _plain(hidden: torch.Tensor, cache, position_embeddings, size: int) -> bool:
    """What :meth:`_Layer.takes` asks of the call, the same for every layer of a token: one
    token's ``[1, 1, size]`` contiguous hidden state on the CPU in a dtype the kernels take,
    a cache, rotary values, no gradients, not compiling, no global hooks."""
    return (
        hidden.shape == (1, 1, size)
        and cache is not None
        and position_embeddings is not None
        and not torch.is_grad_enabled()
        and hidden.dtype in _DTYPES
        and hidden.device.type == "cpu"
        and hidden.is_contiguous()
        and not torch.compiler.is_compiling()
        and not (torch.nn.modules.module._global_forward_hooks
                 or torch.nn.modules.module._global_forward_pre_hooks)
    )  # fmt: skip


class _Layer:
    """One decoder layer's step: its modules and shapes, read once."""

    __slots__ = ("attn", "code", "experts", "gate", "given", "hidden", "kv_heads", "heads",
                 "head_dim", "layer", "mlp", "modules", "norm_in", "norm_post", "q_norm", "k_norm",
                 "sources", "tree", "unhooked")  # fmt: skip

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.layer, self.attn, self.mlp = layer, attn, mlp
        self.gate, self.experts = mlp.gate, mlp.experts
        self.code = (type(attn).forward, type(mlp).forward)  # what the step stands for
        self.norm_in, self.norm_post = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.head_dim = attn.head_dim
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.hidden = attn.q_proj.in_features
        # the modules whose hooks a step would skip
        self.modules = (attn, mlp, self.gate, self.experts, self.norm_in, self.norm_post,
                        self.q_norm, self.k_norm, attn.q_proj, attn.k_proj, attn.v_proj,
                        attn.o_proj)  # fmt: skip
        # the modules the kernels' arguments come from; (sources' key, arguments) of the last step
        self.sources = (self.norm_in, self.q_norm, self.k_norm, self.norm_post, attn.q_proj,
                        attn.k_proj, attn.v_proj, attn.o_proj, self.gate)  # fmt: skip
        self.given: tuple = (None, None)  # Seen of the sources, their arguments
        # where the step's modules hang: (parent, name, module), each still its parent's?
        self.tree = tuple((parent, name, getattr(parent, name)) for parent, names in (
            (layer, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")),
            (attn, ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
            (mlp, ("gate", "experts"))) for name in names)  # fmt: skip
        self.unhooked = None  # _handles() when self.modules were last seen without hooks

    def __getstate__(self) -> tuple:
        """A copy (copy, deepcopy, pickle) looks at its modules' hooks anew (they may have
        come with them, no handle made) and reads their arguments anew."""
        fresh = {"unhooked": None, "given": (None, None)}
        return None, {n: getattr(self, n) for n in self.__slots__} | fresh

    def takes(self, hidden: torch.Tensor, cache, position_embeddings) -> bool:
        """Whether this call is a step this class runs: one token of one sequence on the
        CPU, no gradients, no hooks, a cache to append to, the attention's and MoE block's
        forwards still the code the step stands for (:func:`_plain` and :meth:`ready`)."""
        return _plain(hidden, cache, position_embeddings, self.hidden) and self.ready()

    def ready(self) -> bool:
        """What :meth:`takes` asks of this layer's modules: still the layer's (none replaced
        by another), not training, no hooks, the attention's and MoE block's forwards still
        the code the step stands for. The modules' hooks are looked at again only when torch
        made a hook handle since they were last seen without (:func:`_handles`; a hook put in
        a module's hook dicts by hand, past ``register_*_hook``, is not seen)."""
        attn, mlp = self.attn, self.mlp
        if (
            self.layer.training
            or attn.training  # its dropout
            or type(attn).forward is not self.code[0]
            or type(mlp).forward is not self.code[1]
            or "forward" in attn.__dict__
            or "forward" in mlp.__dict__
        ):
            return False
        for parent, name, module in self.tree:  # noqa: SIM110 (a loop: a step's cost)
            if parent._modules.get(name) is not module:
                return False
        handles = _handles()
        if handles is not None and handles == self.unhooked:
            return True
        for m in self.modules:  # noqa: SIM110 (a loop, not a generator: a step's cost)
            if m._forward_hooks or m._forward_pre_hooks:
                return False
        self.unhooked = handles
        return True

    def kernels(self, dtype: torch.dtype) -> tuple | None:
        """The norms' and projections' arguments of :func:`colibri.layer.pre_attention` and
        :func:`colibri.layer.post_attention` when every module of the attention half computes
        with colibri's kernels; None otherwise."""
        attn, size = self.attn, self.heads * self.head_dim
        norms = (_norms.direct(self.norm_in, dtype, self.hidden),
                 _norms.direct(self.q_norm, dtype, size),
                 _norms.direct(self.k_norm, dtype, self.kv_heads * self.head_dim),
                 _norms.direct(self.norm_post, dtype, self.hidden))  # fmt: skip
        linears = tuple(_linears.direct(getattr(attn, n)) for n in _PROJECTIONS)
        if None in norms or None in linears:
            return None
        return norms, linears

    def arguments(self, dtype: torch.dtype) -> tuple | None:
        """:meth:`kernels` and the router's (``(kernels, rest of the routing, router's
        linear, its routing for a caller that routes itself, the kernels' AttentionStep)``),
        read again only when a module they come from changed: its forward, colibri's states
        of it, its weight's parameter, memory, dtype or strides, its bias, its epsilon, the
        router's plain attributes (its ``top_k``) (:class:`._seen.Seen`)."""
        seen, arguments = self.given
        if seen is None or not seen.same(dtype):
            seen = Seen(self.sources, dtype, _SOURCES, (self.gate,))  # before reading them
            given = self.kernels(dtype)
            rest = _patch.routed(self.gate)
            router = None if rest is None else _linears.direct(self.gate, router=True)
            plain = None if router is None else _patch.plain(self.gate)
            planned = None
            if given is not None:
                (norm_in, q_norm, k_norm, norm_post), (q, k, v, o) = given
                planned = AttentionStep(norm_in, (q, k, v), q_norm, k_norm, o, norm_post, router,
                                        (self.heads, self.kv_heads, self.head_dim),
                                        _DTYPES[dtype])  # fmt: skip
            arguments = given, rest, router, plain, planned
            self.given = seen, arguments
        return arguments

    def forward(self, hidden, mask, cache, position_embeddings, kwargs) -> torch.Tensor:
        """``Qwen3MoeDecoderLayer.forward`` for ``hidden [1, 1, H]``: :meth:`step` when every
        kernel of the attention half is colibri's, else the modules' calls one by one
        (:meth:`calls`)."""
        dtype, interface = hidden.dtype, _interface(self.attn.config)
        if mask is None and interface is _attention.forward and _attention.plain(kwargs):
            y = self.step(values_of(hidden).reshape(self.hidden), dtype, cache,
                          position_embeddings)  # fmt: skip
            if y is not None:
                return _tensor(y, dtype).view(1, 1, self.hidden)
        return self.calls(hidden, mask, cache, position_embeddings, kwargs, interface)

    def step(self, x: np.ndarray, dtype: torch.dtype, cache, position_embeddings,
             reused: _Reused | None = None,
             picked: tuple | None = None) -> np.ndarray | None:  # fmt: skip
        """The layer for one token's hidden state ``x [H]`` (float32, or the bits of a half
        ``dtype``) when colibri's attention runs with no mask and no extra arguments: two
        native calls around the cache update when every kernel is colibri's, then the
        routing and the held experts (the modules' forwards where those cannot run): ``[H]``
        like ``x``. None, having changed nothing, when not every kernel of the attention half
        is colibri's (:meth:`calls` then). ``reused``: where held experts leave the step's
        hits for the caller to count (:class:`_Reused`), else counted now. ``picked``: the
        experts function of a config, read once for a token's layers
        (:func:`._experts.held`)."""
        given, rest, router, plain, planned = self.arguments(dtype)
        if given is None:
            return None
        attn, D, H, name = self.attn, self.head_dim, self.hidden, _DTYPES[dtype]
        cos, sin = _rotation(position_embeddings, D)
        scale = D**-0.5 if attn.scaling is None else float(attn.scaling)
        out, h = np.empty((1, H), x.dtype), np.empty((1, H), x.dtype)
        room = self.room(cache, dtype)
        if room is not None:  # the cache update inside the attention half's one call
            keys, values = room.reserve()
            logits = None if router is None else np.empty(planned.E, x.dtype)
            planned(x, cos, sin, keys, values, room.rows, scale, out[0], h[0], logits)
            room.advance(cache.layers[attn.layer_idx])
        else:
            (norm_in, q_norm, k_norm, norm_post), (q, k, v, o) = given
            queries, key, value = pre_attention(x, norm_in, (q, k, v), cos, sin, q_norm, k_norm,
                                                name)  # fmt: skip
            keys, values = self.append(cache, key, value, dtype)
            o_out, h_out, logits = post_attention(queries, keys, values, scale, o, x, norm_post,
                                                  router, name)  # fmt: skip
            out[0], h[0] = o_out, h_out
        held = _experts.held(self.experts, dtype, picked)
        if held is not None and reused is not None and reused.store in (None, held.store):
            reused.store = held.store
        else:
            reused = None
        if held is not None and logits is not None and plain is not None:
            # the routing the gate's forward runs, into numpy, its weights rounded (by the
            # held experts) as the .to(logits' dtype) it makes
            context, kept = plain
            ids = np.empty((1, context.top_k), np.int64)
            weights = np.empty((1, context.top_k), np.float32)
            context.route(_tensor(logits, dtype), out=(ids[0], weights[0]))
            y = held(h, ids, weights, dtype=name, out=np.empty_like(h), residual=out,
                     reused=reused, rounded=kept == "logits")  # fmt: skip
            if y is not None:
                return y.reshape(H)
        t = _tensor(h, dtype)
        if logits is None:
            _, weights, ids = self.gate.forward(t)
        else:
            _, weights, ids = rest(_tensor(logits, dtype).view(1, -1))
        if held is not None and weights.dtype == dtype and ids.dtype == torch.int64:
            # the call the experts' forward would make, without its wrappers, and the residual
            y = held(h, ids.numpy().reshape(1, -1), values_of(weights).reshape(1, -1),
                     dtype=name, out=np.empty_like(h), residual=out, reused=reused)  # fmt: skip
            if y is not None:
                return y.reshape(H)
        y = self.experts.forward(t, ids, weights)
        return values_of(_tensor(out, dtype) + y).reshape(H)

    def append(self, cache, key: np.ndarray, value: np.ndarray, dtype: torch.dtype) -> tuple:
        """``cache.update`` of this layer with one token's ``key``, ``value`` ``[Hkv, D]``:
        the keys and values after it, ``[Hkv, L, D]`` numpy views. A ``DynamicCache``
        layer's rows go to buffers with room to grow (:class:`_Room`, kept on the cache's
        layer), which the layer then shows: no copy of the cache a token, where ``update``
        concatenates."""
        index, D = self.attn.layer_idx, self.head_dim
        room = self.room(cache, dtype)
        if room is None:
            keys, values = cache.update(_tensor(key, dtype).view(1, self.kv_heads, 1, D),
                                        _tensor(value, dtype).view(1, self.kv_heads, 1, D),
                                        index)  # fmt: skip
            return values_of(keys[0].contiguous()), values_of(values[0].contiguous())
        return room.append(cache.layers[index], key, value)

    def room(self, cache, dtype: torch.dtype) -> _Room | None:
        """This layer's :class:`_Room` in ``cache`` (made, adopting what the cache's layer
        holds, when new or changed by others); None when its layer is not one a room
        stands in for."""
        index = self.attn.layer_idx
        layers = getattr(cache, "layers", ())
        layer = layers[index] if index < len(layers) else None
        room = None if layer is None else layer.__dict__.get(_ROOM)
        if room is None or not room.shown_by(layer):  # a new cache, or changed by others
            room = None
            if _growable(cache, layer, dtype, (self.kv_heads, self.head_dim)):
                room = layer.__dict__[_ROOM] = _Room(layer, dtype)
        return room

    def calls(self, hidden, mask, cache, position_embeddings, kwargs, interface) -> torch.Tensor:
        """The step as the modules' calls one by one: colibri's kernels called directly where
        a module's forward would call them, the values between the calls numpy views (torch's
        own objects only where a forward needs them)."""
        attn, D, dtype = self.attn, self.head_dim, hidden.dtype
        x = hidden.view(1, self.hidden)
        h = _norm(self.norm_in, values_of(x), dtype)
        q = _norm(self.q_norm, _project(attn.q_proj, h, dtype).reshape(self.heads, D), dtype)
        k = _norm(self.k_norm, _project(attn.k_proj, h, dtype).reshape(self.kv_heads, D), dtype)
        v = _project(attn.v_proj, h, dtype)
        cos, sin = (values_of(t).reshape(D) for t in position_embeddings)
        rope(q, cos, sin, _DTYPES[dtype])
        rope(k, cos, sin, _DTYPES[dtype])
        keys, values = cache.update(_tensor(k, dtype).view(1, self.kv_heads, 1, D),
                                    _tensor(v, dtype).view(1, self.kv_heads, 1, D),
                                    attn.layer_idx)  # fmt: skip
        if interface is _attention.forward and mask is None and _attention.plain(kwargs):
            out = np.empty((1, self.heads, D), q.dtype)  # sdpa's layout, [T, Hq, D]
            scale = D**-0.5 if attn.scaling is None else float(attn.scaling)
            attention(q.reshape(self.heads, 1, D), values_of(keys[0].contiguous()),
                      values_of(values[0].contiguous()), scale, _DTYPES[dtype], None,
                      out)  # fmt: skip
        else:
            out, _ = interface(attn, _tensor(q, dtype).view(1, self.heads, 1, D), keys, values,
                               mask, dropout=0.0, scaling=attn.scaling,
                               sliding_window=attn.sliding_window, **kwargs)  # fmt: skip
            out = values_of(out.contiguous())
        o = _project(attn.o_proj, out.reshape(1, self.heads * D), dtype)
        x = x + _tensor(o, dtype)
        h = _tensor(_norm(self.norm_post, values_of(x), dtype), dtype)
        _, weights, ids = self.gate.forward(h)
        x = x + self.experts.forward(h, ids, weights)
        return x.view(1, 1, self.hidden)


class _Reused(list):
    """A token's ``(layer, experts)`` served by held experts of one ``store`` (a
    :class:`colibri.Pager`), counted at once when the token's layers have run
    (:meth:`colibri.Pager.reuse_many`: the weight file checked once, not once a layer)."""

    __slots__ = ("store",)

    def __init__(self) -> None:
        super().__init__()
        self.store = None

    def tell(self) -> None:
        """Count them in the store (an error: the token's result must not be used)."""
        if not self:
            return
        many = getattr(self.store, "reuse_many", None)
        if many is not None:
            many(self)
        else:
            for layer, experts in self:
                self.store.reuse(layer, experts)


class _Room:
    """One layer's keys and values in buffers ``[Hkv, capacity, D]`` with room to grow (twice
    the rows when full), the rows so far shown by its ``DynamicLayer`` as views
    ``[1, Hkv, L, D]``: what ``torch.cat`` would have made, without copying the cache."""

    __slots__ = ("buffers", "rows", "shown", "tensors")

    def __reduce__(self):  # a copied cache's layer (copy, deepcopy, pickle) adopts anew
        return type(None), ()

    def __init__(self, layer, dtype: torch.dtype) -> None:
        """Adopt what ``layer`` holds (a copy once)."""
        held = (layer.keys[0], layer.values[0])
        self.rows = held[0].shape[1]
        self.shown: tuple = ()
        self._grow(held, max(64, 2 * self.rows), dtype)

    def _grow(self, held: tuple, capacity: int, dtype: torch.dtype) -> None:
        """New buffers of ``capacity`` rows holding the ``held`` keys and values."""
        buffers = []
        for t in held:
            rows = values_of(t) if isinstance(t, torch.Tensor) else t
            b = np.empty((rows.shape[0], capacity, rows.shape[2]), rows.dtype)
            b[:, : self.rows] = rows[:, : self.rows]
            buffers.append(b)
        self.buffers = tuple(buffers)
        self.tensors = tuple(_tensor(b, dtype).unsqueeze(0) for b in buffers)

    def shown_by(self, layer) -> bool:
        """Whether ``layer`` shows this room's rows still (no one else changed them)."""
        return bool(self.shown) and layer.keys is self.shown[0] and layer.values is self.shown[1]

    def reserve(self) -> tuple[np.ndarray, np.ndarray]:
        """The buffers, grown first if full: row :attr:`rows` is free."""
        if self.rows == self.buffers[0].shape[1]:
            self._grow(self.buffers, 2 * self.rows, self.tensors[0].dtype)
        return self.buffers

    def advance(self, layer) -> None:
        """Count the row written at :attr:`rows` and let ``layer`` show it."""
        self.rows = n = self.rows + 1
        self.shown = layer.keys, layer.values = (
            self.tensors[0].narrow(2, 0, n),
            self.tensors[1].narrow(2, 0, n),
        )

    def append(self, layer, key: np.ndarray, value: np.ndarray) -> tuple:
        keys, values = self.reserve()
        n = self.rows
        keys[:, n] = key.reshape(keys.shape[0], keys.shape[2])
        values[:, n] = value.reshape(values.shape[0], values.shape[2])
        self.advance(layer)
        return keys[:, : n + 1], values[:, : n + 1]


def _growable(cache, layer, dtype: torch.dtype, heads: tuple[int, int]) -> bool:
    """Whether ``layer`` of ``cache`` is a plain ``DynamicLayer`` of one sequence on the CPU
    holding ``dtype`` keys and values ``[1, Hkv, L, D]`` (``heads``: ``(Hkv, D)``), what a
    :class:`_Room` stands in for; its own ``update`` otherwise."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if type(cache) is not DynamicCache or cache.offloading or type(layer) is not DynamicLayer:
        return False
    if not layer.is_initialized:
        return False
    keys, values = layer.keys, layer.values
    if keys.dim() != 4 or keys.shape != (1, heads[0], keys.shape[2], heads[1]):
        return False
    return (values.shape == keys.shape and keys.dtype == values.dtype == dtype
            and keys.is_cpu and values.is_cpu)  # fmt: skip


_ROTATION: tuple = (None, None, None)  # the last position embeddings, and their values


def _rotation(position_embeddings: tuple, D: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos``, ``sin`` ``[D]`` as values, read once for the layers of a step (the model
    hands each the same tuple)."""
    global _ROTATION
    given, cos, sin = _ROTATION
    if given is not position_embeddings:
        cos, sin = (values_of(t).reshape(D) for t in position_embeddings)
        _ROTATION = (position_embeddings, cos, sin)  # holds them: the identity stays theirs
    return cos, sin


def _tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """numpy values (float32, or a half type's bits) as a torch tensor of ``dtype``, no copy."""
    t = torch.from_numpy(values)
    return t if dtype == torch.float32 else t.view(dtype)


def _norm(module: nn.Module, rows: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``module(rows)``: colibri's kernel called here when its forward would call it."""
    given = _norms.direct(module, dtype, rows.size)
    if given is None:
        return values_of(module.forward(_tensor(rows, dtype)))
    return rms_norm(rows, given[0], given[1], _DTYPES[dtype])


def _project(module: nn.Module, rows: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``module(rows)`` of a linear: colibri's quantized kernel called here when its forward
    would call it, else its forward."""
    given = _linears.direct(module)
    if given is None or given[1] in HALF_NAMES.values():  # none, or half precision: its forward
        return values_of(module.forward(_tensor(rows, dtype)))
    return quant_linear(rows, *given, _DTYPES[dtype])


def _eager(*args, **kwargs):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import eager_attention_forward

    return eager_attention_forward(*args, **kwargs)


_FUNCTIONS: list = []  # transformers' ALL_ATTENTION_FUNCTIONS, imported once


def _interface(config):
    """The attention function transformers calls for ``config`` (its ``_attn_implementation``
    in ``ALL_ATTENTION_FUNCTIONS``, eager's when none)."""
    if not _FUNCTIONS:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        _FUNCTIONS.append(ALL_ATTENTION_FUNCTIONS)
    return _FUNCTIONS[0].get_interface(_experts.implementation(config, "attn"), _eager)


def _steps(state: _Layer, hidden, cache, position_embeddings) -> bool:
    """Whether a call of ``state``'s layer is a step (:meth:`_Layer.takes`, and rotary
    values of one position in the hidden state's dtype)."""
    return state.takes(hidden, cache, position_embeddings) and _rotary(
        state, hidden, position_embeddings
    )


def _rotary(state: _Layer, hidden, position_embeddings) -> bool:
    """Rotary values of one position for ``state``'s heads, in the hidden state's dtype."""
    return (position_embeddings[0].dtype == hidden.dtype
            and position_embeddings[0].shape[-2:] == (1, state.head_dim))  # fmt: skip


def _forward(self: nn.Module, hidden_states, attention_mask=None, position_ids=None,
             past_key_values=None, use_cache=False, position_embeddings=None,
             **kwargs):  # fmt: skip
    state: _Layer = self.__dict__[_STATE]
    if _steps(state, hidden_states, past_key_values, position_embeddings):
        given = dict(kwargs, position_ids=position_ids, use_cache=use_cache)  # as attention's
        return state.forward(hidden_states, attention_mask, past_key_values, position_embeddings,
                             given)  # fmt: skip
    return type(self).forward(self, hidden_states, attention_mask=attention_mask,
                              position_ids=position_ids, past_key_values=past_key_values,
                              use_cache=use_cache, position_embeddings=position_embeddings,
                              **kwargs)  # fmt: skip


def _known(layer: nn.Module) -> bool:
    """Whether ``layer`` runs the code a step reproduces: fingerprints of its forward, its
    attention's, its MoE block's and the rotary embedding of its module."""
    import inspect
    import sys

    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not hasattr(mlp, "gate") or not hasattr(mlp, "experts"):
        return False
    rotary = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    try:
        found = {
            "layer": _fingerprint(type(layer).forward),
            "attention": _fingerprint(type(attn).forward),
            "moe": _fingerprint(type(mlp).forward),
            "rotary": _fingerprint(inspect.unwrap(rotary)) if rotary is not None else None,
        }
    except (OSError, TypeError):  # no source to read
        return False
    if any(found[key] not in _KNOWN[key] for key in _KNOWN):
        return False
    return (
        getattr(attn, "sliding_window", None) is None
        and all(hasattr(attn, n) for n in ("q_norm", "k_norm", "layer_idx", "config"))
        and all(isinstance(getattr(attn, n, None), nn.Linear) for n in _PROJECTIONS)
        and attn.q_proj.out_features % attn.head_dim == 0
        and attn.k_proj.out_features % attn.head_dim == 0
    )  # fmt: skip


def stepped(model: nn.Module) -> list[str]:
    """Names of the attention projections of ``model``'s layers whose code a step reproduces:
    the linears a decoding step computes inside its native call."""
    return [f"{name}.self_attn.{p}" for name, layer in model.named_modules() if _known(layer)
            for p in _PROJECTIONS]  # fmt: skip


class _Model:
    """A decoder model's one-token step: what its forward computes (embedding, rotary
    embedding, the layers, final norm), each layer's step called directly."""

    __slots__ = ("code", "head", "layers", "model", "module", "steps")

    def __init__(self, model: nn.Module) -> None:
        self.model, self.code = model, type(model).forward
        self.head: tuple = ()  # (top model, name): its LM head, whose weights are warmed
        self.layers = tuple(model.layers)  # the ModuleList's modules, to see them replaced
        self.steps = tuple((layer, layer.__dict__[_STATE]) for layer in self.layers)
        self.module = sys.modules[type(model).__module__]  # its mask functions, output class

    def takes(self, input_ids, cache, inputs_embeds, kwargs: dict) -> bool:
        """Whether this call is a step this class runs: one token id of one sequence on the
        CPU, a cache, no gradients, no hooks, nothing asked of the forward's decorators (no
        output recorded, a dict returned, no causal setting), the same layers, the model's
        forward still the code the step stands for."""
        model = self.model
        config = model.config
        return (
            inputs_embeds is None
            and isinstance(input_ids, torch.Tensor)
            and input_ids.shape == (1, 1)
            and input_ids.device.type == "cpu"
            and cache is not None
            and not torch.is_grad_enabled()
            and not model.training
            and not torch.compiler.is_compiling()
            and type(model).forward is self.code
            and kwargs.keys() <= _KWARGS
            and kwargs.get("return_dict", True) is True
            and getattr(config, "return_dict", True) is True
            and all(kwargs.get(n, getattr(config, n, None)) in (None, False) for n in _OUTPUTS)
            and getattr(config, "is_causal", None) is None
            and config.num_hidden_layers == len(self.layers)
            and tuple(model.layers._modules.values()) == self.layers
            and not any(_hooked(m) for m in (model, model.embed_tokens, model.rotary_emb,
                                              model.norm))
            and not (torch.nn.modules.module._global_forward_hooks
                     or torch.nn.modules.module._global_forward_pre_hooks)
        )  # fmt: skip

    def step(self, input_ids, attention_mask, position_ids, cache, use_cache, kwargs):
        """The model's forward for one token: its own code's operations, the layers' steps
        called directly (a layer that cannot take one, or whose forward was replaced, runs
        as a module call); None, having changed nothing, when the causal mask is not None
        (the layers' steps need none: the model's forward runs)."""
        model = self.model
        _warm(self.steps, 0)  # while the embedding, mask and rotary embedding run
        if use_cache is None:  # merge_with_config_defaults' default
            use_cache = getattr(model.config, "use_cache", None)
        hidden = model.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = (torch.arange(1) + cache.get_seq_length()).unsqueeze(0)
        module = self.module
        masking = (module.create_causal_mask if model.config.sliding_window is None
                   else module.create_sliding_window_causal_mask)  # fmt: skip
        mask = masking(config=model.config, inputs_embeds=hidden, attention_mask=attention_mask,
                       past_key_values=cache, position_ids=position_ids)  # fmt: skip
        if mask is not None:
            return None
        position_embeddings = model.rotary_emb(hidden, position_ids=position_ids)
        given = dict(kwargs, position_ids=position_ids, use_cache=use_cache)  # as attention's
        reused = _Reused()
        size, dtype = hidden.shape[-1], hidden.dtype
        plain = _plain(hidden, cache, position_embeddings, size)  # the same for every layer
        # the layers' attention function: their steps run when it is colibri's, with nothing
        # asked of it (the same for every layer sharing the model's config)
        config = model.config
        interface = _interface(config)
        direct = interface is _attention.forward and _attention.plain(given)
        picked = (config, _experts.picked_for(config))  # the experts' function, likewise
        x = None  # the hidden state's values between steps (hidden is stale while not None)
        for i, (layer, state) in enumerate(self.steps):
            if (
                plain
                and getattr(layer.__dict__.get("forward"), "__func__", None) is _forward
                and not _hooked(layer)
                and state.hidden == size
                and state.ready()
                and _rotary(state, hidden, position_embeddings)
            ):
                ours = state.attn.config is config  # else its own attention function
                if direct and ours:
                    if x is None:
                        x = values_of(hidden).reshape(size)
                    y = state.step(x, dtype, cache, position_embeddings, reused, picked)
                    if y is not None:
                        _warm(self.steps, i + 1)
                        x = y
                        continue
                if x is not None:
                    hidden, x = _tensor(x, dtype).view(1, 1, size), None
                if ours:
                    hidden = state.calls(hidden, None, cache, position_embeddings, given,
                                         interface)  # fmt: skip
                else:
                    hidden = state.forward(hidden, None, cache, position_embeddings, given)
            else:
                if x is not None:
                    hidden, x = _tensor(x, dtype).view(1, 1, size), None
                hidden = layer(hidden, attention_mask=None, position_ids=position_ids,
                               past_key_values=cache, use_cache=use_cache,
                               position_embeddings=position_embeddings, **kwargs)  # fmt: skip
                plain = _plain(hidden, cache, position_embeddings, size)
        if self.head:  # the LM head's weights, while the count and the norm run
            _warm(self.steps, len(self.steps), self.head[0]._modules.get(self.head[1]))
        reused.tell()
        norm = None if x is None else _norms.direct(model.norm, dtype, size)
        if norm is not None:  # the final norm's kernel on the values (the module has no hooks)
            y = rms_norm(x.reshape(1, size), norm[0], norm[1], _DTYPES[dtype])
            hidden = _tensor(y, dtype).view(1, 1, size)
        else:
            if x is not None:
                hidden = _tensor(x, dtype).view(1, 1, size)
            hidden = model.norm(hidden)
        return module.MoeModelOutputWithPast(last_hidden_state=hidden, past_key_values=cache)


_KWARGS = frozenset({*_OUTPUTS, "return_dict"})


def _warm(steps: tuple, i: int, head: nn.Module | None = None) -> None:
    """Have colibri's idle helper bring layer ``i``'s attention weights toward the caches
    (its step as last read: a hint, stale or missing ones harmless) while the interpreter
    runs the code before its step; past the last layer, ``head``'s (the LM head's) when
    colibri's kernel computes it (:func:`colibri.layer.warm`)."""
    if i < len(steps):
        arguments = steps[i][1].given[1]
        if arguments is not None and arguments[4] is not None:
            arguments[4].warm()
    elif head is not None:
        given = _linears.direct(head)
        if given is not None:
            warm(given[0])


def _model_forward(self: nn.Module, input_ids=None, attention_mask=None, position_ids=None,
                   past_key_values=None, inputs_embeds=None, use_cache=None,
                   **kwargs):  # fmt: skip
    state: _Model = self.__dict__[_STATE]
    if state.takes(input_ids, past_key_values, inputs_embeds, kwargs):
        given = {k: v for k, v in kwargs.items() if k != "return_dict"}
        out = state.step(input_ids, attention_mask, position_ids, past_key_values, use_cache,
                         given)  # fmt: skip
        if out is not None:
            return out
    return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, past_key_values=past_key_values,
                              inputs_embeds=inputs_embeds, use_cache=use_cache,
                              **kwargs)  # fmt: skip


def _chain(forward) -> tuple[str, ...]:
    """Fingerprints of ``forward`` and of each function it wraps, outermost first."""
    found = []
    while forward is not None:
        found.append(_fingerprint(forward.__code__))
        forward = getattr(forward, "__wrapped__", None)
    return tuple(found)


def _known_model(model: nn.Module) -> bool:
    """Whether ``model`` is a decoder model whose forward (with its decorators) a model's
    step reproduces, every one of its layers given a layer's step."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return False
    if any(_STATE not in layer.__dict__ for layer in layers):
        return False
    if not all(hasattr(model, n) for n in ("embed_tokens", "rotary_emb", "norm", "config")):
        return False
    module = sys.modules.get(type(model).__module__)
    if not all(hasattr(module, n) for n in ("create_causal_mask",
                                             "create_sliding_window_causal_mask",
                                             "MoeModelOutputWithPast")):  # fmt: skip
        return False
    try:
        return _chain(type(model).forward) in _MODEL
    except (OSError, TypeError, AttributeError):  # no source to read
        return False


def install(model: nn.Module) -> list[str]:
    """Give each decoder layer of ``model`` whose code colibri knows the one-call decoding
    step, then the decoder model whose layers all have it the model's step; returns the names
    of the modules given a step (layers first)."""
    taken = []
    for known, state, forward in ((_known, _Layer, _forward),
                                  (_known_model, _Model, _model_forward)):  # fmt: skip
        for name, module in model.named_modules():
            if _STATE in module.__dict__ or not known(module):
                continue
            module.__dict__[_STATE] = state(module)
            module.__dict__["forward"] = types.MethodType(forward, module)
            taken.append(name)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    name = next((n for n, m in model._modules.items() if m is head and m is not None), None)
    for module in model.modules():  # the LM head looked up a token: replaced, the new one
        if name is not None and isinstance(module.__dict__.get(_STATE), _Model):
            module.__dict__[_STATE].head = (model, name)
    return taken
