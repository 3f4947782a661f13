"""DSMoE on tiny models: the dense identity on every family, the threshold router's variable sparse
compute, the training device against the sparse layer, the straight-through gradients, resuming."""

import dataclasses
import gc
import math

import pytest
import torch

from moeify.methods.dsmoe import DsmoeConfig
from moeify.methods.dsmoe.convert import contiguous_partition, convert
from moeify.methods.dsmoe.train import DsmoeTrainingMLP, margin_gates_, sparsity_term, sparsity_terms
from moeify.moe.accounting import moe_layers, nominal_activated_parameters
from moeify.moe.experts.build import moe_from_partition
from moeify.options import OptionError, build_config
from moeify.runtime.moe import MoeMLP
from moeify.runtime.routers import ThresholdRouter
from tests.helpers.conversion import clone
from tests.helpers.killing import kill_in_step
from tests.helpers.tiny_models import FAMILY_NAMES, STORIES_VOCAB, tiny_model
from tests.helpers.weights import assert_same_weights, random_mlp

IDS = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
FAST = dict(seq_len=32, batch_size=2, analyses=False)


def converted(family, make_ctx, work_dir=None, **options):
    dense = tiny_model(family, **STORIES_VOCAB)
    ctx = dataclasses.replace(make_ctx(clone(dense)), work_dir=work_dir)
    details = convert(ctx, build_config(DsmoeConfig, {**FAST, **options})).details
    return dense, ctx, details


def threshold_layer(tau=0.5, seed=0):
    """A DSMoE layer (d=16, d_h=30, 4 contiguous experts) with random gates."""
    mlp = random_mlp(bias=True)
    router = ThresholdRouter(mlp.hidden_size, 4, tau=tau)
    torch.nn.init.normal_(router.proj.weight, generator=torch.Generator().manual_seed(seed))
    return mlp, moe_from_partition(mlp, contiguous_partition(30, 4), router)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_untrained_conversion_with_every_gate_on_is_the_dense_model(family, make_ctx):
    dense, ctx, details = converted(family, make_ctx, steps=0, tau=0.0)
    layers = moe_layers(ctx.model)
    assert len(layers) == 2 and all(isinstance(layer.router, ThresholdRouter) for layer in layers)
    assert details["expert_sizes"] == [[11] * 8, [11] * 8]  # 88 neurons, 8 contiguous blocks
    with torch.no_grad():
        reference = dense(IDS).logits
        torch.testing.assert_close(ctx.model(IDS).logits, reference, atol=1e-4, rtol=0)
        for layer in layers:  # untrained gates sit at 1/2: the tie passes tau = 1/2, nothing passes above
            layer.router.set_option("tau", 0.5)
        torch.testing.assert_close(ctx.model(IDS).logits, reference, atol=1e-4, rtol=0)
        for layer in layers:
            layer.router.set_option("tau", 0.6)
        assert (ctx.model(IDS).logits - reference).abs().max() > 1e-2  # every MLP skipped
    assert nominal_activated_parameters(ctx.model) is None  # a threshold router has no nominal count


def test_threshold_router_runs_each_token_on_its_passing_experts_only():
    mlp, layer = threshold_layer(tau=0.7)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    g = torch.sigmoid(x @ layer.router.proj.weight.T)
    active = g >= 0.7
    per_token = active.sum(1)
    assert per_token.min() == 0 and per_token.max() >= 3  # a variable number, none included
    reference = torch.zeros(64, 16)
    for t in range(64):
        for e in active[t].nonzero().flatten().tolist():  # weight (n / |A|) * g / sigma(0); Eq. 7-8
            reference[t] += 4 / per_token[t] * 2 * g[t, e] * layer.experts[e](x[t])
    reference += mlp.down_bias
    calls = [0] * 4
    for e, expert in enumerate(layer.experts):
        expert.register_forward_hook(lambda m, i, o, e=e: calls.__setitem__(e, calls[e] + i[0].shape[0]))
    with torch.no_grad():  # the packed inference path
        torch.testing.assert_close(layer(x), reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x), reference, atol=1e-5, rtol=1e-5)  # gradients on: each expert's modules
    assert calls == active.sum(0).tolist()  # real sparse compute: each expert saw its tokens only


@pytest.mark.parametrize("variant", ["full", "no_ste"])
def test_training_device_computes_what_the_sparse_layer_computes(variant):
    _, layer = threshold_layer()
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(DsmoeTrainingMLP(layer, variant)(x), layer(x), atol=1e-5, rtol=1e-5)


def test_no_gate_variant_trains_on_every_expert_and_starts_dense():
    mlp, layer = threshold_layer()
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(3))
    g = torch.sigmoid(x @ layer.router.proj.weight.T)
    expected = sum(2 * g[:, e, None] * expert(x) for e, expert in enumerate(layer.experts)) + mlp.down_bias
    device = DsmoeTrainingMLP(layer, "no_gate")
    with torch.no_grad():
        torch.testing.assert_close(device(x), expected, atol=1e-5, rtol=1e-5)  # Eq. 20
        torch.nn.init.zeros_(layer.router.proj.weight)
        with sparsity_terms([device]) as terms:
            torch.testing.assert_close(device(x), mlp.forward(x), atol=1e-5, rtol=1e-5)
        device(x)  # outside the block: no term kept
    assert len(terms) == 1 and terms[0] == pytest.approx(0.5)  # the mean gate, no G


def test_straight_through_estimator_reaches_the_gates_of_inactive_experts_only_with_ste():
    _, layer = threshold_layer()
    x = torch.randn(1, 16, generator=torch.Generator().manual_seed(4))
    g = torch.sigmoid(x @ layer.router.proj.weight.T)[0]
    tau = float(g.sort().values[1:3].mean())  # two experts pass, two do not
    layer.router.set_option("tau", tau)
    off = int(g.argmin())
    grads = {}
    for variant in ("full", "no_ste"):
        layer.zero_grad()
        DsmoeTrainingMLP(layer, variant)(x).pow(2).sum().backward()
        grads[variant] = layer.router.proj.weight.grad[off].abs().sum()
        assert layer.experts[off].down.weight.grad.abs().sum() == 0  # Eq. 13-15: inactive experts get nothing
    assert grads["full"] > 0  # Eq. 16: the gate learns whether its expert would help
    assert grads["no_ste"] == 0  # Eq. 9: without S(x) the gate below tau is stuck


def test_sparsity_loss_is_the_mean_thresholded_gate():
    gates = torch.tensor([[0.9, 0.2], [0.6, 0.4]], requires_grad=True)
    assert float(sparsity_term(gates, 0.5, "full")) == pytest.approx((0.9 + 0.6) / 4)  # Eq. 19: G(g)
    assert float(sparsity_term(gates, 0.5, "no_gate")) == pytest.approx(2.1 / 4)
    sparsity_term(gates, 0.5, "full").backward()
    assert gates.grad.tolist() == [[0.25, 0.0], [0.25, 0.0]]  # only the gates that are on pay


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gc.get_objects reaches torch.distributed's deprecated names
def test_a_recomputed_step_keeps_no_activation_past_its_backward_pass(make_ctx, monkeypatch):
    """With ``recompute`` the backward pass runs each layer's forward again; nothing of that run may outlive
    it (a sparsity term kept from it would hold the layer's recomputed activations until the next step)."""
    seq_len, left = 37, []  # a window length no other tensor here has
    step = torch.optim.AdamW.step

    def counting_step(optimizer, *args, **kwargs):
        gc.collect()
        left.append(sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dim() >= 3
                        and seq_len in o.shape[1:]))  # activations: (batch, seq, ...) or (batch, heads, seq, ...)
        return step(optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counting_step)
    converted("llama", make_ctx, steps=2, seq_len=seq_len, recompute=True)
    assert left == [0, 0]


def test_training_learns_gates_and_hardens_into_sparse_layers(make_ctx):
    dense, ctx, details = converted("llama", make_ctx, steps=4, gate_lr=0.05)
    training = details["training"]
    assert training["steps"] == 4 and training["checkpoints"] is None
    assert {"first_lm", "last_lm", "first_sparsity", "last_sparsity"} <= set(training)
    layers = moe_layers(ctx.model)
    assert all(type(m) is MoeMLP for m in (ctx.adapter.mlp_module(i) for i in range(2)))
    assert all(layer.router.proj.weight.abs().sum() > 0 for layer in layers)
    with torch.no_grad():
        assert (ctx.model(IDS).logits - dense(IDS).logits).abs().max() > 1e-3
    assert not any(isinstance(m, DsmoeTrainingMLP) for m in ctx.model.modules())


def test_margin_start_fits_every_gate_to_the_margin_and_starts_as_the_dense_model(make_ctx):
    """With fewer tokens than the hidden size the least-squares fit is exact: every token of the batch
    starts with each gate at sigma(margin), which weighs 1, so the start model is the dense one."""
    dense, ctx, _ = converted("llama", make_ctx, steps=0)
    layers = moe_layers(ctx.model)
    for layer in layers:
        layer.router.gate_scale = 1 + math.exp(-1.5)  # 1 / sigma(1.5), as gate_margin=1.5 builds them
    batch = IDS[:2, :12]  # 24 tokens < d = 64, in two forwards
    lowest = margin_gates_(ctx, layers, batch, 1.5, batch_size=1)
    assert lowest == pytest.approx(1.5, abs=1e-4)
    logits = []
    hooks = [layer.router.register_forward_hook(lambda m, a, out: logits.append(m.proj(a[0]))) for layer in layers]
    with torch.no_grad():
        torch.testing.assert_close(ctx.model(batch).logits, dense(batch).logits, atol=1e-4, rtol=0)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(torch.cat(logits), torch.full_like(torch.cat(logits), 1.5), atol=1e-4, rtol=0)
    assert all(torch.equal(layer.router.proj.weight[0], layer.router.proj.weight[-1]) for layer in layers)


def test_default_training_starts_from_gates_on_fitted_on_four_tokens_per_dimension(make_ctx):
    """One batch of 2 x 32 tokens, d = 64: the fit draws windows until it has 4 d tokens. A random model's
    MLP inputs share no direction, so its fit is loose (the lowest start logit is recorded, not asserted;
    SmolLM2's fit: tests/integration/test_smollm2_gguf.py); on average the gates start at sigma(1)."""
    _, _, details = converted("qwen2", make_ctx, steps=1)
    training = details["training"]
    assert training["gate_start_fit_tokens"] == 8 * 32  # ceil(4 x 64 / 32) windows
    assert math.isfinite(training["gate_start_lowest_logit"])
    assert training["first_sparsity"] == pytest.approx(1 / (1 + math.exp(-1.0)), abs=0.05)  # mean g = sigma(1)


def test_killed_conversion_resumes_to_the_uninterrupted_result(make_ctx, tmp_path, monkeypatch):
    options = dict(steps=5, checkpoint_every=2)
    _, reference, _ = converted("qwen2", make_ctx, work_dir=tmp_path / "a", **options)
    kill_in_step(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        converted("qwen2", make_ctx, work_dir=tmp_path / "b", **options)
    monkeypatch.undo()
    with pytest.raises(FileExistsError, match="resume=true"):
        converted("qwen2", make_ctx, work_dir=tmp_path / "b", **options)
    _, resumed, details = converted("qwen2", make_ctx, work_dir=tmp_path / "b", resume=True, **options)
    assert details["training"]["resumed_from"] == 2
    assert "gate_start_lowest_logit" not in details["training"]  # the checkpoint holds the gates: no fit
    assert_same_weights(resumed.model, reference.model)


@pytest.mark.parametrize("options,message", [
    ({"tau": "1.5"}, r"tau=1.5 is out of range; allowed: \[0.0, 1.0\]"),
    ({"variant": "ste"}, r"variant='ste' is not allowed; choose one of: full, no_ste, no_gate"),
    ({"batch_size": "6", "grad_accum": "4"}, r"batch_size=6 must be a multiple of grad_accum=4"),
    ({"num_experts": "1"}, r"num_experts=1 is out of range; allowed: \[2, inf\]"),
    ({"lr": "0"}, r"lr=0.0 is out of range; allowed: \(0.0, inf\]"),
    ({"top_k": "2"}, r"unknown option\(s\) top_k"),
    ({"tau": "0.8"}, r"gate_margin=1.0 starts the gates at sigma\(1.0\) = 0.731, not above tau=0.8; allowed: "
                     r"gate_margin > 1.386"),
])
def test_bad_options_fail_with_value_and_allowed_range(options, message):
    with pytest.raises(OptionError, match=message):
        build_config(DsmoeConfig, options)


def test_model_dependent_limits_and_resume_without_a_work_folder(make_ctx):
    config = tiny_model("llama").config
    with pytest.raises(OptionError, match=r"num_experts=89 must be <= the MLP width d_h \(88\)"):
        DsmoeConfig(num_experts=89).check(config)
    with pytest.raises(OptionError, match=r"seq_len=4096 must be <= the model's context \(128\)"):
        DsmoeConfig(seq_len=4096).check(config)
    with pytest.raises(OptionError, match="resume=true needs a work folder"):
        converted("llama", make_ctx, resume=True)


def test_threshold_is_a_validated_runtime_option():
    _, layer = threshold_layer()
    x = torch.randn(50, 16)
    layer.track_stats = True
    for tau in (0.0, 0.3, 0.6, 0.9):
        layer.router.set_option("tau", str(tau))  # as --set passes it
        layer.reset_stats()
        layer(x)
        assert layer.router.spec() == {"kind": "threshold", "num_experts": 4, "tau": tau, "gate_scale": 2.0}
        counts = layer.stats_expert_tokens.sum()
        assert counts == (torch.sigmoid(x @ layer.router.proj.weight.T) >= tau).sum()
    assert layer.stats_expert_tokens.sum() < 50 * 4
    with pytest.raises(ValueError, match=r"tau=2.0 is out of range; allowed: \[0, 1\]"):
        layer.router.set_option("tau", 2)
    with pytest.raises(ValueError, match="options: tau"):
        layer.router.set_option("top_k", 1)


def test_the_paper_weighting_is_eq_7_8_and_a_random_start_uses_it():
    from moeify.methods.dsmoe.config import gate_scale

    mlp, neutral = threshold_layer(seed=3)
    x = torch.randn(64, mlp.hidden_size, generator=torch.Generator().manual_seed(4))
    paper = ThresholdRouter(mlp.hidden_size, 4, tau=0.5, gate_scale=1.0)
    paper.proj.weight.data.copy_(neutral.router.proj.weight)
    gates = paper.gates(x)
    active = gates >= 0.5
    expected = torch.where(active, gates, 0.0) * 4 / active.sum(1, keepdim=True).clamp_min(1)  # g n / |A|
    got = torch.zeros_like(gates)
    dispatch = paper(x)
    got[dispatch.token, dispatch.expert] = dispatch.weight
    torch.testing.assert_close(got, expected)
    neutral_dispatch = neutral.router(x)
    torch.testing.assert_close(neutral_dispatch.weight, 2 * dispatch.weight)  # 1 / sigma(0) on top
    assert gate_scale(DsmoeConfig(gate_init="random")) == 1.0
    assert gate_scale(DsmoeConfig(gate_init="random", gate_weighting="neutral")) == 2.0
    assert gate_scale(DsmoeConfig(gate_init="zero")) == gate_scale(DsmoeConfig(steps=0)) == 2.0  # g0 = 1/2
    assert gate_scale(DsmoeConfig(gate_margin=2.0)) == pytest.approx(1 + math.exp(-2.0))  # 1 / sigma(2)
    assert ThresholdRouter(8, 2, gate_scale=1.0).spec()["gate_scale"] == 1.0  # saved with the model


def test_active_ratio_sets_tau_after_training_for_the_apr_on_the_training_text(make_ctx):
    """The trained gates stay; the one tau of every layer moves so that the APR measured on training windows
    is the target, and the converted model keeps it (its routers, the record, the activation analysis)."""
    from moeify.calibration.data import calibration_batches
    from moeify.methods.dsmoe.budget import measured_apr

    _, ctx, details = converted("llama", make_ctx, steps=3, active_ratio=0.6)
    matched = details["matched_tau"]
    assert matched["trained_tau"] == 0.5 and matched["tau"] != 0.5
    assert matched["trained_apr"] > 0.6 + 0.05 and matched["apr"] == pytest.approx(0.6, abs=0.02)
    assert {layer.router.tau for layer in moe_layers(ctx.model)} == {matched["tau"]}
    windows = calibration_batches(ctx.calib, ctx.tokenizer, FAST["batch_size"], FAST["seq_len"], ctx.seed)
    assert measured_apr(ctx.model, windows) == matched["apr"]  # the routers hold the tau that measured it


def test_an_active_ratio_below_the_attention_share_fails_before_training(make_ctx, monkeypatch):
    import moeify.methods.dsmoe.train as train

    monkeypatch.setattr(train, "continue_training", lambda *a: pytest.fail("trained before the check"))
    with pytest.raises(OptionError, match=r"active_ratio=0.1 is out of range; allowed: \(0\.\d+, 1\]"):
        converted("llama", make_ctx, active_ratio=0.1)
