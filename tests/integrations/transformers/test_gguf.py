"""GGUF model files end to end: ``from_pretrained("model.gguf")`` and ``colibri generate``.

A tiny random Qwen3-MoE is written as llama.cpp lays it out (``qwen3moe.*`` metadata, a
byte-level BPE tokenizer in ``tokenizer.ggml.*``, non-expert tensors as F32 / F16 / Q8_0,
stacked experts as random valid Q4_K / Q6_K or Q8_0 blocks). The reference is transformers'
own model with every weight as the ``gguf`` package dequantizes it, in float32.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as G  # noqa: E402

from _support.hf_families import compiled_logits, logits, token_ids  # noqa: E402
from colibri.__main__ import main  # noqa: E402
from colibri.integrations.transformers import (  # noqa: E402
    CheckpointError,
    UnsupportedCheckpointError,
    from_pretrained,
)
from colibri.layer import _quant, dequantize  # noqa: E402

H, I, E, K, LAYERS, HEADS, KV, HEAD_DIM = 256, 256, 4, 2, 2, 4, 2, 64
# where each block type keeps its float16 scales, and its largest |level x sub-block scale|
# (scales drawn so that weights are ~0.05, as in tests/layer/test_quant.py)
_F16_FIELDS = {"q8_0": [0], "q4_0": [0], "q4_k": [0, 2], "q6_k": [208], "q5_0": [0]}
_LEVELS = {"q8_0": 127, "q4_0": 8, "q4_k": 63 * 15, "q6_k": 128 * 32, "q5_0": 16}
_TYPES = {"q8_0": G.Q8_0, "q4_0": G.Q4_0, "q4_k": G.Q4_K, "q6_k": G.Q6_K, "q5_0": G.Q5_0}


def _blocks(rng, qtype: str, rows: int, cols: int) -> np.ndarray:
    """Random valid blocks ``uint8 [rows, row_bytes]`` (every float16 scale small, finite)."""
    per, size = gguf.GGML_QUANT_SIZES[_TYPES[qtype]]
    n = cols // per
    w = rng.integers(0, 256, (rows, n, size), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        scale = (rng.uniform(-0.05, 0.05, (rows, n)) / _LEVELS[qtype]).astype(np.float16)
        w[:, :, at : at + 2] = scale.view(np.uint8).reshape(rows, n, 2)
    return w.reshape(rows, n * size)


def _tokenizer() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (GPT-2's byte alphabet, a few merges, one control token)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "o Ġ", "w o"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|endoftext|>"]
    return tokens, merges


def _reference_model(family: str, vocab: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(
        vocab_size=vocab, hidden_size=H, intermediate_size=512, moe_intermediate_size=I,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV,
        num_experts=E, num_experts_per_tok=K, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        eos_token_id=vocab - 1, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    if family == "qwen3_moe":  # llama.cpp normalises the top-k weights (transformers' GGUF default)
        sizes.update(head_dim=HEAD_DIM, norm_topk_prob=True)
    else:
        sizes.update(shared_expert_intermediate_size=2 * I)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **sizes))
    return model.float().eval()


# llama.cpp's names of each layer's non-expert tensors (its convert_hf_to_gguf.py); the router
# of Qwen2-MoE's shared expert is stored as a vector, [H] for the model's [1, H]
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}  # fmt: skip
_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
          "output_norm.weight", "lm_head.weight": "output.weight"}  # fmt: skip


def _write(path, experts=("q4_k", "q6_k"), family="qwen3_moe", arch=None, seed=0, split=0, ffn=I):
    """Write the tiny model of ``family`` to ``path`` as llama.cpp does (architecture
    ``arch``; ``split``: at most that many tensors a file, as gguf-split writes them); returns
    the reference model (float32, weights as the file's dequantized values)."""
    arch = arch or family.replace("_", "")
    rng = np.random.default_rng(seed)
    tokens, merges = _tokenizer()
    ref = _reference_model(family, len(tokens))
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split)
    w.add_context_length(256)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(512)
    w.add_embedding_length(H)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    # transformers' qwen3moe / qwen2moe mappings do not read these two
    w.add_expert_feed_forward_length(ffn)
    if family == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(2 * I)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 1)
    values = {}  # HF name -> the value the file holds
    for hf, tensor in ref.state_dict().items():
        if ".mlp.experts." in hf:
            continue
        parts = hf.split(".")
        name = _NAMES.get(hf) or f"blk.{parts[2]}.{_LAYER_NAMES['.'.join(parts[3:])]}"
        arr = tensor.detach().float().numpy()
        stored = {"blk.0.attn_q.weight": G.Q8_0, "blk.1.attn_output.weight": G.Q4_0}
        if name in stored:  # quantized resident tensors (Q4_0: interleaved on x86)
            blocks = gguf.quants.quantize(arr, stored[name])
            w.add_tensor(name, blocks, raw_dtype=stored[name])
            values[hf] = gguf.quants.dequantize(blocks, stored[name])
            continue
        if name == "output.weight":  # one float16 one
            arr = arr.astype(np.float16)
        w.add_tensor(name, arr.squeeze(0) if name.endswith("_inp_shexp.weight") else arr)
        values[hf] = arr.astype(np.float32)
    for layer in range(LAYERS):
        stacks = {}
        for proj, qtype, rows, cols in (("gate", experts[0], I, H), ("up", experts[0], I, H),
                                        ("down", experts[1], H, I)):  # fmt: skip
            blocks = np.stack([_blocks(rng, qtype, rows, cols) for _ in range(E)])
            w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", blocks, raw_dtype=_TYPES[qtype])
            stacks[proj] = gguf.quants.dequantize(blocks, _TYPES[qtype])
        p = f"model.layers.{layer}.mlp.experts."
        values[p + "gate_up_proj"] = np.concatenate([stacks["gate"], stacks["up"]], axis=1)
        values[p + "down_proj"] = stacks["down"]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert values.keys() == ref.state_dict().keys()
    ref.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in values.items()})
    return ref


def _expert_bytes(experts=("q4_k", "q6_k")) -> int:
    def nbytes(qtype, rows, cols):
        per, size = gguf.GGML_QUANT_SIZES[_TYPES[qtype]]
        return rows * cols // per * size

    return 2 * nbytes(experts[0], I, H) + nbytes(experts[1], H, I)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    cache = {}

    def get(experts=("q4_k", "q6_k"), family="qwen3_moe"):
        if (experts, family) not in cache:
            path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
            cache[experts, family] = path, _write(path, experts, family)
        return cache[experts, family]

    return get


@pytest.mark.parametrize(
    ("family", "experts"),
    [("qwen3_moe", ("q4_k", "q6_k")), ("qwen3_moe", ("q8_0", "q8_0")),
     ("qwen2_moe", ("q4_k", "q6_k"))],
    ids=["qwen3_moe-q4_k-q6_k", "qwen3_moe-q8_0", "qwen2_moe-q4_k-q6_k"],
)  # fmt: skip
def test_float32_matches_the_dequantized_model(written, family, experts):
    """dtype=float32: every expert takes the fallback (dequantized float32 GEMMs), so the
    logits are the dequantized reference's within float32 rounding (Qwen2-MoE: with its
    shared expert and attention biases, resident)."""
    path, ref = written(experts, family)
    model = from_pretrained(path, budget=2 * _expert_bytes(experts), page_size_kb=4,
                            dtype=torch.float32)  # fmt: skip
    try:
        ids = token_ids(length=12, high=256)
        want, got = logits(ref, ids), logits(model, ids)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert model.colibri.stats.misses > 0
        assert model.colibri.expert_bytes == LAYERS * E * _expert_bytes(experts)
    finally:
        model.colibri.close()


def test_default_bfloat16_runs_the_quantized_kernel(written):
    """The default for a quantized file is bfloat16: decode-size experts take the quantized
    kernel (activations as int8 blocks), so logits are the reference's within ~2% of their
    range, the same next-token picks, and generate() runs."""
    path, ref = written()
    model = from_pretrained(path, budget=2 * _expert_bytes(), page_size_kb=4)
    try:
        assert model.dtype == torch.bfloat16
        o_proj = model.get_submodule("model.layers.1.self_attn.o_proj").__dict__
        assert o_proj["_colibri_linear"].qtype == ("q4_0x8" if _quant.INTERLEAVE_FAST else "q4_0")
        ids = token_ids(1, batch=1, length=6, high=256)  # <= 8 rows an expert: quantized kernel
        want, got = logits(ref, ids), logits(model, ids)
        span = (want.max() - want.min()).item()
        assert (got - want).abs().max().item() < 0.02 * span
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert out.shape == (1, 10)
    finally:
        model.colibri.close()


@pytest.mark.parametrize("experts", [("q8_0", "q8_0"), ("q4_0", "q4_0")], ids=["q8_0", "q4_0"])
def test_a_budget_for_every_expert_keeps_them_with_the_same_bits(written, experts):
    """A budget that holds every expert: the load reads each once and keeps it pinned, steps
    load nothing, and a generation gives the paged model's logits bit for bit, its pager
    counting the same demand accesses, all hits (Q4_0: held interleaved by eight on x86,
    paged as stored)."""
    path, _ = written(experts)
    paged = from_pretrained(path, budget=2 * _expert_bytes(experts), page_size_kb=4)
    kept = from_pretrained(path, budget=4 * LAYERS * E * _expert_bytes(experts), page_size_kb=4)
    try:
        assert kept.colibri.holds_all and not paged.colibri.holds_all
        pager = kept.colibri.pager
        assert len(pager.pinned()) == LAYERS * E and kept.colibri.stats.misses == LAYERS * E
        kept.colibri.reset_stats()
        ids = token_ids(2, batch=1, length=5, high=256)
        runs = [m.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True,
                           return_dict_in_generate=True) for m in (paged, kept)]  # fmt: skip
        assert torch.equal(runs[0].sequences, runs[1].sequences)
        for a, b in zip(runs[0].logits, runs[1].logits, strict=True):
            assert torch.equal(a, b)
        assert pager.pinned() == pager.resident() and len(pager.resident()) == LAYERS * E
        assert paged.colibri.pager.pinned() == []
        a, b = paged.colibri.stats, kept.colibri.stats
        assert (b.hits, b.misses, b.bytes_read) == (a.hits + a.misses, 0, 0)
        # a router's ids as int32 and its weights as a strided view: the same as paged
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(3, H, generator=gen).to(torch.bfloat16)
        ids32 = torch.tensor([[0, 3], [2, 1], [3, 0]], dtype=torch.int32)
        strided = torch.rand(2, 3, generator=gen).to(torch.bfloat16).T
        assert not strided.is_contiguous()
        with torch.no_grad():
            want, got = (m.model.layers[1].mlp.experts(x, ids32.long(), strided.contiguous())
                         for m in (paged, kept))  # fmt: skip
            again = kept.model.layers[1].mlp.experts(x, ids32, strided)
        assert torch.equal(want, got) and torch.equal(want, again)
    finally:
        paged.colibri.close()
        kept.colibri.close()
    assert pager.pinned() == []


def test_decoding_steps_equal_the_layers_own_forward(written):
    """The one-call decoder-layer steps (``model.colibri.decode``) on a file with a
    quantized q_proj (colibri's quantized kernel called by the step) and float ones (their
    forwards): the same tokens and logits bit for bit as the layers' own forwards."""
    path, _ = written()
    model = from_pretrained(path, budget=2 * _expert_bytes(), page_size_kb=4)
    try:
        assert model.colibri.decode == [*(f"model.layers.{i}" for i in range(LAYERS)), "model"]
        ids = token_ids(4, batch=1, length=5, high=256)
        runs = []
        for _ in range(2):
            runs.append(model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                                       return_dict_in_generate=True))  # fmt: skip
            for name in model.colibri.decode:  # the second run: the layers' own forward
                model.get_submodule(name).__dict__.pop("forward", None)
        assert torch.equal(runs[0].sequences, runs[1].sequences)
        for a, b in zip(runs[0].logits, runs[1].logits, strict=True):
            assert torch.equal(a, b)
    finally:
        model.colibri.close()


_Q_PROJ = "model.layers.0.self_attn.q_proj"  # the file's one Q8_0 linear


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])  # qwen2_moe: with a bias
def test_quantized_linears_stay_as_stored(written, family):
    """In half precision the file's Q8_0 projection stays as stored (its weight on the meta
    device, never bfloat16) and runs colibri's quantized linear kernel, within the rounding of
    int8 activations and a bfloat16 output of the float64 product of the dequantized weight;
    ``linears="torch"`` dequantizes it."""
    path, ref = written(family=family)
    model = from_pretrained(path, budget=2 * _expert_bytes(), page_size_kb=4)
    plain = from_pretrained(path, budget=2 * _expert_bytes(), page_size_kb=4, linears="torch")
    try:
        choice = model.colibri.linears[HEADS * HEAD_DIM, H, "q8_0"]
        assert choice.engine == "colibri" and choice.modules == [_Q_PROJ]
        module = model.get_submodule(_Q_PROJ)
        assert module.weight.is_meta and module.weight.shape == (HEADS * HEAD_DIM, H)
        assert plain.get_submodule(_Q_PROJ).weight.dtype == torch.bfloat16
        assert all(key[2] == "bfloat16" for key in plain.colibri.linears)
        x = torch.randn(11, H).to(torch.bfloat16)  # > 8 rows too: every input
        want = x.double() @ ref.get_submodule(_Q_PROJ).weight.double().T
        if family == "qwen2_moe":  # a bias changed in place (the file's are zeros) is added
            with torch.no_grad():
                module.bias.copy_(torch.randn(HEADS * HEAD_DIM))
            want += module.bias.double()
        with torch.no_grad():
            got = module(x)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        error = (got.double() - want).abs()
        assert error.max() < 0.01 * want.abs().max(), error.max()
        with pytest.raises(RuntimeError, match="no gradient.*torch.no_grad"):
            module(x.float().requires_grad_())
        with pytest.raises(ValueError, match="on the CPU.*meta"):
            module(x.to("meta"))
    finally:
        model.colibri.close()
        plain.colibri.close()


def test_quantized_linear_compiles_in_one_graph(written):
    """Under torch.compile the Q8_0 and Q4_0 projections are ``colibri::quant_linear`` nodes
    of the one graph (fullgraph: no break), with the eager logits."""
    path, _ = written()
    model = from_pretrained(path, budget=2 * _expert_bytes(), page_size_kb=4)
    try:
        ids = token_ids(2, batch=1, length=3)
        want = logits(model, ids)
        got, graphs = compiled_logits(model, ids)
        assert torch.equal(got, want)
        assert len(graphs) == 1 and graphs[0].code.count("torch.ops.colibri.quant_linear") == 2
        blocks = model.get_submodule(_Q_PROJ).__dict__["_colibri_linear"].blocks
        args = (torch.randn(3, H), blocks, "q8_0", torch.randn(HEADS * HEAD_DIM), 1)
        torch.library.opcheck(torch.ops.colibri.quant_linear.default, args)
    finally:
        model.colibri.close()


def test_a_corrupt_scale_of_a_quantized_linear_is_named(written, tmp_path):
    from colibri.formats.gguf import gguf_tensors

    path, _ = written()
    bad = tmp_path / "bad.gguf"
    data = bytearray(path.read_bytes())
    info = gguf_tensors(str(path))["blk.0.attn_q.weight"]
    row = info.row_bytes()
    data[info.offset + 3 * row + 34 : info.offset + 3 * row + 36] = b"\x00\x7c"  # +inf
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"blk.0.attn_q.weight.*non-finite q8_0 block "
                       r"scale \(row 3\)"):  # fmt: skip
        from_pretrained(bad, budget=2 * _expert_bytes(), page_size_kb=4)


def test_rows_a_processor_reorders_stay_quantized(written):
    """llama's GGUF q/k rows are permuted; transformers' processor undoes it on the dequantized
    values, colibri on the stored rows: the same matrix."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    from colibri.integrations.transformers._gguf import GGUFCheckpoint

    path, _ = written()
    checkpoint = GGUFCheckpoint(path)
    processor = TENSOR_PROCESSORS["llama"](
        config={"num_attention_heads": HEADS, "num_key_value_heads": KV}
    )
    checkpoint._processor = processor
    orders = {}
    for name, rows in (("blk.0.attn_q.weight", HEADS * HEAD_DIM), ("blk.0.attn_k.weight",
                       KV * HEAD_DIM), ("blk.0.attn_v.weight", KV * HEAD_DIM)):  # fmt: skip
        orders[name] = order = checkpoint._row_order(name, rows)
        values = np.random.default_rng(0).standard_normal((rows, H))
        want = processor.process(weights=values, name=name).weights
        np.testing.assert_array_equal(values[order], want)
        assert (order != np.arange(rows)).any() == (".attn_v." not in name)
    name = "blk.0.attn_q.weight"  # the file's Q8_0 one, read as the model's rows
    with open(path, "rb") as f:
        qtype, rows = checkpoint.read_blocks(f, name, orders[name])
    reader = gguf.GGUFReader(path)
    stored = next(t for t in reader.tensors if t.name == name)
    want = processor.process(weights=gguf.quants.dequantize(stored.data, G.Q8_0), name=name)
    assert qtype == "q8_0"
    np.testing.assert_array_equal(dequantize(qtype, rows), want.weights)
    processor.process = lambda weights, name, **_: type("T", (), {"weights": weights * 2})()
    assert checkpoint._row_order(name, HEADS * HEAD_DIM) is None


def test_auto_budget(written):
    path, ref = written()
    model = from_pretrained(path, budget="auto", page_size_kb=4, dtype=torch.float32)
    try:
        chosen = model.colibri.auto_budget
        assert chosen.capped  # a tiny model: every expert fits
        # resident weights counted dequantized, in float32
        resident = sum(
            t.numel() * 4 for n, t in ref.state_dict().items() if ".mlp.experts." not in n
        )
        assert chosen.resident == resident
        ids = token_ids(length=12, high=256)
        torch.testing.assert_close(logits(model, ids), logits(ref, ids), rtol=1e-4, atol=1e-3)
    finally:
        model.colibri.close()


def test_generate_command(written, capsys):
    path, _ = written()
    before = sorted(os.listdir(path.parent))
    code = main(["generate", str(path), "--budget", str(2 * _expert_bytes()), "--prompt",
                 "hello world", "--max-new-tokens", "4", "--page-size-kb", "4"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = captured.out.splitlines()
    assert lines[0].startswith(str(path)) and "2 MoE layers x 4 experts" in lines[0]
    assert lines[1].startswith("hello world")
    assert sorted(os.listdir(path.parent)) == before  # nothing written beside the file


def test_truncated_file(written, tmp_path):
    path, _ = written()
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as info:
        from_pretrained(cut, budget="1MiB")
    message = str(info.value)
    assert str(cut) in message and "\n" not in message and "truncated" in message


def test_architecture_without_experts(tmp_path):
    """A dense architecture transformers reads (qwen3): no routed experts to page."""
    path = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_tensor("blk.0.ffn_gate.weight", np.zeros((64, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedCheckpointError) as info:
        from_pretrained(path, budget="1MiB")
    message = str(info.value)
    assert str(path) in message and "'qwen3'" in message and "\n" not in message


def test_architecture_transformers_does_not_read(tmp_path):
    path = tmp_path / "other.gguf"
    _write(path, arch="nonesuch")
    with pytest.raises(UnsupportedCheckpointError) as info:
        from_pretrained(path, budget="1MiB")
    message = str(info.value)
    assert str(path) in message and "'nonesuch'" in message and "\n" not in message


def test_split_model(tmp_path):
    """A model split by gguf-split (three parts, the metadata in the first) loads from any of
    its parts; a missing part is named."""
    ref = _write(tmp_path / "tiny.gguf", split=12)
    parts = sorted(tmp_path.glob("tiny-*-of-00003.gguf"))
    assert len(parts) == 3
    model = from_pretrained(parts[1], budget=2 * _expert_bytes(), page_size_kb=4,
                            dtype=torch.float32)  # fmt: skip
    try:
        assert model.colibri.checkpoint.files == [str(p) for p in parts]
        want, got = (
            logits(ref, token_ids(length=12, high=256)),
            logits(model, token_ids(length=12, high=256)),
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    finally:
        model.colibri.close()
    code = main(["generate", str(parts[2]), "--budget", str(2 * _expert_bytes()),
                 "--max-new-tokens", "2", "--page-size-kb", "4"])  # fmt: skip
    assert code == 0  # the tokenizer from the first part, whichever part is named
    parts[2].unlink()
    with pytest.raises(CheckpointError) as info:
        from_pretrained(parts[0], budget="1MiB")
    message = str(info.value)
    assert message.startswith(str(parts[2])) and "part 3 of 3" in message
    assert "\n" not in message


def test_the_quantized_types_are_the_engines():
    from colibri.integrations.transformers._gguf import QUANTIZED_TYPES
    from colibri.layer import _quant

    assert set(QUANTIZED_TYPES) == {t.upper() for t in _quant.TYPES}


def test_experts_of_a_type_the_engine_does_not_compute(tmp_path):
    path = tmp_path / "q5_0.gguf"
    _write(path, experts=("q5_0", "q5_0"))
    with pytest.raises(UnsupportedCheckpointError) as info:
        from_pretrained(path, budget="1MiB")
    message = str(info.value)
    assert str(path) in message and "is Q5_0" in message and "\n" not in message


def test_metadata_contradicting_the_experts(tmp_path):
    path = tmp_path / "lies.gguf"
    _write(path, ffn=2 * I)
    with pytest.raises(CheckpointError) as info:
        from_pretrained(path, budget="1MiB")
    message = str(info.value)
    assert str(path) in message and "GGUF metadata" in message and "\n" not in message
