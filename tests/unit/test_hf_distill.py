"""CMoE's router is not linear, so no standard format holds it: export fails saying why and what to do;
``--approximate`` fits linear routers to its decisions and reports agreement and perplexity change."""

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

import moeify
from moeify.api import ConversionResult
from moeify.api.export import export_folder
from moeify.cli.main import main
from moeify.export.hf_distill import (
    SCORE_SPAN,
    agreement,
    distilled_routing,
    fit_linear_router,
    renormalised_weight_deviation,
)
from moeify.export.hf_export import EXPORTERS
from moeify.methods.cmoe import CmoeConfig
from moeify.methods.cmoe.convert import convert
from moeify.options import build_config
from tests.helpers.conversion import clone, conversion_context

EMBEDDED_TOKENIZER = Path(moeify.__file__).parent / "data" / "stories260K" / "tokenizer.model"


@pytest.fixture(scope="module")
def cmoe_folder(stories, tokenizer, calib_text, tmp_path_factory):
    ctx = conversion_context(clone(stories[0]), tokenizer, calib_text)
    convert(ctx, CmoeConfig(calib_samples=4, seq_len=64))  # S1A1E8: top-1 over 8 routed experts
    result = ConversionResult(ctx.model, tokenizer, {"method": "cmoe"})
    return moeify.save(result, tmp_path_factory.mktemp("cmoe") / "native")


def test_export_without_distillation_says_why_and_what_to_do(cmoe_folder, tmp_path, capsys):
    assert main(["export", str(cmoe_folder), "--format", "glm4_moe", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "glm4_moe cannot represent this model" in err and "is not linear in x" in err
    assert "--approximate exports its closest form" in err
    assert "model.layers.0.mlp, model.layers.1.mlp" in err and err.count("is not linear") == 1  # one line, 5 layers
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # 200 distillation steps on 5 layers and two perplexity evaluations (~4 s)
def test_distilled_export_reports_agreement_and_perplexity_change(cmoe_folder, tmp_path, capsys):
    out = tmp_path / "glm"
    assert main(["export", str(cmoe_folder), "--format", "glm4_moe", "--out", str(out), "--approximate",
                 "--distill-steps", "200"]) == 0
    captured = capsys.readouterr()
    assert "APPROXIMATE (see the parts below)" in captured.out and "warning: the exported model approximates" in captured.err
    assert "approximated: fitted routers" in captured.out and "perplexity on tinystories_eval" in captured.out
    record = json.loads((out / "moeify_export.json").read_text())
    approximation = record["approximation"]
    distill = approximation["parts"]["fitted_routers"]
    assert record["exact"] is False and distill["steps"] == 200
    assert "NOT the converted model" in approximation["note"]
    assert 1 / 8 < distill["held_out_agreement"] <= distill["calib_agreement"] + 0.05 <= 1.05  # beats chance (8)
    assert approximation["ppl_change"] == pytest.approx(approximation["export_ppl"] - approximation["source_ppl"])
    assert [layer["original_weight_max_dev_from_1"] for layer in distill["layers"]] == [0.0] * 5  # u = 0
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "Glm4MoeForCausalLM"


def test_fit_recovers_a_linear_router():
    """Choices made by a linear router are reproduced (nearly) exactly: the fit is not the bottleneck."""
    generator = torch.Generator().manual_seed(0)
    truth, x = torch.randn(6, 32, generator=generator), 3 * torch.randn(4000, 32, generator=generator)
    chosen = (x @ truth.T).argmax(dim=-1, keepdim=True)
    weight = fit_linear_router(x[:3000], chosen[:3000], 6, steps=300)
    assert agreement(weight, x[3000:], chosen[3000:]) > 0.97
    assert agreement(fit_linear_router(x[:3000], chosen[:3000], 6, steps=1), x[3000:], chosen[3000:]) < 0.97



def test_top2_sets_are_fitted_and_their_renormalised_weights_are_one():
    """A linear router's top-2 sets are reproduced; scaled into SCORE_SPAN, qwen2_moe's renormalised
    weights times 2 are 1 within about SCORE_SPAN, with the top-2 sets unchanged."""
    generator = torch.Generator().manual_seed(0)
    truth, x = torch.randn(6, 32, generator=generator), 3 * torch.randn(4000, 32, generator=generator)
    chosen = (x @ truth.T).topk(2, dim=-1).indices
    weight = fit_linear_router(x[:3000], chosen[:3000], 6, steps=300)
    assert agreement(weight, x[3000:], chosen[3000:]) > 0.9
    routing = distilled_routing(weight, x[:3000], 2)
    assert routing.weighting == "renormalised" and routing.expert_scale == 2.0 and routing.approximate
    assert agreement(routing.weight, x[3000:], chosen[3000:]) == agreement(weight, x[3000:], chosen[3000:])
    assert renormalised_weight_deviation(routing.weight, x[3000:], 2) < 2 * SCORE_SPAN
    assert renormalised_weight_deviation(weight, x[3000:], 2) > 0.1  # unscaled, the weights are far from 1


@pytest.mark.slow  # a top-2 CMoE conversion, 100 distillation steps, two perplexities
def test_a_top2_cmoe_exports_as_qwen2_moe_with_renormalised_weights(stories, tokenizer, calib_text, tmp_path):
    ctx = conversion_context(clone(stories[0]), tokenizer, calib_text)
    # top-2 of 7 routed experts, unit weights
    convert(ctx, build_config(CmoeConfig, {"spec": "S1A2E8", "calib_samples": 4, "seq_len": 64}))
    native = moeify.save(ConversionResult(ctx.model, tokenizer, {"method": "cmoe"}), tmp_path / "native")
    support = EXPORTERS["qwen2_moe"].supports(moeify.load(native), explain=True)
    assert not support and support.approximable and "--approximate" in str(support)
    assert main(["export", str(native), "--format", "glm4_moe", "--out", str(tmp_path / "g"),
                 "--approximate", "--distill-steps", "100"]) == 2  # sigmoid scores: no renormalised softmax
    assert main(["export", str(native), "--format", "qwen2_moe", "--out", str(tmp_path / "q"),
                 "--approximate", "--distill-steps", "100"]) == 0
    record = json.loads((tmp_path / "q" / "moeify_export.json").read_text())
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["num_experts_per_tok"] == 2 and config["norm_topk_prob"] is True
    fitted = record["approximation"]["parts"]["fitted_routers"]
    assert all(layer["top_k"] == 2 and 0 < layer["max_weight_dev_from_1"] < 2 * SCORE_SPAN
               for layer in fitted["layers"])
    assert 1 / 21 < fitted["held_out_agreement"]  # beats chance: C(7, 2) = 21 sets


@pytest.mark.slow  # three exports of 50 distillation steps each, and their perplexities
def test_a_gguf_of_fitted_top1_routers_goes_through_mixtral_computing_the_granitemoeshared_form(cmoe_folder,
                                                                                                 tmp_path):
    """Fitted top-1 routers weigh the chosen expert 1, so llama.cpp's llama with experts (the shared part
    folded into every expert: one routed product per layer) holds the approximation at the neurons per
    token of granitemoe's shared and routed products; the same seed fits the same routers in each."""
    native = shutil.copytree(cmoe_folder, tmp_path / "native")
    shutil.copy(EMBEDDED_TOKENIZER, native / "tokenizer.model")  # the GGUF's tokenizer: SentencePiece's
    record = export_folder(native, "gguf", tmp_path / "c.gguf", approximate=True, distill_steps=50)
    assert record["format"] == "mixtral" and record["exact"] is False
    fields = gguf.GGUFReader(tmp_path / "c.gguf").fields
    assert fields["general.architecture"].contents() == "llama" and fields["llama.expert_count"].contents() == 7
    logits = []
    for fmt in ("mixtral", "granitemoeshared"):
        export_folder(native, fmt, tmp_path / fmt, approximate=True, distill_steps=50)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / fmt, dtype=torch.float32)
        logits.append(model(input_ids=torch.arange(3, 67)[None]).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-4)  # float32 sums in another order
