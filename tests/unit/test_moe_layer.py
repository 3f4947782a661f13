"""The runtime MoE layer: dispatch bookkeeping, real sparse compute, and the all-experts identity."""

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moeify.arch.mlp import MlpWeights
from moeify.moe.experts.build import common_neurons_shared, expert_mlp, moe_from_partition, shared_neuron_experts
from moeify.moe.experts.partition import ExpertPartition, even_sizes
from moeify.runtime.experts import ExpertMLP
from moeify.runtime.moe import MoeMLP
from moeify.runtime.routers import ArgmaxRouter, Dispatch, RepresentativeRouter
from tests.helpers.weights import layer_bytes, random_mlp


def layer_for(mlp: MlpWeights, shared: int, experts: int, top_k: int) -> MoeMLP:
    sizes = even_sizes(mlp.intermediate_size - shared, experts)
    perm = torch.randperm(mlp.intermediate_size, generator=torch.Generator().manual_seed(1))
    parts = perm[shared:].split(sizes)
    router = RepresentativeRouter(mlp.hidden_size, experts, top_k, mlp.act, mlp.gated, mlp.up_bias is not None)
    torch.nn.init.normal_(router.neurons.up.weight)
    if router.neurons.gate is not None:
        torch.nn.init.normal_(router.neurons.gate.weight)
    return moe_from_partition(mlp, ExpertPartition(perm[:shared], tuple(parts)), router)


def test_dispatch_sorted_by_expert_with_counts():
    idx = torch.tensor([[2, 0], [1, 2], [2, 1]])
    w = torch.arange(6, dtype=torch.float).reshape(3, 2)
    d = Dispatch.from_topk(idx, w, num_experts=4)
    assert d.expert.tolist() == [0, 1, 1, 2, 2, 2]
    assert d.counts.tolist() == [1, 2, 3, 0]
    assert d.token.tolist() == [0, 1, 2, 0, 1, 2]
    assert d.weight.tolist() == [1.0, 2.0, 5.0, 0.0, 3.0, 4.0]


class CountedOperations(TorchDispatchMode):
    """The operations that compute (views left out) run inside the ``with`` block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.operations: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.operations[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shared", [6, 0])
def test_top1_inference_adds_each_token_s_expert_output_exactly(shared):
    """One pair per token: the layer's output is the shared part plus the token's weighted expert output, the
    same sum bit for bit as taking the pairs back to token order first (what top-k > 1 does)."""
    mlp = random_mlp()
    layer = layer_for(mlp, shared=shared, experts=4, top_k=1).eval()
    with torch.no_grad():
        layer.router.u.copy_(torch.tensor([0.5, -1.0, 2.0, 0.1]))
        x = torch.randn(40, 16, generator=torch.Generator().manual_seed(3))
        out = layer(x)
        packed = layer._current_pack()
        d = layer.router(x)
        y = packed.routed_output(x, d)[torch.argsort(d.slot)]  # each token's own pair, in token order
        expected = y + packed.shared_output(x) if shared else y
    assert torch.equal(out, expected)
    torch.testing.assert_close(out, layer._per_expert_forward(x, layer.shared(x) if shared else torch.zeros_like(x)))


def test_top1_inference_forward_issues_few_operations():
    """On a GPU each operation is a kernel launch and eager decoding is bound by their number (fixed host cost
    anywhere): a top-1 layer with a shared part is held to the count of its router, dispatch, grouped
    matmuls and one in-place add back (the dense MLP it replaces: 5)."""
    layer = layer_for(random_mlp(), shared=6, experts=4, top_k=1).eval()
    x = torch.randn(1, 1, 16)
    with torch.no_grad():
        layer(x)  # builds the packed experts
        with CountedOperations() as counted:
            layer(x)
    assert sum(counted.operations.values()) <= 27, counted.operations


@pytest.mark.parametrize("gated,bias", [(True, False), (False, True), (True, True)])
def test_all_experts_reproduce_dense_mlp(gated, bias):
    mlp = random_mlp(gated=gated, bias=bias)
    layer = layer_for(mlp, shared=6, experts=4, top_k=1)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(layer.forward_all_experts(x), mlp.forward(x), atol=1e-5, rtol=1e-5)
    layer.router.set_option("top_k", 4)  # routed path with every expert on and u = 0 (unit weights)
    torch.testing.assert_close(layer(x), mlp.forward(x), atol=1e-5, rtol=1e-5)


def test_sparse_path_equals_masked_reference_and_runs_only_routed_experts():
    mlp = random_mlp()
    layer = layer_for(mlp, shared=6, experts=4, top_k=2)
    with torch.no_grad():
        layer.router.u.copy_(torch.tensor([0.5, -1.0, 2.0, 0.1]))  # non-trivial weights g = 1 + s'u
    x = torch.randn(40, 16)
    d = layer.router(x)
    reference = layer.shared(x).clone()
    for t, e, w in zip(d.token.tolist(), d.expert.tolist(), d.weight):
        reference[t] += w * layer.experts[e](x[t])
    torch.testing.assert_close(layer(x), reference, atol=1e-5, rtol=1e-5)

    calls = [0] * 4
    for e, expert in enumerate(layer.experts):
        expert.register_forward_hook(lambda m, i, o, e=e: calls.__setitem__(e, calls[e] + i[0].shape[0]))
    x = torch.randn(64, 16)
    layer.track_stats = True
    layer(x)
    counts = layer.router(x).counts.tolist()
    assert calls == counts  # each expert saw exactly its routed tokens, never the whole batch
    assert sum(calls) == 64 * 2
    assert layer.stats_expert_tokens.tolist() == counts and layer.stats_tokens == 64


def test_router_options_are_validated():
    layer = layer_for(random_mlp(), shared=6, experts=4, top_k=1)
    with pytest.raises(ValueError, match=r"top_k=5 must be in \[1, 4\]"):
        layer.router.set_option("top_k", 5)
    with pytest.raises(ValueError, match="unknown"):
        layer.router.set_option("tau", 0.5)


def test_bias_update_moves_against_load():
    router = RepresentativeRouter(8, 3, 1, "silu", True, False, bias_speed=0.01)
    router.update_bias(torch.tensor([10, 1, 1]))
    assert router.bias.tolist() == pytest.approx([-0.01, 0.01, 0.01])


def test_expert_widths_may_differ_and_spec_roundtrips():
    from moeify.runtime.moe import build_moe_mlp

    layer = layer_for(random_mlp(d_h=31), shared=3, experts=4, top_k=2)
    assert [e.width for e in layer.experts] == [7, 7, 7, 7]
    rebuilt = build_moe_mlp(layer.spec())
    rebuilt.load_state_dict(layer.state_dict())
    x = torch.randn(9, 16)
    torch.testing.assert_close(rebuilt(x), layer(x))
    assert isinstance(rebuilt.experts[0], ExpertMLP)


def _threshold_layer(mlp: MlpWeights) -> MoeMLP:
    from moeify.runtime.routers import ThresholdRouter

    layer = layer_for(mlp, shared=0, experts=5, top_k=1)
    router = ThresholdRouter(mlp.hidden_size, 5, tau=0.5)
    torch.nn.init.normal_(router.proj.weight, generator=torch.Generator().manual_seed(3))
    return MoeMLP(list(layer.experts), router)


@pytest.mark.parametrize("case", ["gated-shared-top2", "two-layer-bias-top1", "unequal-widths-top1", "threshold",
                                  "softmax-scale"])
def test_inference_path_computes_what_the_training_path_computes(case):
    """At inference the layer runs its packed copy (stacked, zero-padded, grouped matmuls); with
    gradients on, each expert's own modules. Same function: within float32 rounding, and to 1e-12 in
    float64 (where grouped_mm has no kernel and the per-expert matmul fallback runs)."""
    from moeify.runtime.routers import SoftmaxTopKRouter

    if case == "gated-shared-top2":
        layer = layer_for(random_mlp(), shared=6, experts=4, top_k=2)
        with torch.no_grad():
            layer.router.u.copy_(torch.tensor([0.5, -1.0, 2.0, 0.1]))
    elif case == "two-layer-bias-top1":
        layer = layer_for(random_mlp(gated=False, bias=True), shared=5, experts=3, top_k=1)
    elif case == "unequal-widths-top1":
        layer = moe_from_partition(random_mlp(d_h=37), ExpertPartition(torch.arange(5), (
            torch.arange(5, 9), torch.arange(9, 30), torch.arange(30, 37))),
            RepresentativeRouter(16, 3, 1, "silu", True, False))
        torch.nn.init.normal_(layer.router.neurons.up.weight, generator=torch.Generator().manual_seed(4))
    elif case == "threshold":  # a token-dependent number of experts, some tokens with none
        layer = _threshold_layer(random_mlp())
    else:
        layer = layer_for(random_mlp(), shared=0, experts=4, top_k=1)
        layer.router = SoftmaxTopKRouter(16, 4, top_k=2)
        torch.nn.init.normal_(layer.router.proj.weight, generator=torch.Generator().manual_seed(5))
    x = torch.randn(2, 33, 16, generator=torch.Generator().manual_seed(6))
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        layer.to(dtype)
        with torch.no_grad():
            packed = layer(x.to(dtype))
        assert layer._packed is not None
        trained = layer(x.to(dtype))  # gradients on: the per-expert path, and the copy is dropped
        assert layer._packed is None
        torch.testing.assert_close(packed, trained.detach(), atol=tol, rtol=tol)


def test_packed_copy_follows_the_weights():
    layer = layer_for(random_mlp(), shared=6, experts=4, top_k=1)
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        before = layer(x)
        layer.experts[2].down.weight.mul_(3.0)  # in place: the version counter moves
        after = layer(x)
        layer.shared.neurons.up.weight = torch.nn.Parameter(torch.zeros_like(layer.shared.neurons.up.weight))
        no_shared = layer(x)
    routed_to_2 = layer.router(x).expert == 2
    rows = layer.router(x).token[routed_to_2]
    assert rows.numel() and not torch.allclose(before[rows], after[rows])
    reference = layer(x).detach()  # the per-expert path on the current weights
    torch.testing.assert_close(no_shared, reference, atol=1e-6, rtol=1e-6)
    assert float(layer.shared(x).detach().abs().max()) == 0.0


def test_packed_widths_are_multiples_of_8_or_of_64_where_cheap():
    from moeify.runtime.packed import aligned_width, packed_widths

    assert aligned_width(29) == 32 and aligned_width(352) == 352 and aligned_width(1376) == 1408
    assert packed_widths([29, 21, 9], [93, 90]) == (32, 96) and packed_widths([29], [100]) == (32, 104)
    assert packed_widths([512, 512], []) == (512, 0)
    layer = layer_for(random_mlp(d_h=37), shared=7, experts=3, top_k=1)
    with torch.no_grad():
        layer(torch.randn(4, 16))
    packed = layer._packed[1]
    assert packed.first.shape == (3, 2 * 16, 16) and packed.down.shape == (3, 16, 16)  # widths 10 -> 16
    assert packed.shared[1].shape == (8, 16)  # 7 -> 8


def test_packed_path_multiplies_only_the_routed_rows(monkeypatch):
    """Real sparsity at inference too: each grouped matmul gets exactly the (token, expert) pairs the
    router chose, grouped by expert, never the whole batch per expert."""
    from moeify.runtime import packed

    layer = layer_for(random_mlp(), shared=6, experts=4, top_k=2)
    x = torch.randn(50, 16, generator=torch.Generator().manual_seed(8))
    seen = []
    real = packed.grouped_linear

    def recording(rows, weight, offsets):
        seen.append((rows.shape[0], torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()))
        return real(rows, weight, offsets)

    monkeypatch.setattr(packed, "grouped_linear", recording)
    with torch.no_grad():
        layer(x)
    counts = layer.router(x).counts.tolist()
    assert seen == [(100, counts), (100, counts)]  # up/gate, then down: 50 tokens x top-2


def test_an_adapter_wrapped_projection_keeps_the_per_expert_path():
    """A packed copy holds plain weights only: with a projection wrapped (as peft's LoRA does), the
    layer runs each expert's modules at inference too, so the adapter's contribution is not lost."""

    class Shifted(torch.nn.Module):  # stands for a LoRA layer: the base projection plus a delta
        def __init__(self, base: torch.nn.Linear) -> None:
            super().__init__()
            self.base = base

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + 0.25

    layer = layer_for(random_mlp(), shared=6, experts=4, top_k=1)
    layer.experts[1].down = Shifted(layer.experts[1].down)
    x = torch.randn(30, 16, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        inference = layer(x)
    assert layer._packed is None
    torch.testing.assert_close(inference, layer(x).detach())


@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
def test_overlapping_experts_are_stored_once_and_compute_what_their_copies_compute(gated, bias):
    """ToMoE's experts overlap (8 experts of 160 of 256 neurons: 5x the dense MLP as copies); stored once
    their weights hold about the dense MLP, give the copies' output, and at inference run a packed copy of
    the experts, as the copies do."""
    mlp = random_mlp(d=64, d_h=256, gated=gated, bias=bias)
    g = torch.Generator().manual_seed(3)
    sets = [torch.randperm(256, generator=g)[:160].sort().values for _ in range(8)]
    router = ArgmaxRouter(64, 8)
    torch.nn.init.normal_(router.proj.weight, generator=g)
    down_bias = None if mlp.down_bias is None else mlp.down_bias.clone()
    stored_once = MoeMLP(shared_neuron_experts(mlp, sets), router, None, down_bias, dense_width=256)
    copies = MoeMLP([expert_mlp(mlp.select(s)) for s in sets], copy.deepcopy(router), None,
                    None if down_bias is None else down_bias.clone(), dense_width=256)
    assert stored_once.expert_widths == copies.expert_widths == [160] * 8
    x = torch.randn(2, 40, 64, generator=g)
    torch.testing.assert_close(stored_once(x), copies(x), atol=1e-5, rtol=0)  # training path
    with torch.no_grad():
        torch.testing.assert_close(stored_once(x), copies(x), atol=1e-5, rtol=0)  # inference path
        torch.testing.assert_close(stored_once.forward_all_experts(x), copies.forward_all_experts(x), atol=1e-4,
                                   rtol=0)
    dense_bytes = sum(t.numel() * t.element_size() for t in (mlp.up, mlp.down, mlp.gate, mlp.up_bias,
                                                             mlp.gate_bias, mlp.down_bias) if t is not None)
    stored = sum(t.numel() * t.element_size() for t in stored_once.state_dict().values())
    assert stored <= 1.15 * dense_bytes  # what a saved model holds
    assert layer_bytes(stored_once) > 5 * dense_bytes and layer_bytes(copies) > 5 * dense_bytes  # at inference
    for e, expert in enumerate(stored_once.expert_modules()):  # what an export writes
        torch.testing.assert_close(expert(x), copies.experts[e](x), atol=1e-6, rtol=0)
    assert stored_once.experts.expert_neurons() == [s.tolist() for s in sets]


def test_neurons_common_to_every_expert_run_as_a_shared_part_with_the_same_output():
    """A trained ToMoE's experts share most of their neurons: under top-1 routing with weight 1 those run
    as an always-on shared part and the experts keep the rest, and the layer computes what the copies do."""
    mlp = random_mlp(d=64, d_h=256, gated=True, bias=False)
    g = torch.Generator().manual_seed(5)
    perm = torch.randperm(256, generator=g)
    common, pool = perm[:120], perm[120:]
    sets = [torch.cat([common, pool[torch.randperm(136, generator=g)[:40]]]).sort().values for _ in range(8)]
    router = ArgmaxRouter(64, 8)
    torch.nn.init.normal_(router.proj.weight, generator=g)
    shared, experts = common_neurons_shared(mlp, sets)
    layer = MoeMLP(experts, router, shared, dense_width=256)
    copies = MoeMLP([expert_mlp(mlp.select(s)) for s in sets], copy.deepcopy(router), None, dense_width=256)
    assert shared.width >= 120 and layer.expert_widths == [160 - shared.width] * 8
    hoisted = set(experts.neuron_ids.tolist()) | set(common.tolist())
    assert set(torch.cat(sets).tolist()) == hoisted  # nothing lost, nothing added
    x = torch.randn(2, 40, 64, generator=g)
    torch.testing.assert_close(layer(x), copies(x), atol=1e-5, rtol=1e-5)  # training path
    with torch.no_grad():
        torch.testing.assert_close(layer(x), copies(x), atol=1e-5, rtol=1e-5)  # inference path
    dense_bytes = sum(t.numel() * t.element_size() for t in (mlp.up, mlp.down, mlp.gate))
    assert sum(t.numel() * t.element_size() for t in layer.state_dict().values()) <= 1.15 * dense_bytes


def test_argmax_router_weighs_one_and_still_trains_straight_through():
    """ToMoE's router weighs its expert 1 (Eq. 13) also while it trains, and a loss on the weighted
    outputs reaches its projection; without gradients nothing is added."""
    router = ArgmaxRouter(16, 4)
    torch.nn.init.normal_(router.proj.weight, generator=torch.Generator().manual_seed(0))
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    dispatch = router(x)
    assert torch.equal(dispatch.weight, torch.ones(32)) and dispatch.weight.requires_grad
    (dispatch.weight * torch.arange(32.0)).sum().backward()
    assert router.proj.weight.grad is not None and router.proj.weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert not router(x).weight.requires_grad and torch.equal(router(x).weight, torch.ones(32))


def test_experts_that_are_all_alike_keep_one_neuron_routed():
    mlp = random_mlp(d=16, d_h=32, gated=True, bias=False)
    same = torch.arange(0, 32, 2)
    shared, experts = common_neurons_shared(mlp, [same.clone() for _ in range(4)])
    assert shared.width == 15 and experts.widths == [1] * 4
