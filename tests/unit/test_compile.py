"""torch.compile: every method's converted model traces as one graph (``fullgraph=True``: no host sync, no
data-dependent shape in its MoE layers, ToMoE's attention included) and gives the eager logits. The trace is
checked with the ``eager`` backend (the graph runs the same kernels, so the logits are bit-identical); a slow
test runs inductor, whose fused kernels round differently, within bfloat16 tolerance."""

from __future__ import annotations

import pytest
import torch

from moeify.methods import METHODS
from moeify.moe.accounting import moe_layers
from moeify.options import build_config
from moeify.runtime import dispatch
from moeify.runtime.dispatch import Dispatch
from tests.helpers.conversion import FAST, conversion_context
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model

IDS = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(3))
BF16_ATOL = 0.1  # fused kernels summing in another order move bfloat16 values of size ~1-5 by a few 1e-2


def converted(name: str, tokenizer, calib_text) -> torch.nn.Module:
    """A tiny bfloat16 LLaMA converted by ``name`` at its fast test options (the tests' first forward is
    eager: it builds the packed copies of the experts that a compiled graph reads)."""
    method = next(m for m in METHODS if m.name == name)
    torch.manual_seed(0)
    model = tiny_model("llama", **STORIES_VOCAB).to(torch.bfloat16)
    method.run(conversion_context(model, tokenizer, calib_text), build_config(method.config_cls, FAST.get(name, {})))
    model.eval()
    return model


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("name", [m.name for m in METHODS])
def test_every_method_compiles_as_one_graph_with_the_eager_logits(name, tokenizer, calib_text):
    torch._dynamo.reset()
    model = converted(name, tokenizer, calib_text)
    eager = logits(model)
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # a graph break fails here
    torch.testing.assert_close(logits(compiled), eager, atol=0, rtol=0)


def test_a_compiled_threshold_dispatch_lists_every_pair_with_the_chosen_ones_first():
    active = torch.tensor([[True, False, True], [False, False, True], [True, False, False]])
    weights = torch.arange(1.0, 10.0).view(3, 3)
    eager = Dispatch.from_mask(active, weights)
    fixed = torch.compile(lambda a, w: Dispatch.from_mask(a, w), fullgraph=True, backend="eager")(active, weights)
    chosen = len(eager.token)
    assert len(fixed.token) == active.numel() and fixed.real.tolist() == [True] * chosen + [False] * (9 - chosen)
    for part in ("token", "expert", "weight"):
        assert torch.equal(getattr(fixed, part)[:chosen], getattr(eager, part))
    assert torch.equal(fixed.weight[chosen:], torch.zeros(9 - chosen)) and torch.equal(fixed.counts, eager.counts)


@pytest.mark.parametrize("grad", [False, True])
def test_a_threshold_router_listing_every_pair_gives_the_logits_of_the_chosen_pairs(grad, tokenizer, calib_text,
                                                                                    monkeypatch):
    """DSMoE's dispatch as a GPU runs it at inference (every pair listed, no ``nonzero``), forced on the CPU:
    the packed path gives the chosen pairs' logits exactly, and the per-expert path (training, adapters) drops
    the listed ones it does not compute."""
    model = converted("dsmoe", tokenizer, calib_text).float()
    with torch.set_grad_enabled(grad):
        chosen = model(IDS, use_cache=False).logits
        monkeypatch.setattr(dispatch, "lists_every_pair", lambda active: True)
        listed = model(IDS, use_cache=False).logits
    torch.testing.assert_close(listed, chosen, atol=0, rtol=0)


def test_a_threshold_dispatch_lists_every_pair_at_inference_on_an_asynchronous_device():
    with torch.no_grad():
        assert dispatch.lists_every_pair(torch.ones(2, 2, device="meta"))
        assert not dispatch.lists_every_pair(torch.ones(2, 2))  # a CPU: nonzero costs no stall
    assert not dispatch.lists_every_pair(torch.ones(2, 2, device="meta"))  # training reads the counts back


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cmoe", "tomoe", "dsmoe"])
def test_inductor_compiles_top_k_shared_neuron_and_threshold_layers_within_bfloat16_tolerance(name, tokenizer,
                                                                                             calib_text):
    """Layer by layer, on the inputs the eager model gave each MoE layer: across a whole model, a rounding
    difference can flip a routing decision and move logits by more than any rounding tolerance."""
    torch._dynamo.reset()
    model = converted(name, tokenizer, calib_text)
    inputs = {}
    hooks = [layer.register_forward_hook(lambda module, args, out: inputs.setdefault(module, args[0]))
             for layer in moe_layers(model) if layer.router is not None]
    logits(model)
    for hook in hooks:
        hook.remove()
    assert inputs
    with torch.no_grad():
        for layer, x in inputs.items():
            compiled = torch.compile(layer, fullgraph=True)
            torch.testing.assert_close(compiled(x).float(), layer(x).float(), atol=BF16_ATOL, rtol=0)
            torch.testing.assert_close(compiled(x[:1, :5]).float(), layer(x[:1, :5]).float(), atol=BF16_ATOL,
                                       rtol=0)  # a second shape: a decode-sized batch


@pytest.mark.slow
def test_bench_compiles_both_models_alike_and_times_prefill_and_decode(tokenizer, calib_text):
    from moeify.evaluation.bench import benchmark_pair

    dense = tiny_model("llama", **STORIES_VOCAB).to(torch.bfloat16)
    torch._dynamo.reset()
    result = benchmark_pair(dense, converted("cmoe", tokenizer, calib_text), [(2, 16)], [2], prompt_len=8,
                            new_tokens=3, repeats=1, compile=True)
    assert result["compiled"] and result["prefill"][0]["moe"] > 0 and result["decode"][0]["moe"] > 0
    with pytest.raises(ValueError, match="compiling needs the models in bfloat16"):
        benchmark_pair(dense.float(), converted("cmoe", tokenizer, calib_text).float(), [(2, 16)], [2],
                       prompt_len=8, new_tokens=3, repeats=1, compile=True)
