"""GGUF files written by moeify, read back with the ``gguf`` package's reader: a routed conversion of the
embedded stories260K (MoRE, top-1) as llama.cpp's llama with experts and, written through its
granitemoeshared export, as granitemoe; a dense one (static pruning) as llama; Dense2MoE as qwen2moe; names,
shapes, types, hyperparameters, the tokenizer and the tensor values, the FFN llama.cpp computes from a file
against the converted layer's, and the permutation of q and k into llama.cpp's rotary layout checked
against transformers' rotary embedding. That llama.cpp runs the files
and gives the native tokens is measured in ``benchmarks/serve_llamacpp.py``."""

import json

import gguf
import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import moeify
from moeify.api import export_folder
from moeify.cli.main import main
from moeify.export.gguf import RECORD_KEY, NoGgufVocabulary, vocabulary, write_gguf
from moeify.export.gguf.tensors import rotary_interleaved
from moeify.export.hf_export import EXPORTERS
from moeify.loading import load_model

pytestmark = pytest.mark.slow  # two conversions of stories260K and their exports (~20 s)

# q8_0: half an int8 step (each 32-value block's largest magnitude / 127), plus the float16 rounding of that step
# (2^-11 relative) times the largest code, 127
Q8_BOUND = (0.5 + 127 * 2.0 ** -11) / 127


@pytest.fixture(scope="module")
def natives(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    return {name: moeify.save(moeify.convert(None, name, {"attention": "off"} if name == "static_prune" else {},
                                             measure_speed=False), root / name)
            for name in ("more", "static_prune")}


@pytest.fixture(scope="module")
def files(natives, tmp_path_factory):
    """{(conversion, quant): (record, path)}"""
    root = tmp_path_factory.mktemp("gguf")
    wanted = [("more", "f32"), ("more", "q8_0"), ("static_prune", "f16")]
    return {(name, quant): (export_folder(natives[name], "gguf", root / f"{name}-{quant}.gguf", quant=quant),
                            root / f"{name}-{quant}.gguf") for name, quant in wanted}


@pytest.fixture(scope="module")
def granite(natives, files, tmp_path_factory):
    """MoRE's granitemoeshared export written to an f32 GGUF (the tokenizer from its routed file): (its
    export, the file)."""
    model = load_model(natives["more"])[0]
    export = EXPORTERS["granitemoeshared"].build(model)
    path = tmp_path_factory.mktemp("granite") / "more-granite.gguf"
    write_gguf(export, path, vocabulary([files[("more", "f32")][1]], model.config.vocab_size), "f32")
    return export.model, path


def _fields(reader: gguf.GGUFReader) -> dict:
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _expected_names(layers: int, routed: bool, shared: bool, tied: bool) -> set[str]:
    names = {"token_embd.weight", "output_norm.weight"} | (set() if tied else {"output.weight"})
    per_layer = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output"]
    per_layer += (["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
                  + (["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"] if shared else [])
                  if routed else ["ffn_gate", "ffn_up", "ffn_down"])
    return names | {f"blk.{i}.{name}.weight" for i in range(layers) for name in per_layer}


def test_a_granitemoeshared_export_is_llamacpp_granitemoe_with_its_names_shapes_and_hyperparameters(granite):
    export, path = granite
    reader = gguf.GGUFReader(path)
    fields = _fields(reader)
    cfg = export.config
    assert fields["general.architecture"] == "granitemoe"
    assert fields["granitemoe.block_count"] == cfg.num_hidden_layers
    assert fields["granitemoe.expert_count"] == cfg.num_local_experts
    assert fields["granitemoe.expert_used_count"] == cfg.num_experts_per_tok == 1
    assert fields["granitemoe.expert_shared_feed_forward_length"] == cfg.shared_intermediate_size
    assert fields["granitemoe.feed_forward_length"] == cfg.intermediate_size
    assert fields["granitemoe.attention.scale"] == pytest.approx(cfg.attention_multiplier)
    assert fields["general.file_type"] == gguf.LlamaFileType.ALL_F32
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == _expected_names(cfg.num_hidden_layers, True, cfg.shared_intermediate_size > 0,
                                           cfg.tie_word_embeddings)
    experts = tensors["blk.1.ffn_gate_exps.weight"]  # GGUF lists dimensions innermost first
    assert list(experts.shape) == [cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts]
    assert json.loads(fields[RECORD_KEY])["format"] == "granitemoeshared"


def test_a_top1_conversion_is_llamacpp_llama_with_experts_each_holding_the_shared_part(natives, files):
    """Top-1 routing with a shared part: one routed product per layer, the shared part folded into every
    expert (the mixtral form), at no more neurons per token than granitemoe's shared + routed pair; every
    layer's FFN computed as llama.cpp's llama computes it from the file is the converted model's."""
    record, path = files[("more", "f32")]
    reader = gguf.GGUFReader(path)
    fields = _fields(reader)
    source = load_model(natives["more"])[0]
    cfg = EXPORTERS["mixtral"].build(source).model.config
    assert EXPORTERS["mixtral"].neurons_per_token(source) <= EXPORTERS["granitemoeshared"].neurons_per_token(source)
    assert record["format"] == "mixtral" and fields["general.architecture"] == "llama"
    assert fields["llama.expert_count"] == cfg.num_local_experts > 1
    assert fields["llama.expert_used_count"] == cfg.num_experts_per_tok == 1
    assert fields["llama.feed_forward_length"] == cfg.intermediate_size
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == _expected_names(cfg.num_hidden_layers, True, False, cfg.tie_word_embeddings)
    assert list(tensors["blk.0.ffn_down_exps.weight"].shape) == [cfg.intermediate_size, cfg.hidden_size,
                                                                 cfg.num_local_experts]
    _assert_ffns_are_the_sources(tensors, source, 1, renormalise=True)


def test_float32_tensors_are_the_exports_with_q_and_k_in_llamacpp_rotary_order(granite):
    export, path = granite
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    state, cfg = export.state_dict(), export.config
    layer = "model.layers.1."
    gate_up = state[layer + "block_sparse_moe.experts.gate_up_proj"].numpy()
    width = cfg.intermediate_size
    assert np.array_equal(tensors["blk.1.ffn_gate_exps.weight"], gate_up[:, :width])
    assert np.array_equal(tensors["blk.1.ffn_up_exps.weight"], gate_up[:, width:])
    assert np.array_equal(tensors["blk.1.ffn_gate_inp.weight"], state[layer + "block_sparse_moe.router.weight"].numpy())
    assert np.array_equal(tensors["blk.1.attn_v.weight"], state[layer + "self_attn.v_proj.weight"].numpy())
    q = state[layer + "self_attn.q_proj.weight"]
    assert np.array_equal(tensors["blk.1.attn_q.weight"], rotary_interleaved(q, cfg.num_attention_heads).numpy())
    assert not np.array_equal(tensors["blk.1.attn_q.weight"], q.numpy())


def test_the_rotary_permutation_turns_transformers_rotation_into_llamacpp_adjacent_pair_rotation():
    """transformers rotates (i, i + d/2) pairs of each head (rotate_half); llama.cpp's llama/granite rotate
    (2i, 2i + 1). Rotating the permuted projection's output the llama.cpp way gives the permuted output of
    transformers' rotation, so attention scores (q . k over a head) are the same."""
    heads, dim, hidden, positions, theta = 3, 8, 12, 5, 10000.0
    torch.manual_seed(0)
    weight, x = torch.randn(heads * dim, hidden), torch.randn(positions, hidden)
    inv_freq = theta ** (-torch.arange(0, dim, 2).double() / dim)
    angles = torch.arange(positions).double()[:, None] * inv_freq[None]  # (positions, dim / 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q = (x.double() @ weight.double().T).view(positions, heads, dim).transpose(0, 1)[None]
    rotated_hf, _ = apply_rotary_pos_emb(q, q, cos[None], sin[None])
    permuted = (x.double() @ rotary_interleaved(weight, heads).double().T).view(positions, heads, dim // 2, 2)
    c, s = angles.cos()[:, None], angles.sin()[:, None]
    even, odd = permuted[..., 0], permuted[..., 1]
    rotated_cpp = torch.stack([even * c - odd * s, even * s + odd * c], -1).reshape(positions, heads * dim)
    expected = rotary_interleaved(rotated_hf[0].transpose(0, 1).reshape(positions, heads * dim).T, heads).T
    torch.testing.assert_close(rotated_cpp, expected, rtol=0, atol=1e-12)


def test_q8_0_quantises_the_matrices_within_one_step_and_keeps_norms_and_routers_float32(files):
    exact = {t.name: t for t in gguf.GGUFReader(files[("more", "f32")][1]).tensors}
    quantised = {t.name: t for t in gguf.GGUFReader(files[("more", "q8_0")][1]).tensors}
    assert quantised["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert quantised["blk.1.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    matrices = [n for n, t in quantised.items() if t.tensor_type == gguf.GGMLQuantizationType.Q8_0]
    assert "blk.1.ffn_gate_exps.weight" in matrices and "token_embd.weight" in matrices
    for name, tensor in quantised.items():  # rows that do not split into 32-value blocks: float16
        if name not in matrices and tensor.tensor_type == gguf.GGMLQuantizationType.F16:
            assert int(tensor.shape[0]) % 32, name
    for name in matrices:
        value = gguf.quants.dequantize(quantised[name].data, gguf.GGMLQuantizationType.Q8_0)
        reference = np.asarray(exact[name].data)
        blocks = np.abs(reference.reshape(-1, 32)).max(axis=1, keepdims=True)
        error = np.abs(value.reshape(-1, 32) - reference.reshape(-1, 32))
        assert (error <= blocks * Q8_BOUND).all(), name


def test_a_dense_conversion_is_llamacpp_llama(natives, files):
    record, path = files[("static_prune", "f16")]
    reader = gguf.GGUFReader(path)
    fields = _fields(reader)
    cfg = EXPORTERS["llama"].build(load_model(natives["static_prune"])[0]).model.config
    assert record["format"] == "llama" and fields["general.architecture"] == "llama"
    assert fields["llama.feed_forward_length"] == cfg.intermediate_size
    assert fields["llama.attention.head_count_kv"] == cfg.num_key_value_heads
    assert {t.name for t in reader.tensors} == _expected_names(cfg.num_hidden_layers, False, False,
                                                                 cfg.tie_word_embeddings)
    assert reader.tensors[0].tensor_type in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32)
    assert {t.tensor_type.name for t in reader.tensors} == {"F16", "F32"}


def test_the_tokenizer_is_the_dense_models_sentencepiece_model_and_copies_from_a_gguf_file(files, tokenizer, tmp_path):
    reader = gguf.GGUFReader(files[("more", "f32")][1])
    fields = _fields(reader)
    assert fields["tokenizer.ggml.model"] == "llama"
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == fields["llama.vocab_size"]
    vocab = tokenizer.get_vocab()
    assert all(tokens[i] == piece for piece, i in vocab.items() if i < len(tokens))
    assert fields["tokenizer.ggml.bos_token_id"] == tokenizer.bos_token_id
    assert fields["tokenizer.ggml.add_bos_token"] is True
    copied = vocabulary([files[("more", "f32")][1]], len(tokens))  # a GGUF source: its keys as they are
    writer = gguf.GGUFWriter(tmp_path / "copy.gguf", "llama")
    copied.add_to(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    again = _fields(gguf.GGUFReader(tmp_path / "copy.gguf"))
    assert {k: v for k, v in again.items() if k.startswith("tokenizer.")} == \
        {k: v for k, v in fields.items() if k.startswith("tokenizer.")}


def test_bad_requests_are_refused_before_any_work(natives, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--quant 'q3' is not one of f32, f16, q8_0, q4_k_m"):
        export_folder(natives["more"], "gguf", tmp_path / "a.gguf", quant="q3")
    with pytest.raises(ValueError, match="--quant is the gguf format's"):
        export_folder(natives["more"], "qwen2_moe", tmp_path / "a", quant="q8_0")
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # import fails
    with pytest.raises(ValueError, match="needs llama.cpp's quantiser"):
        export_folder(natives["more"], "gguf", tmp_path / "a.gguf", quant="q4_k_m")
    (tmp_path / "exists.gguf").write_bytes(b"not moeify's")
    with pytest.raises(FileExistsError, match="exists"):
        export_folder(natives["more"], "gguf", tmp_path / "exists.gguf")
    assert (tmp_path / "exists.gguf").read_bytes() == b"not moeify's"


def test_a_byte_level_bpe_tokenizer_without_a_gguf_source_is_refused_by_name(natives, tmp_path):
    folder = tmp_path / "bpe"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(NoGgufVocabulary, match="convert_hf_to_gguf.py"):
        vocabulary([folder], 32)


def test_cli_writes_a_gguf_and_says_what_it_holds(natives, files, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert main(["export", str(natives["more"]), "--format", "gguf", "--quant", "f16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "llama" in printed and "MOSTLY_F16" in printed and f"wrote {out}" in printed
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_F16
    assert out.stat().st_size < files[("more", "f32")][1].stat().st_size


def _llamacpp_moe_ffn(tensors: dict, block: int, x: np.ndarray, top_k: int, renormalise: bool) -> np.ndarray:
    """llama.cpp's MoE FFN on rows ``x``, from the GGUF's arrays: softmax over every expert, the top-k weighed
    by their probabilities, renormalised over the chosen (its llama) or not (its qwen2moe); a qwen2moe shared
    expert added times silu(g) / g."""
    def silu(v):
        return v / (1 + np.exp(-v))

    def get(name):
        return np.asarray(tensors[f"blk.{block}.{name}.weight"].data, dtype=np.float64)

    logits = x @ get("ffn_gate_inp").T
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    gate, up, down = get("ffn_gate_exps"), get("ffn_up_exps"), get("ffn_down_exps")
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        chosen = np.argsort(-probs[t], kind="stable")[:top_k]
        weights = probs[t, chosen] / (probs[t, chosen].sum() if renormalise else 1.0)
        for e, weight in zip(chosen, weights):
            out[t] += weight * (down[e] @ (silu(gate[e] @ row) * (up[e] @ row)))
    if f"blk.{block}.ffn_gate_shexp.weight" not in tensors:
        return out
    g = x @ get("ffn_gate_inp_shexp")
    shared = (silu(x @ get("ffn_gate_shexp").T) * (x @ get("ffn_up_shexp").T)) @ get("ffn_down_shexp").T
    return out + shared * (silu(g) / g)[:, None]


def _assert_ffns_are_the_sources(tensors: dict, source, top_k: int, renormalise: bool) -> None:
    x = np.random.default_rng(0).standard_normal((6, source.config.hidden_size))
    for i, layer in enumerate(source.model.layers):
        with torch.no_grad():
            expected = layer.mlp(torch.tensor(x, dtype=torch.float32)).double().numpy()
        np.testing.assert_allclose(_llamacpp_moe_ffn(tensors, i, x, top_k, renormalise), expected, rtol=1e-4,
                                   atol=1e-5)


def test_dense2moe_is_llamacpp_qwen2moe_its_dense_layers_as_identical_experts(tmp_path):
    """Softmax weights that are not renormalised (Dense2MoE's) are llama.cpp's qwen2moe; its dense layers
    become E copies of their MLP under a zero router with down projections times E / k, its zero shared
    expert gets a nonzero gate: every layer's FFN, computed as llama.cpp does from the file, is the
    converted model's."""
    native = moeify.save(moeify.convert(None, "dense2moe", {"steps": 0, "warmup": 0}, measure_speed=False),
                         tmp_path / "d2m")
    record = export_folder(native, "gguf", tmp_path / "d2m.gguf", quant="f32")
    assert record["format"] == "qwen2_moe" and record["gguf"]["architecture"] == "qwen2moe"
    reader = gguf.GGUFReader(tmp_path / "d2m.gguf")
    fields = _fields(reader)
    source = load_model(native)[0]
    experts = fields["qwen2moe.expert_count"]
    top_k = fields["qwen2moe.expert_used_count"]
    assert experts > top_k == 1 and fields["qwen2moe.expert_shared_feed_forward_length"] > 0
    tensors = {t.name: t for t in reader.tensors}
    assert all(tensors[f"blk.{i}.ffn_gate_inp_shexp.weight"].data.ndim == 1 for i in range(source.config.num_hidden_layers))
    _assert_ffns_are_the_sources(tensors, source, top_k, renormalise=False)
    moe_layers = sum(np.abs(np.asarray(tensors[f"blk.{i}.ffn_gate_inp.weight"].data)).max() > 0
                     for i in range(source.config.num_hidden_layers))
    assert moe_layers == 1  # the fused layer; every other one is a dense layer's copies
