"""ToMoE on tiny models: Gumbel estimators, masks, conversion, pseudo-MoE, budget, resume, save/load."""

from dataclasses import replace

import pytest
import torch

import moeify
from moeify.api import ConversionResult, set_runtime_options
from moeify.arch import DecoderAdapter
from moeify.evaluation.serving import cache_keyword
from moeify.methods.tomoe import TomoeConfig
from moeify.methods.tomoe.convert import budget_threshold, convert, mlp_cost, widened_experts
from moeify.methods.tomoe.modules import KEEP_BIAS, st_gumbel_sigmoid, st_gumbel_softmax
from moeify.methods.tomoe.train import MaskedModel, TomoeModules, f_reg, learned_masks
from moeify.moe.accounting import activated_parameters
from moeify.moe.attention.head_dim import pruned_attention
from moeify.options import OptionError, build_config
from moeify.runtime.attention import PrunedAttention
from moeify.runtime.moe import MoeMLP
from moeify.runtime.routers import ArgmaxRouter
from tests.helpers.conversion import clone
from tests.helpers.killing import kill_in_step
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model
from tests.helpers.weights import layer_bytes

IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
FAST = dict(steps=3, batch_size=2, seq_len=32, calib_samples=2, checkpoint_every=0)


def converted(family, make_ctx, work_dir=None, **options):
    dense = tiny_model(family, **STORIES_VOCAB)
    ctx = replace(make_ctx(clone(dense)), work_dir=work_dir)
    details = convert(ctx, TomoeConfig(**{**FAST, **options})).details
    return dense, ctx, details


def test_straight_through_estimators_are_hard_forward_and_soft_backward():
    logits = torch.tensor([[-5.0, -2.9, 0.0]], requires_grad=True)
    hard = st_gumbel_sigmoid(logits, tau=0.4, noise=None)
    assert hard.tolist() == [[0.0, 1.0, 1.0]]  # round(sigmoid((x + b) / tau)): kept where x + 3 > 0
    hard.sum().backward()
    soft = torch.sigmoid((logits.detach() + KEEP_BIAS) / 0.4)
    assert torch.allclose(logits.grad, soft * (1 - soft) / 0.4)
    router = torch.tensor([[0.1, 2.0, -1.0]], requires_grad=True)
    one_hot, probs = st_gumbel_softmax(router, tau=0.4, noise=False)
    assert one_hot.tolist() == [[0.0, 1.0, 0.0]] and torch.allclose(probs.sum(), torch.tensor(1.0))
    (one_hot * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert router.grad.abs().sum() > 0
    assert f_reg(torch.tensor(2.0), 4.0) == f_reg(torch.tensor(8.0), 4.0) == torch.log(torch.tensor(2.0))


def test_untrained_masks_keep_the_whole_model(make_ctx):
    dense = tiny_model("llama", **STORIES_VOCAB)
    ctx = make_ctx(clone(dense))
    cfg = TomoeConfig(**FAST)
    theta = TomoeModules(ctx, cfg)
    masked = MaskedModel(ctx, theta, cfg)
    with torch.no_grad():
        masked.set_embeddings(theta.hypernet())
        for part in (*masked.mlps, *masked.attention):
            part.noise = None
        assert torch.allclose(ctx.model(IDS).logits, dense(IDS).logits, atol=1e-5)  # b = 3: all ones
        masked.restore()
        assert torch.equal(ctx.model(IDS).logits, dense(IDS).logits)


def test_experts_are_widened_from_the_union_and_the_budget_threshold_meets_it():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, -2.0],
                           [-1.0, 1.0, -0.5, -3.0, -0.2]])
    assert [s.tolist() for s in widened_experts(logits)] == [[0, 2], [1, 2]]  # expert 1 adds neuron 2 (best in union)
    assert [s.tolist() for s in widened_experts(logits, -0.6)] == [[0, 1, 2], [1, 2, 4]]
    layers = [logits, logits * 2]
    theta = budget_threshold(mlp_cost(layers, [10, 10]), layers, budget=50)  # widths (w1 + w2) x 10 <= 50
    widths = [int((x > theta).sum(1).max()) for x in layers]
    assert sum(widths) * 10 <= 50 and sum(widths) == 5


@pytest.mark.parametrize("family,attention,ratio", [("llama", "on", 0.6), ("qwen2", "on", 0.5), ("phi3", "off", 0.7),
                                                    ("gpt_neox", "off", 0.8)])
def test_conversion_meets_the_budget_and_pseudo_moe_gives_the_same_logits(family, attention, ratio, make_ctx,
                                                                          tokenizer, tmp_path):
    dense, ctx, details = converted(family, make_ctx, attention=attention, active_ratio=ratio)
    model = ctx.model
    layers = [m for m in model.modules() if isinstance(m, MoeMLP)]
    assert len(layers) == 2 and all(isinstance(m.router, ArgmaxRouter) and len(m.experts) == 8 for m in layers)
    assert all(len(set(m.expert_widths)) == 1 for m in layers)  # widened to the layer maximum
    pruned = [m for m in model.modules() if isinstance(m, PrunedAttention)]
    assert len(pruned) == (2 if attention == "on" else 0)
    counted = activated_parameters(model, measured=False)
    assert counted.apr <= ratio and counted.apr == pytest.approx(ratio, abs=0.02), details["mask_threshold"]
    assert set(details["training"]["curves"]) == {"kd", "r_p", "r_u", "r_l", "ratio"}
    with torch.no_grad():
        gathered = model(IDS).logits
        set_runtime_options(model, {"pseudo_moe": "true"})
        pseudo = model(IDS).logits
        set_runtime_options(model, {"pseudo_moe": "false"})
    assert torch.allclose(pseudo, gathered, atol=1e-5, rtol=0)
    dense_mlps = DecoderAdapter(dense)
    for i, layer in enumerate(layers):  # the overlapping experts stored once, at inference included
        assert layer_bytes(layer) <= 1.15 * layer_bytes(dense_mlps.mlp_module(i))
    out = moeify.save(ConversionResult(model, tokenizer, {"method": "tomoe"}), tmp_path / "out")
    with torch.no_grad():
        assert torch.allclose(moeify.load(out)(IDS).logits, gathered, atol=1e-5, rtol=0)  # bitwise: alignment-dependent


def test_training_keeps_no_token_statistics_past_the_step(make_ctx):
    """The backward pass recomputes every layer, masks included: statistics kept from that pass would hold
    its graph, every layer's activations in it, until the next step (0.9 GiB on SmolLM2 at 4 x 256)."""
    ctx = make_ctx(clone(tiny_model("llama", **STORIES_VOCAB)))
    cfg = TomoeConfig(**{**FAST, "attention": "on"})
    with learned_masks(ctx, cfg, cfg.seq_len) as (_, masked, log):
        assert log["steps"] == 3 and masked.mlps and masked.attention
        assert all(mlp.soft is None and mlp.hard is None for mlp in masked.mlps)
        assert all(m.tokens_kept is None and m.qk_kept is None and m._token_masks is None and m._qk_masks is None
                   for m in masked.attention)


def test_killed_conversion_resumes_to_the_uninterrupted_result(make_ctx, tmp_path, monkeypatch):
    options = dict(steps=5, checkpoint_every=2)
    _, reference, _ = converted("llama", make_ctx, work_dir=tmp_path / "a", **options)
    kill_in_step(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        converted("llama", make_ctx, work_dir=tmp_path / "b", **options)
    monkeypatch.undo()
    with pytest.raises(FileExistsError, match="resume=true"):
        converted("llama", make_ctx, work_dir=tmp_path / "b", **options)
    _, resumed, details = converted("llama", make_ctx, work_dir=tmp_path / "b", resume=True, **options)
    assert details["training"]["resumed_from"] == 2 and details["training"]["steps"] == 5
    with torch.no_grad():
        assert torch.equal(resumed.model(IDS).logits, reference.model(IDS).logits)


def test_bad_options_are_refused_before_any_work(make_ctx):
    with pytest.raises(OptionError, match=r"attention='partial' is not allowed; choose one of: auto, on, off, heads"):
        build_config(TomoeConfig, {"attention": "partial"})
    with pytest.raises(OptionError, match=r"active_ratio=0.0 is out of range"):
        build_config(TomoeConfig, {"active_ratio": "0"})
    for attention in ("on", "heads"):
        with pytest.raises(OptionError, match=f"attention={attention} is not possible for this model: .*use attention=off"):
            converted("qwen3", make_ctx, attention=attention)
    _, _, details = converted("qwen3", make_ctx)  # auto: the MLP only, and the record says why
    assert details["attention"] == "off" and "normalises query/key heads" in details["attention_blocked"]
    with pytest.raises(OptionError, match="resume=true needs a work folder"):
        converted("llama", make_ctx, resume=True)


def test_top1_mlp_experts_export_exactly_and_pruned_attention_is_explained(make_ctx):
    from moeify.export.hf_export import EXPORTERS

    _, ctx, _ = converted("llama", make_ctx, attention="off", active_ratio=0.8)
    for fmt in ("mixtral", "glm4_moe"):
        export = EXPORTERS[fmt].build(ctx.model)
        assert export.record["exact"]
        with torch.no_grad():
            assert torch.allclose(export.model(IDS).logits, ctx.model(IDS).logits, atol=1e-5, rtol=0)
    _, ctx, _ = converted("llama", make_ctx, attention="on", active_ratio=0.8)
    support = EXPORTERS["mixtral"].supports(ctx.model, explain=True)
    assert not support and "value/output head dimensions chosen per token" in str(support)


def test_mask_noise_is_eq_15s_gumbel_sample_and_starts_from_the_whole_model():
    torch.manual_seed(0)
    logits = torch.zeros(200_000)
    gumbel = 1 - st_gumbel_sigmoid(logits, tau=0.4).mean()  # the paper: P(g < -b) ~ 2e-9
    logistic = 1 - st_gumbel_sigmoid(logits, tau=0.4, noise="logistic").mean()
    assert gumbel == 0 and abs(float(logistic) - 0.047) < 0.003


def test_pruned_attention_decodes_step_by_step_as_on_the_whole_sequence(make_ctx):
    """The KV cache of the pruned attention (narrow Q/K, per-token V/O dimensions) gives, token by token,
    the logits of the full-sequence forward."""
    _, ctx, _ = converted("llama", make_ctx)
    model = ctx.model.eval()
    assert any(isinstance(m, PrunedAttention) for m in model.modules())
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :4], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(4, ids.shape[1]):
            out = model(ids[:, t:t + 1], use_cache=True, **{cache_keyword(model): cache})
            steps.append(out.logits)
            cache = out.past_key_values
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_the_budget_correction_narrows_attention_and_mlp_together(make_ctx):
    """With an unconverged run (3 steps: masks still near the whole model), the one threshold over both
    module kinds prunes attention too, instead of taking the whole budget out of the MLPs."""
    _, ctx, details = converted("llama", make_ctx, active_ratio=0.5)
    assert details["mask_threshold"] > 0  # training did not reach the budget: the correction did
    attention = [m for m in ctx.model.modules() if isinstance(m, PrunedAttention)]
    assert any(m.active_params() < m.dense_params for m in attention)
    counted = activated_parameters(ctx.model, measured=False)
    assert counted.apr == pytest.approx(0.5, abs=0.02) and counted.mlp_ratio > 0.3


def test_without_vo_routing_the_attention_is_pruned_statically_and_meets_the_budget(make_ctx, tokenizer, tmp_path):
    """Table 13's "w/o VO routing": one V/O mask per layer, learned as s_0 is; the converted attention has
    narrower V/O projections and no router, and the budget is met as with routing."""
    dense, ctx, details = converted("llama", make_ctx, attention="on", active_ratio=0.6, vo_routing=False)
    pruned = [m for m in ctx.model.modules() if isinstance(m, PrunedAttention)]
    assert len(pruned) == 2 and all(m.router is None and m.spec()["vo_index"] is not None for m in pruned)
    assert all("vo_dims" in layer and "vo_top_k" not in layer for layer in details["layers"])
    assert [len(m.spec()["vo_index"]) for m in pruned] == [layer["vo_dims"] for layer in details["layers"]]
    counted = activated_parameters(ctx.model, measured=False)
    assert counted.apr <= 0.6 and counted.apr == pytest.approx(0.6, abs=0.02)
    fresh = make_ctx(clone(dense))
    layer_modules = TomoeModules(fresh, TomoeConfig(**{**FAST, "attention": "on", "vo_routing": False})).layers
    assert not any(hasattr(m, "proj_e") for m in layer_modules)  # nothing reads the token for V/O
    out = moeify.save(ConversionResult(ctx.model, tokenizer, {"method": "tomoe"}), tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(moeify.load(out)(IDS).logits, ctx.model(IDS).logits, atol=1e-5, rtol=0)


def test_head_pruning_keeps_whole_key_value_heads_and_computes_what_training_masked(make_ctx, tokenizer, tmp_path):
    """Table 13's "Head Pruning": one static mask over each layer's key/value heads (with their query heads),
    learned as s_0. A mask that drops a head in training and the converted attention without that head
    compute the same logits; the converted model meets the budget, saves, loads and exports exactly (the
    dropped heads as zero heads)."""
    from moeify.export.hf_export import EXPORTERS

    dense, ctx, details = converted("llama", make_ctx, attention="heads", active_ratio=0.6)
    pruned = [m for m in ctx.model.modules() if isinstance(m, PrunedAttention)]
    assert len(pruned) == 2 and all(m.router is None and len(m.qk_index) == m.head_dim == len(m.vo_index)
                                    for m in pruned)  # whole heads: every head dimension of a kept head
    assert [m.num_kv_heads for m in pruned] == [layer["kv_heads"] for layer in details["layers"]]
    counted = activated_parameters(ctx.model, measured=False)
    assert counted.apr <= 0.6 and counted.apr == pytest.approx(0.6, abs=0.02)

    fresh = make_ctx(clone(dense))
    cfg = TomoeConfig(**{**FAST, "attention": "heads"})
    theta = TomoeModules(fresh, cfg)
    assert not any(hasattr(m, "proj_vo") or hasattr(m, "proj_qk") for m in theta.layers)
    masked = MaskedModel(fresh, theta, cfg)
    with torch.no_grad():
        for layer in theta.layers:  # layer 0 drops key/value head 0 (query heads 0 and 1); layer 1 keeps both
            layer.proj_heads[2].weight.zero_()
            layer.proj_heads[2].bias.fill_(100.0)
        theta.layers[0].proj_heads[2].bias[0] = -100.0
        masked.set_embeddings(theta.hypernet())
        for part in masked.attention:
            part.noise = None
        masked.set_enabled(False)  # the dense MLPs: only the attention masks act
        for attention in masked.attention:
            attention.enabled = True
        with masked.recording():
            trained = fresh.model(IDS).logits
            assert [a.heads_kept.tolist() for a in masked.attention] == [[0.0, 1.0], [1.0, 1.0]]
        masked.restore()
        adapter = fresh.adapter
        every = torch.arange(adapter.attention_module(0).head_dim)
        adapter.replace_attention_(0, pruned_attention(adapter, 0, every, vo_index=every, kept_kv_heads=torch.tensor([1])))
        assert adapter.attention_module(0).num_heads == 2 and adapter.attention_module(0).spec()["kept_kv_heads"] == [1]
        torch.testing.assert_close(fresh.model(IDS).logits, trained, atol=1e-5, rtol=0)
        assert not torch.allclose(trained, dense(IDS).logits, atol=1e-3)  # the head mattered

    out = moeify.save(ConversionResult(fresh.model, tokenizer, {"method": "tomoe"}), tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(moeify.load(out)(IDS).logits, trained, atol=1e-5, rtol=0)
        export = EXPORTERS["llama"].build(fresh.model)
        assert export.model.config.num_attention_heads == 4  # the dropped heads are zero heads
        torch.testing.assert_close(export.model(IDS).logits, trained, atol=1e-5, rtol=0)


def test_local_embeddings_make_the_attention_masks_from_each_layers_own_vector(make_ctx):
    """Table 13's "Local Emb": the hypernetwork's expert embeddings serve the MLPs only; each attention's
    masks come from a vector of its own, which training changes."""
    ctx = make_ctx(clone(tiny_model("llama", **STORIES_VOCAB)))
    cfg = TomoeConfig(**{**FAST, "attention": "on", "embeddings": "local"})
    with torch.random.fork_rng():
        torch.manual_seed(ctx.seed)  # as learned_masks seeds Theta: the vectors training starts from
        start = TomoeModules(ctx, cfg).layers
    assert TomoeModules(ctx, TomoeConfig(**FAST)).layers[0].local_embedding is None  # global: the paper's
    with learned_masks(ctx, cfg, cfg.seq_len) as (theta, masked, _):
        experts = theta.hypernet()
        for layer, initial in zip(theta.layers, start):
            assert torch.equal(layer.attention_embedding(experts[0]), layer.local_embedding)
            assert not torch.equal(layer.local_embedding, initial.local_embedding)
        masked.set_embeddings(experts)
        assert all(m.embedding is layer.local_embedding for m, layer in zip(masked.attention, theta.layers))


def test_the_lm_objective_trains_on_next_tokens_without_the_teacher_pass(make_ctx, monkeypatch):
    """Fig. 6c's ablation: cross-entropy on the training text in place of the distillation KL; the dense
    teacher pass is skipped."""
    import moeify.methods.tomoe.train as tomoe_train

    calls = []
    monkeypatch.setattr(tomoe_train, "distillation_kl", lambda *a: calls.append(1))
    _, ctx, details = converted("llama", make_ctx, attention="on", objective="lm")
    assert not calls and set(details["training"]["curves"]) == {"lm", "r_p", "r_u", "r_l", "ratio"}
    assert all(loss > 0 for loss in details["training"]["curves"]["lm"])
