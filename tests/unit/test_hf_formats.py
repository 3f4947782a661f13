"""Standard-format export on tiny models: which routers and source families each format represents,
exactly (logits against the in-memory source), and the precise reasons when it cannot."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM

from moeify.arch import DecoderAdapter
from moeify.arch.standard_moe import is_standard_moe
from moeify.export import hf_parts
from moeify.export.hf_export import EXPORTERS, NotExportable, save_hf
from moeify.moe.accounting import activated_parameters
from moeify.moe.experts.build import moe_from_partition
from moeify.moe.experts.partition import ExpertPartition
from moeify.runtime.packed import aligned_width
from moeify.runtime.routers import Dispatch, LinearForm, PrototypeRouter, ThresholdRouter
from tests.helpers.tiny_models import tiny_model

FORMATS = ("glm4_moe", "qwen2_moe", "mixtral", "granitemoeshared")  # the MoE formats; llama: what routes nothing
IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))
SHARED, WIDTHS = 24, (22, 18, 14, 10)  # 88 neurons: unequal experts, as MoRE and CMoE make them


class LinearTopK(nn.Module):
    """A router with a linear score (what Dense2MoE's softmax router and ToMoE's are), as the exporter
    expects one: ``linear_form()`` (score weight, ``top_k``, ``weighting``) and ``expert_scale``; softmax
    weights are not renormalised."""

    kind = "test_linear"
    expert_scale = 1.0

    def __init__(self, hidden: int, num_experts: int, top_k: int, weighting: str) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.weighting = num_experts, top_k, weighting
        self.proj = nn.Linear(hidden, num_experts, bias=False)

    def linear_form(self) -> LinearForm:
        return LinearForm(self.proj.weight.detach().double(), self.top_k, self.weighting)

    def forward(self, x: torch.Tensor) -> Dispatch:
        scores = self.proj(x).float()
        chosen = torch.topk(scores, self.top_k, dim=-1).indices
        weight = torch.softmax(scores, dim=-1).gather(-1, chosen) if self.weighting == "softmax" \
            else torch.ones(chosen.shape)
        return Dispatch.from_topk(chosen, weight.to(x.dtype), self.num_experts)


def prototypes(hidden: int, experts: int, top_k: int = 1) -> nn.Module:
    router = PrototypeRouter(hidden, experts, top_k=top_k)
    router.prototypes.normal_()
    router.prototypes[-1] = 0.0  # an expert no calibration token chose (similarity 0): a zero router row
    return router


def with_moe(model, layers: dict[int, int], router=prototypes, seed: int = 0):
    """``model`` with layer i's MLP split into a shared part and ``layers[i]`` unequal experts."""
    adapter = DecoderAdapter(model)
    generator = torch.Generator().manual_seed(seed)
    for i, count in layers.items():
        mlp = adapter.mlp(i)
        order = torch.randperm(mlp.intermediate_size, generator=generator)
        cuts = torch.tensor([SHARED, *WIDTHS[:count - 1]]).cumsum(0).tolist()
        shared, *experts = torch.tensor_split(order, cuts)
        partition = ExpertPartition(shared, tuple(experts))
        adapter.replace_mlp_(i, moe_from_partition(mlp, partition, router(model.config.hidden_size, count)))
    return model.eval()


def logit_gap(source, fmt: str) -> float:
    export = EXPORTERS[fmt].build(source)
    with torch.no_grad():
        return float((export.model(IDS).logits - source(IDS).logits).abs().max())


@pytest.mark.parametrize("layers", [{1: 4}, {0: 4}, {0: 3, 1: 4}], ids=["dense-first", "dense-last", "3-and-4"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_prototype_routing_is_exact_in_every_format(fmt, layers):
    """Dense layers before and after MoE layers, shared parts, unequal widths and expert counts."""
    source = with_moe(tiny_model("llama"), layers)
    assert EXPORTERS[fmt].supports(source)
    assert logit_gap(source, fmt) < 1e-5


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_linear_unit_top1_router_is_exact_in_every_format(fmt):
    router = lambda d, n: LinearTopK(d, n, top_k=1, weighting="unit")  # noqa: E731
    source = with_moe(tiny_model("llama"), {0: 4, 1: 4}, router)
    assert logit_gap(source, fmt) < 1e-5


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_mapping_is_measured_in_float64_and_a_wrong_one_is_refused(fmt, monkeypatch):
    """The float64 MLP comparison sees a mapping error far below what the float32 logits can tell from
    kernel rounding: one expert's down projection off by 1e-4 relative is refused."""
    source = with_moe(tiny_model("llama"), {1: 4})
    assert EXPORTERS[fmt].build(source).record["max_abs_mlp_diff_float64"] < 1e-12

    fold = hf_parts.fold

    def slightly_wrong(part, *args):
        shared, experts, router = fold(part, *args)
        experts[1] = replace(experts[1], down=experts[1].down * (1 + 1e-4))
        return shared, experts, router

    monkeypatch.setattr(hf_parts, "fold", slightly_wrong)
    with pytest.raises(RuntimeError, match="in float64; not written"):
        EXPORTERS[fmt].build(source)


def test_glm4_router_scores_are_kept_off_sigmoid_saturation():
    """Scores in the hundreds would all be sigmoid 1.0 in fp32: ties, so wrong experts, unless rescaled."""
    source = with_moe(tiny_model("llama"), {0: 4, 1: 4}, lambda d, n: LinearTopK(d, n, top_k=1, weighting="unit"))
    with torch.no_grad():
        for layer in (0, 1):
            DecoderAdapter(source).mlp_module(layer).router.proj.weight.mul_(1000.0)
    assert logit_gap(source, "glm4_moe") < 1e-5


def test_softmax_weights_are_qwen2_moe_only():
    router = lambda d, n: LinearTopK(d, n, top_k=2, weighting="softmax")  # noqa: E731
    source = with_moe(tiny_model("llama"), {1: 4}, router)
    assert logit_gap(source, "qwen2_moe") < 1e-5
    for fmt in ("glm4_moe", "mixtral"):
        assert "softmax-probability expert weights" in str(EXPORTERS[fmt].supports(source, explain=True))


def test_qk_norm_attention_goes_to_glm4_moe_only():
    source = with_moe(tiny_model("qwen3"), {1: 4})
    assert logit_gap(source, "glm4_moe") < 1e-5  # use_qk_norm=True
    for fmt in ("qwen2_moe", "mixtral"):
        reason = str(EXPORTERS[fmt].supports(source, explain=True))
        assert f"have no place in {fmt}" in reason and "self_attn.k_norm.weight" in reason


def test_qkv_biases_go_to_glm4_and_qwen2_moe_not_mixtral():
    source = with_moe(tiny_model("qwen2"), {1: 4})
    assert logit_gap(source, "glm4_moe") < 1e-5 and logit_gap(source, "qwen2_moe") < 1e-5
    assert "self_attn.k_proj.bias" in str(EXPORTERS["mixtral"].supports(source, explain=True))


def test_qwen2_moe_gets_zero_qkv_biases_for_engines_that_always_build_them():
    export = EXPORTERS["qwen2_moe"].build(with_moe(tiny_model("llama"), {1: 4}))
    assert export.model.config.qkv_bias and not export.model.model.layers[0].self_attn.q_proj.bias.any()


@pytest.mark.parametrize("family, overrides, fmt, reason", [
    ("llama", {"attention_bias": True}, "glm4_moe", "self_attn.o_proj.bias"),
    ("llama", {"head_dim": 8}, "qwen2_moe", "vLLM's qwen2_moe derives head_dim"),
    ("mistral", {"sliding_window": 32}, "mixtral", "sliding window of 32 tokens"),
    ("phi3", {}, "glm4_moe", "self_attn.qkv_proj.weight"),
    ("gpt_neox", {}, "qwen2_moe", "parallel residual"),
    ("gpt_neox", {}, "qwen2_moe", "two-layer MLP"),
])
def test_source_families_the_formats_cannot_hold_are_explained(family, overrides, fmt, reason):
    layers = {} if family == "gpt_neox" else {1: 4}  # (gpt_neox's two-layer MLP: its dense form is explained)
    source = with_moe(tiny_model(family, **overrides), layers)
    support = EXPORTERS[fmt].supports(source, explain=True)
    assert not support and reason in str(support)
    with pytest.raises(NotExportable, match="cannot represent this model"):
        EXPORTERS[fmt].build(source)


@pytest.mark.parametrize("router, reason, approximable", [
    (lambda d, n: prototypes(d, n, top_k=2), "2 experts per token each with weight 1", False),
    (lambda d, n: ThresholdRouter(d, n), "token-dependent set of experts", True),  # its gates at a fixed k
])
def test_routers_no_format_computes_are_explained(router, reason, approximable):
    source = with_moe(tiny_model("llama"), {0: 4, 1: 4}, router)
    for fmt in FORMATS:
        support = EXPORTERS[fmt].supports(source, explain=True)
        assert not support and reason in str(support) and support.approximable is approximable


def test_a_dense_model_has_nothing_to_export_as_moe_and_exports_as_llama():
    assert "no layer is routed" in str(EXPORTERS["mixtral"].supports(tiny_model("llama"), explain=True))
    for family in ("llama", "qwen2"):  # Qwen2's q/k/v biases: LLaMA's attention_bias with a zero o_proj bias
        source = tiny_model(family)
        export = EXPORTERS["llama"].build(source)
        assert export.record["exact"] and export.record["max_abs_mlp_diff_float64"] == 0.0
        assert export.record["max_abs_logit_diff"] < 1e-5 and export.model.config.model_type == "llama"


def test_expert_widths_are_padded_for_grouped_mm():
    assert [aligned_width(w) for w in (19, 29, 93, 122, 172, 448, 500)] == [24, 32, 96, 128, 176, 448, 512]
    export = EXPORTERS["glm4_moe"].build(with_moe(tiny_model("llama"), {1: 4}))
    assert export.model.config.moe_intermediate_size == 24  # widest expert 22 -> 24
    assert export.model.config.n_shared_experts == 1  # the 24-neuron shared part fits one 24-wide expert


def test_saved_folder_has_transformers_layout_and_legacy_rope_keys(tmp_path):
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    source = with_moe(tiny_model("llama", rope_parameters=rope), {1: 4})
    export = EXPORTERS["glm4_moe"].build(source)
    out = save_hf(export, tmp_path / "glm")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "glm4_moe" and "auto_map" not in config
    assert config["rope_parameters"]["partial_rotary_factor"] == 1.0 and config["partial_rotary_factor"] == 1.0
    assert config["rope_theta"] == 5000.0 and config["rope_scaling"]["type"] == "linear"
    assert config["first_k_dense_replace"] == 1 and config["num_nextn_predict_layers"] == 0
    assert config["tie_word_embeddings"] is False  # vLLM's glm4_moe always loads lm_head.weight
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {"lm_head.weight", "model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.1.mlp.shared_experts.down_proj.weight"} <= keys
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert float((loaded(IDS).logits - source(IDS).logits).abs().max()) < 1e-5
    assert json.loads((out / "moeify_export.json").read_text())["exact"] is True


def test_exports_are_counted_as_standard_moe_against_their_dense_model():
    source = with_moe(tiny_model("llama"), {1: 4})
    export = EXPORTERS["qwen2_moe"].build(source).model
    assert is_standard_moe(export) and not is_standard_moe(source) and not is_standard_moe(tiny_model("llama"))
    dense = activated_parameters(source, measured=False)
    counted = activated_parameters(export)
    assert counted.total_params == dense.total_params  # APR over the dense model the export came from
    assert dense.apr <= counted.apr < 1  # the export's zero padding is computed, hence counted
