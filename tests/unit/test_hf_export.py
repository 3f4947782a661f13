"""Exports of the embedded stories260K: a MoRE conversion (shared backbone, a dense first layer, unequal
petals, cosine prototypes), a top-1 ToMoE conversion (MLP experts, attention kept), a top-1 Dense2MoE
conversion (one layer fused away, softmax-weighted experts) and a static pruning of MLP channels (dense:
llama) exported to every format that represents them load with plain transformers in a process that
cannot import moeify, and give the native logits.

fp32: at inference the native runtime runs its experts in the layout transformers holds them in (stacked,
zero-padded to the export's width, one fused gate/up grouped matmul; the shared part at the export's
width), so each exported MLP block computes bit for bit what the native layer computes, and the logits
agree within 1e-5 (float32). What remains is below it: on one-token inputs MKL's matrix-vector kernels
round by the memory alignment of the weights, which safetensors' memory map leaves to each file's
layout (measured 3.3e-6). Except mixtral for MoRE: mixtral has no shared part, so the backbone and the
dense first layer join every expert, one sum where the native model has two; exact in float64 (checked
below to 1e-9), in float32 up to 5.2e-5 apart (MoRE 0.95e-5..2.7e-5 on 8 probes; granitemoeshared, whose
dense first layer is folded so, 3.0e-5 on the text probe; ToMoE's mixtral export, its shared part joined to
every expert, 5.2e-5 on one CPU), so rearranged layers are held to 1e-4.
"""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import moeify
from moeify.api import export_folder
from moeify.calibration.data import EMBEDDED_EVAL, read_text, token_stream
from moeify.cli.main import main
from moeify.export.hf_export import EXPORTERS
from moeify.moe.accounting import moe_layers
from tests.helpers.remote import plain_logits

pytestmark = pytest.mark.slow  # three conversions of stories260K with training, and exports (~15 s)

MOE_FORMATS = ("glm4_moe", "qwen2_moe", "mixtral", "granitemoeshared")
FP32_TOLERANCE = 1e-5  # the bound an exact export keeps in float32
FOLDED = {("more", "mixtral"), ("more", "granitemoeshared")}  # a dense layer (mixtral: the shared part too)
# folded into every expert
# ToMoE's shared part: joined to every expert (mixtral), stored as n x W shared experts, wider than it is (glm4_moe)
REARRANGED = FOLDED | {("tomoe", "mixtral"), ("tomoe", "glm4_moe")}
# granitemoeshared computes a shared part's gate and up rows in one matmul, the runtime in two: other float32 sums
# (ToMoE's: 1.6e-5 on the text probe)
STACKED_SHARED = {("tomoe", "granitemoeshared")}
FOLDED_FP32_TOLERANCE = 1e-4  # rearranged layers (folded parts)
ARCHITECTURES = {"glm4_moe": "Glm4MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "granitemoeshared": "GraniteMoeSharedForCausalLM", "llama": "LlamaForCausalLM"}
EXPERT_KEY = {"glm4_moe": "model.layers.1.mlp.experts.3.gate_proj.weight",  # transformers' original layout,
              "qwen2_moe": "model.layers.1.mlp.experts.3.up_proj.weight",  # the one serving engines read
              "mixtral": "model.layers.1.block_sparse_moe.experts.3.w1.weight",
              "granitemoeshared": "model.layers.1.block_sparse_moe.input_linear.weight"}
# conversion -> (method, options, the formats that represent it; Dense2MoE's p E / k weights: qwen2_moe only)
CONVERSIONS = {"more": ("more", {}, MOE_FORMATS),
               "tomoe": ("tomoe", {"attention": "off", "steps": "60"}, MOE_FORMATS),
               "dense2moe": ("dense2moe", {"steps": "20"}, ("qwen2_moe",)),
               "static_prune": ("static_prune", {"attention": "off"}, ("llama",))}
EXPORTS = [(name, fmt) for name, (_, _, formats) in CONVERSIONS.items() for fmt in formats]


@pytest.fixture(scope="module")
def natives(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    return {name: moeify.save(moeify.convert(None, method, options, measure_speed=False), root / name)
            for name, (method, options, _) in CONVERSIONS.items()}


@pytest.fixture(scope="module")
def native(natives):
    return natives["more"]


@pytest.fixture(scope="module")
def exports(natives, tmp_path_factory):
    """{(conversion, format): (record, folder)} for every format that represents the conversion."""
    root = tmp_path_factory.mktemp("exports")
    return {(name, fmt): (export_folder(natives[name], fmt, root / f"{name}-{fmt}"), root / f"{name}-{fmt}")
            for name, fmt in EXPORTS}


@pytest.fixture(scope="module")
def exported(exports):
    return {fmt: value for (name, fmt), value in exports.items() if name == "more"}


@pytest.fixture(scope="module")
def probes(tokenizer):
    text = token_stream(read_text(EMBEDDED_EVAL), tokenizer)
    random = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    return {"text": text[:128][None], "random": random}


def test_more_is_represented_by_every_format(native):
    model = moeify.load(native)
    assert len(moe_layers(model)) == 4 and all(layer.shared is not None for layer in moe_layers(model))
    assert all(EXPORTERS[fmt].supports(model) for fmt in MOE_FORMATS)
    assert "layers 1, 2, 3, 4 route tokens to experts; llama is dense" in str(EXPORTERS["llama"].supports(
        model, explain=True))


def test_tomoe_and_dense2moe_conversions_are_top1_and_what_the_formats_say(natives):
    tomoe, dense2moe = moeify.load(natives["tomoe"]), moeify.load(natives["dense2moe"])
    assert all(layer.router.top_k == 1 for layer in moe_layers(tomoe) + moe_layers(dense2moe))
    assert all(EXPORTERS[fmt].supports(tomoe) for fmt in MOE_FORMATS)
    for fmt in ("glm4_moe", "mixtral"):  # weights p E / k: softmax probabilities, not renormalised
        assert "softmax-probability expert weights" in str(EXPORTERS[fmt].supports(dense2moe, explain=True))


def test_plain_transformers_without_moeify_loads_every_export(natives, exports, probes, tmp_path):
    loaded = plain_logits({f"{name}-{fmt}": path for (name, fmt), (_, path) in exports.items()}, probes,
                          tmp_path, trust_remote_code=False)
    for (name, fmt), (record, _) in exports.items():
        architecture, logits = loaded[f"{name}-{fmt}"]
        assert architecture == ARCHITECTURES[fmt]
        assert bool(record["rearranged_layers"]) == ((name, fmt) in REARRANGED)
        reference = moeify.load(natives[name])
        with torch.no_grad():
            for probe, ids in probes.items():
                gap = float((logits[probe] - reference(ids).logits).abs().max())
                loose = record["rearranged_layers"] or (name, fmt) in STACKED_SHARED
                assert gap < (FOLDED_FP32_TOLERANCE if loose else FP32_TOLERANCE), \
                    (name, fmt, probe, gap)


@pytest.mark.parametrize("name, fmt", [e for e in EXPORTS if e not in FOLDED and e[1] != "granitemoeshared"])
def test_exported_mlp_blocks_compute_the_native_layers_bit_for_bit(natives, name, fmt, probes):
    model = moeify.load(natives[name]).eval()
    built = EXPORTERS[fmt].build(model)
    export, rearranged = built.model.eval(), set(built.record["rearranged_layers"])
    inputs = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda module, args, i=i: inputs.setdefault(i, args[0]))
    with torch.no_grad():
        model(probes["text"])
        for i, x in inputs.items():
            native, exported = model.model.layers[i].mlp(x), export.model.layers[i].mlp(x)
            if i in rearranged:  # the same function in other float32 sums (ToMoE's shared part)
                torch.testing.assert_close(native, exported, atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(native, exported), (name, fmt, i)


@pytest.mark.parametrize("name, fmt", EXPORTS)
def test_exports_are_exact_in_float64(natives, name, fmt, probes):
    model = moeify.load(natives[name]).double()
    for layer in moe_layers(model):  # the runtime's cosine router scores in float32 by design
        if hasattr(layer.router, "prototypes"):
            layer.router.prototypes = layer.router.prototypes.float()
    export = EXPORTERS[fmt].build(model)
    assert export.record["exact"]
    with torch.no_grad():
        for ids in probes.values():
            assert float((export.model(ids).logits - model(ids).logits).abs().max()) < 1e-9


def test_exported_folders_hold_the_standard_layout(exported):
    for fmt, (record, path) in exported.items():
        config = json.loads((path / "config.json").read_text())
        assert config["model_type"] == fmt and "auto_map" not in config and "moeify" not in config
        assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None  # legacy keys
        with safe_open(path / "model.safetensors", "pt") as f:
            assert EXPERT_KEY[fmt] in set(f.keys())
        saved = json.loads((path / "moeify_export.json").read_text())
        assert saved["exact"] and saved["max_abs_logit_diff"] == record["max_abs_logit_diff"] < FOLDED_FP32_TOLERANCE
        assert saved["max_abs_mlp_diff_float64"] < 1e-12  # the mapping itself: exact
        assert [layer["routed"] for layer in saved["layers"]] == [False, True, True, True, True]
        assert saved["rearranged_layers"] == {"mixtral": [0, 1, 2, 3, 4], "granitemoeshared": [0]}.get(fmt, [])
    glm4 = json.loads((exported["glm4_moe"][1] / "config.json").read_text())
    assert glm4["first_k_dense_replace"] == 1 and glm4["partial_rotary_factor"] == 1.0
    assert glm4["num_experts_per_tok"] == 1 and glm4["norm_topk_prob"] and glm4["routed_scaling_factor"] == 1.0
    qwen2 = json.loads((exported["qwen2_moe"][1] / "config.json").read_text())
    assert qwen2["mlp_only_layers"] == [0] and qwen2["norm_topk_prob"] and qwen2["qkv_bias"]


def test_the_recorded_parameter_count_is_the_loaded_exports(exports):
    for (name, fmt), (record, path) in exports.items():  # a tied head counted once, as transformers loads it
        loaded = AutoModelForCausalLM.from_pretrained(path)
        assert record["params"]["export"] == sum(p.numel() for p in loaded.parameters()), (name, fmt)


def test_cli_check_and_export(native, tmp_path, capsys):
    assert main(["export", str(native), "--check"]) == 0
    assert capsys.readouterr().out.count("represents the model exactly") == 4
    assert main(["export", str(native), "--format", "mixtral", "--out", str(tmp_path / "mx")]) == 0
    out = capsys.readouterr().out
    assert "exact (up to fp rounding)" in out and "params source -> export" in out and "(the mapping itself)" in out
    assert "rearranged in layers 0, 1, 2, 3, 4" in out  # mixtral folds MoRE's backbone and dense layer
    assert main(["export", str(native), "--format", "mixtral", "--out", str(tmp_path / "mx")]) == 2
    assert "exists (an earlier moeify output); pass --overwrite" in capsys.readouterr().err
    assert main(["export", str(native), "--format", "gpt_oss", "--out", str(tmp_path / "x")]) == 2
    assert "unknown export format 'gpt_oss'; available: glm4_moe, qwen2_moe, mixtral, granitemoeshared, llama" in capsys.readouterr().err
    approximate = ["--format", "glm4_moe", "--out", str(tmp_path / "d"), "--approximate"]
    assert main(["export", str(native), *approximate]) == 2
    assert "this model has none: its export is exact without it" in capsys.readouterr().err
    assert main(["export", str(native), "--format", "glm4_moe", "--out", str(tmp_path / "c"), "--eval", "x.txt"]) == 2
    assert "they need --approximate" in capsys.readouterr().err


def test_dense2moe_export_keeps_the_fused_depth_and_the_softmax_weights(exports):
    """Dense2MoE weighs its top-1 expert by p E / k (softmax, not renormalised): qwen2_moe's
    norm_topk_prob=False computes p, the constant E / k goes into the experts' down projections."""
    record, path = exports["dense2moe", "qwen2_moe"]
    config = json.loads((path / "config.json").read_text())
    assert config["norm_topk_prob"] is False and config["num_hidden_layers"] == 4  # one layer fused away
    assert [layer["routing"] for layer in record["layers"] if layer["routed"]] == [
        {"top_k": 1, "weighting": "softmax", "approximate": False}]


def _qwen2_moe_active_params(config: dict) -> int:
    """Activated attention + MLP projection parameters of a top-1 qwen2_moe checkpoint, from its config:
    q/k/v with biases and o per layer; a dense layer's MLP, or the shared expert and one routed expert."""
    d, hd = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    attention = d * q + 2 * d * kv + q * d + q + 2 * kv
    total = 0
    for layer in range(config["num_hidden_layers"]):
        widths = ([config["intermediate_size"]] if layer in config["mlp_only_layers"] else
                  [config["shared_expert_intermediate_size"], config["moe_intermediate_size"]])
        total += attention + sum(3 * d * w for w in widths)
    return total


@pytest.mark.parametrize("name, fmt", [("more", fmt) for fmt in MOE_FORMATS] + [("static_prune", "llama")])
def test_eval_and_bench_take_an_export(natives, exports, name, fmt, capsys):
    """`moeify eval` measures an export as it does the conversion it came from: the same perplexity, APR
    over the same dense model (the export's zero padding counted: the engine computes it); `moeify bench`
    finds the dense model in the export's record."""
    _, folder = exports[name, fmt]
    source = moeify.evaluate(*moeify.load_model(natives[name]))
    export = moeify.evaluate(*moeify.load_model(folder))
    assert export["ppl"] == pytest.approx(source["ppl"], rel=1e-5)
    assert export["active"]["total_params"] == source["active"]["total_params"]
    assert source["active"]["apr"] <= export["active"]["apr"]  # mixtral: > 1, the backbone in every expert
    if fmt == "qwen2_moe":
        config = json.loads((folder / "config.json").read_text())
        assert export["active"]["active_params"] == _qwen2_moe_active_params(config)
    assert main(["bench", str(folder), "--repeats", "1", "--prefill", "1x16", "--decode", "1",
                 "--prompt-len", "16", "--new-tokens", "2"]) == 0
    assert "ideal speed-up" in capsys.readouterr().out
