"""The least-squares refit of a converted layer's output projections (moe/experts/refit.py)."""

import copy

import pytest
import torch

from moeify.methods import get_method
from moeify.moe.experts.build import static_layer
from moeify.moe.experts.refit import refit_down_, routed_hidden
from moeify.options import build_config
from tests.helpers.conversion import clone
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model
from tests.helpers.weights import random_mlp
from tests.unit.test_moe_layer import layer_for

OPTIONS = {"cmoe": {"spec": "S1A2E8"}, "static_prune": {"active_ratio": 0.5}}


def _tokens(n: int, d: int = 16, seed: int = 2) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def test_routed_hidden_times_the_columns_is_the_layer_output():
    mlp = random_mlp(d_h=30, bias=True)
    layer = layer_for(mlp, shared=6, experts=4, top_k=1)
    x = _tokens(64)
    columns = torch.cat([layer.shared.down.weight.T] + [e.down.weight.T for e in layer.experts])
    with torch.no_grad():
        torch.testing.assert_close(routed_hidden(layer, x) @ columns + mlp.down_bias, layer(x))


def test_with_every_neuron_running_the_dense_columns_are_kept():
    """The dense columns already reproduce the dense output exactly: the fit has nothing to change."""
    mlp = random_mlp(d_h=30)
    layer = layer_for(mlp, shared=6, experts=4, top_k=4)
    before = [e.down.weight.clone() for e in layer.experts]
    report = refit_down_(layer, mlp, _tokens(400))
    assert report["error_before"] < 1e-10
    for old, expert in zip(before, layer.experts):
        torch.testing.assert_close(expert.down.weight, old, rtol=1e-4, atol=1e-5)


def test_the_fit_lowers_the_output_error_on_tokens_it_did_not_see():
    mlp = random_mlp(d_h=30)
    x, unseen = _tokens(2000), _tokens(500, seed=3)
    for layer in (layer_for(mlp, shared=6, experts=4, top_k=1), static_layer(mlp, torch.arange(0, 30, 3))):
        with torch.no_grad():
            error = lambda: float((layer(unseen) - mlp.forward(unseen)).pow(2).sum())  # noqa: E731
            before = error()
            report = refit_down_(layer, mlp, x)
            assert report["error_held_out"] < report["error_before"] and report["refitted"] == 1.0
            assert error() < before


@pytest.mark.parametrize("method", ["cmoe", "static_prune"])
def test_a_refitted_conversion_changes_only_output_projections_and_says_by_how_much(method, make_ctx):
    """A layer's routing and neurons stay the carving's (the layers after it are carved on its refitted
    outputs); layers whose fit lowers the output error on held-out calibration tokens are refitted."""
    spec = get_method(method)
    dense = tiny_model("llama", **STORIES_VOCAB)
    models, details = {}, {}
    for refit in (False, True):
        models[refit] = clone(dense)
        options = {"calib_samples": 16, "seq_len": 128, "refit_down": refit, **OPTIONS[method]}
        cfg = build_config(spec.config_cls, options)
        details[refit] = spec.convert(make_ctx(models[refit]), cfg).details
    report = details[True]["refit_down"]
    assert report["refitted"] > 0 and "refit_down" not in details[False]
    plain, refitted = models[False].state_dict(), models[True].state_dict()
    changed = {name for name, value in refitted.items() if not torch.equal(value, plain[name])}
    first = {name for name in changed if name.startswith("model.layers.0.")}  # later layers see its new outputs
    assert first and all(name.endswith("down.weight") for name in first)


def test_a_fit_that_does_not_carry_to_unseen_tokens_is_not_written():
    """Fewer tokens than neurons: the fit learns the calibration tokens, so the dense columns stay."""
    mlp = random_mlp(d_h=30)
    layer = layer_for(mlp, shared=6, experts=4, top_k=1)
    before = copy.deepcopy(layer.state_dict())
    report = refit_down_(layer, mlp, _tokens(24))
    assert report["refitted"] == 0.0 and report["error_held_out"] >= report["error_before"]
    assert all(torch.equal(value, before[name]) for name, value in layer.state_dict().items())
