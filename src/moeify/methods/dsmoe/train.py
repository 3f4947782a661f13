"""DSMoE's continued training (§4.2-4.3, §5.2): every model parameter and the gates, LM loss plus the
sparsity loss, through a dense training device that hardens back into the sparse MoE layers.

During training each MoE layer is wrapped by ``DsmoeTrainingMLP``, which runs every expert on every
token and weights expert i by the variant's training weight (below). Computing the inactive experts is
what the straight-through estimator needs: the gradient of gate i is ``<dL/dh, o_i>`` (Eq. 16), whether
or not expert i contributed. The inactive experts' outputs are multiplied by a zero weight, so their own
weights receive no gradient (Eq. 13-15). After training the wrappers are removed: the layers are the
same ``MoeMLP`` + ``ThresholdRouter`` objects, whose forward pass equals the wrapper's (tested).

Training weights (n / |A| and the layer's gate scale as in ``rescaled_gate_weights``):
- ``full``: S(g) = sg(G(g)) + g - sg(g) (Eq. 10-11): forward G(g), gradient as if ungated.
- ``no_ste``: G(g) (Eq. 7): an expert below tau gets no gradient, nor does its gate (Eq. 9, §6.1).
- ``no_gate``: g times the gate scale for every expert, no threshold and no rescale (Eq. 20, §6.2); the
  threshold applies only at inference.

Sparsity loss (Eq. 18-19): the mean over layers, experts and tokens of G(g) (of g for ``no_gate``, which
has no G), added with ``sparsity_weight`` (1 in Eq. 17/19) to the LM loss, itself a mean over tokens
(Eq. 2 sums; with both terms per-token means the balance of Eq. 17 holds per token). G is applied
as written, without the straight-through trick: the sparsity loss pushes down only the gates that are on,
those that cost compute; the LM gradient, through S, pushes back the gates of useful experts.

Choices the paper leaves open:
- Where training starts (``gate_init``). The paper initialises the gates at random (§4.2, ``random``:
  Y ~ N(0, gate_init_std^2) from ``seed``), so that about half the gates pass tau = 1/2 at first: a
  random half of every token's neurons is dropped at step 0, which 10B tokens of training repair and a
  short run does not. Starting from the converted model as it is (``zero``: Y = 0, every gate exactly
  at tau = 1/2, the dense model) is no better: the threshold is a knife edge, and the first optimizer
  step, however small (measured on SmolLM2-135M down to gate_lr 1e-5), moves about a third of the
  gates below it at once; with Eq. 8's n / |A| on the rest, the LM loss jumps to several times the
  dense model's in one step. The default (``margin``) starts every gate on, away from the edge: each
  layer's Y_i is fit by least squares to x Y_i = ``gate_margin`` (1, g0 = 0.73) for every token x of
  windows of the training text, at least 4 d tokens (``config.FIT_TOKENS_PER_DIM``; the first batch where
  that is more), a decoder layer at a time in float32, the layers before it already fitted. MLP inputs
  of pretrained LLMs share a common direction, so the fit is close: the lowest start logit over the
  fitted tokens is recorded (``gate_start_lowest_logit``; on SmolLM2-135M it stays above 0, every gate
  on, over the fitted tokens and over held-out text, ``benchmarks/bench_dsmoe_start.py``). With fewer
  tokens the fit follows them, not that direction, and held-out tokens start with experts off. The
  sparsity loss then lowers the gates until the least useful cross tau, one token and expert at a time.
  ``benchmarks/bench_dsmoe_start.py`` compares the three starts on SmolLM2-135M (its results file holds
  the figures): ``margin`` starts at the dense LM loss, ``zero`` and ``random`` far above it.
- The gate scale (``gate_weighting``): ``neutral`` (1 / g0, the layer starts as the dense MLP) by
  default, Eq. 7-8 exactly (``paper``, scale 1) with the paper's random start, where the layer starts
  slightly above the dense output at std 0.1 (the paper's function), not at twice that.
- AdamW with torch's defaults (betas 0.9/0.999, weight decay 0.01) at a constant learning rate; the
  gates have their own learning rate (``gate_lr``), because they must move much farther from their start
  than the pre-trained weights should move in a short run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from moeify.calibration.data import token_stream
from moeify.calibration.hooks import capture_inputs
from moeify.calibration.stream import stream_layers
from moeify.methods.base import ConversionContext
from moeify.methods.dsmoe.config import DsmoeConfig, fit_windows
from moeify.runtime.moe import MoeMLP
from moeify.runtime.routers import passing_gates, rescaled_gate_weights
from moeify.training.checkpoint import latest_step
from moeify.training.loop import TrainPlan, random_windows, train
from moeify.training.losses import lm_loss
from moeify.training.precision import to_float32_


def straight_through(values: Tensor, gates: Tensor) -> Tensor:
    """S(g) = sg(G(g)) + g - sg(g): the forward value of ``values`` (= G(g)), the gradient of ``gates``; Eq. 10."""
    return values.detach() + gates - gates.detach()


def training_weights(gates: Tensor, tau: float, variant: str, gate_scale: float) -> Tensor:
    """Per-token expert weights (tokens, experts) of the variant (module docstring)."""
    if variant == "no_gate":
        return gates * gate_scale  # Eq. 20
    active = passing_gates(gates, tau)
    thresholded = torch.where(active, gates, 0.0)  # G(g); Eq. 7
    if variant == "full":
        thresholded = straight_through(thresholded, gates)  # S(g); Eq. 10-11
    return rescaled_gate_weights(thresholded, active, gate_scale)  # Eq. 8


def sparsity_term(gates: Tensor, tau: float, variant: str) -> Tensor:
    """One layer's share of Eq. 19: the mean over tokens and experts of G(g) (g for ``no_gate``)."""
    return (gates if variant == "no_gate" else torch.where(passing_gates(gates, tau), gates, 0.0)).mean()


class DsmoeTrainingMLP(nn.Module):
    """Training device around one DSMoE layer: every expert on every token, weighted per the variant.
    Inside ``sparsity_terms`` each forward pass adds the layer's sparsity term to ``terms``."""

    def __init__(self, moe: MoeMLP, variant: str) -> None:
        super().__init__()
        self.moe = moe
        self.variant = variant
        self.terms: list[Tensor] | None = None

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # (tokens, d)
        router = self.moe.router
        gates = router.gates(x)  # g = sigma(x Y): (tokens, experts); Eq. 7
        weights = training_weights(gates, router.tau, self.variant, router.gate_scale).to(x.dtype)
        sparsity = sparsity_term(gates, router.tau, self.variant)  # computed alike in a recomputation, kept only
        if self.terms is not None:                                  # when the loss asks (``sparsity_terms``)
            self.terms.append(sparsity)
        experts = self.moe.experts
        hidden = all_hidden(experts, x)  # (tokens, d_h): every expert's neurons, in expert order
        widths = torch.tensor([e.width for e in experts], device=x.device)
        hidden = hidden * weights.repeat_interleave(widths, dim=1)  # expert i's neurons scaled by its weight
        down = torch.cat([e.down.weight for e in experts], dim=1)  # (d, d_h)
        out = nn.functional.linear(hidden, down, self.moe.down_bias)  # sum_i w_i o_i (+ bias); Eq. 6-7
        return out.reshape(shape)


@contextmanager
def sparsity_terms(wrappers: list[DsmoeTrainingMLP]) -> Iterator[list[Tensor]]:
    """The sparsity terms of the forward passes inside the block, one per layer and pass in layer order.
    Outside it the layers keep none: with ``recompute`` the backward pass runs each layer's forward again,
    and a term kept from that run would hold its autograd graph, every activation of the layer, until the
    next step."""
    terms: list[Tensor] = []
    for wrapper in wrappers:
        wrapper.terms = terms
    try:
        yield terms
    finally:
        for wrapper in wrappers:
            wrapper.terms = None


def all_hidden(experts: nn.ModuleList, x: Tensor) -> Tensor:
    """The hidden activations of every expert's neurons at once (one matmul per projection instead of
    one per expert; the gradient still reaches each expert's own weights): (tokens, sum of widths)."""
    parts = [e.neurons for e in experts]

    def project(name: str) -> Tensor:
        layers = [getattr(n, name) for n in parts]
        bias = None if layers[0].bias is None else torch.cat([lin.bias for lin in layers])
        return nn.functional.linear(x, torch.cat([lin.weight for lin in layers]), bias)

    act = parts[0].act
    return act(project("up")) if parts[0].gate is None else act(project("gate")) * project("up")


def random_gates_(layers: list[MoeMLP], std: float, seed: int) -> None:
    """Y ~ N(0, std^2) in every layer, from a generator seeded with ``seed`` (the paper's start, §4.2)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in layers:
            weight = layer.router.proj.weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * std)


class MarginFit:
    """One layer's least-squares fit of x Y = margin over every token its MLP sees: X^T X and X^T 1 summed
    in float64 over the chunks of a pass (memory d^2, whatever the number of tokens), then solved; a
    second pass records the lowest start logit x Y."""

    def __init__(self, hidden_size: int) -> None:
        self.gram = torch.zeros(hidden_size, hidden_size, dtype=torch.float64)
        self.sums = torch.zeros(hidden_size, dtype=torch.float64)
        self.y: Tensor | None = None
        self.lowest = math.inf

    def add(self, x: Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to("cpu", torch.float64)
        self.gram += x.T @ x
        self.sums += x.sum(0)

    def solve(self, margin: float) -> Tensor:
        """Y minimising |X Y - margin|; the least-norm one where X^T X is singular (fewer tokens than d)."""
        self.y = torch.linalg.lstsq(self.gram, margin * self.sums[:, None], driver="gelsd").solution[:, 0]
        return self.y

    def check(self, x: Tensor) -> None:
        self.lowest = min(self.lowest, float((x.reshape(-1, x.shape[-1]).to("cpu", torch.float64) @ self.y).min()))


def margin_gates_(ctx: ConversionContext, layers: list[MoeMLP], windows: Tensor, margin: float,
                  batch_size: int) -> float:
    """Fit every layer's gates so that x Y = ``margin`` for each token x of ``windows`` in the least-squares
    sense (every expert of a layer the same Y_i), a decoder layer at a time in float32 (the layers before it
    already fitted, so each fit sees the inputs they give), ``batch_size`` windows per forward. Y is left in
    float32. Returns the lowest start logit over the tokens (below 0, a token would start with that layer's
    experts off)."""
    fits = []
    with ExitStack() as checks:
        for step in stream_layers(ctx.model, ctx.adapter, windows, device=ctx.device, batch_size=batch_size):
            moe = layers[step.index]
            fit = MarginFit(moe.router.proj.in_features)
            with capture_inputs(moe, fit.add):
                step.run()
            weight = moe.router.proj.weight
            with torch.no_grad():
                weight.copy_(fit.solve(margin).to(weight.dtype).expand_as(weight))
            checks.enter_context(capture_inputs(moe, fit.check))  # the pass's own run of the fitted layer
            fits.append(fit)
    for layer, fit in zip(layers, fits):  # the pass casts what it computed in back to the working dtype
        weight = layer.router.proj.weight
        weight.data = fit.y.to(weight.device, torch.float32).expand_as(weight).clone()
    return min(fit.lowest for fit in fits)


def start_gates_(ctx: ConversionContext, cfg: DsmoeConfig, layers: list[MoeMLP], stream: Tensor,
                 seq_len: int, resuming: bool) -> dict[str, Any]:
    """Set the gates where training starts (``gate_init``; not when ``resuming`` a checkpoint, which holds
    them); returns what to record of the start.

    Y is float32 from here to the end of training (training's masters are float32 whatever the working
    dtype), and the margin fit computes in float32, so that a bfloat16 conversion starts, and then trains,
    exactly as the float32 conversion of the same weights; ``harden_gates_`` casts Y back after training."""
    to_float32_(layer.router.proj.weight for layer in layers)
    if resuming:
        return {}
    if cfg.gate_init == "random":
        random_gates_(layers, cfg.gate_init_std, ctx.seed)
    if cfg.gate_init != "margin":
        return {}
    count = fit_windows(cfg, layers[0].router.proj.in_features, seq_len)
    windows = random_windows(stream, seq_len, count, torch.Generator().manual_seed(train_seed(ctx)))
    lowest = margin_gates_(ctx, layers, windows, cfg.gate_margin, cfg.batch_size)
    return {"gate_start_lowest_logit": lowest, "gate_start_fit_tokens": windows.numel()}


def harden_gates_(layers: list[MoeMLP]) -> None:
    """The gates in their layer's working dtype again (the expert weights')."""
    for layer in layers:
        weight = layer.router.proj.weight
        weight.data = weight.data.to(layer.experts[0].down.weight.dtype)


def train_seed(ctx: ConversionContext) -> int:
    """The seed of the training's batches (and of the windows ``gate_init=margin`` fits on)."""
    return ctx.seed + 1


def continue_training(ctx: ConversionContext, cfg: DsmoeConfig, seq_len: int) -> dict[str, Any]:
    """Train ``ctx.model`` (whose MLPs are DSMoE layers) in place; returns the training log summary."""
    adapter = ctx.adapter
    layers: list[MoeMLP] = [adapter.mlp_module(i) for i in range(adapter.num_layers)]
    stream = token_stream(ctx.calib, ctx.tokenizer)
    # free to change on resume: steps (the lr is constant, so more steps continue the same run), grad_accum
    # (the batches do not depend on it) and what happens outside training
    checkpointing = ctx.checkpointing("dsmoe", cfg, seq_len, free=("steps", "grad_accum", "analyses", "recompute"))
    resuming = checkpointing is not None and cfg.resume and latest_step(checkpointing.folder) is not None
    start = start_gates_(ctx, cfg, layers, stream, seq_len, resuming)
    wrappers = [DsmoeTrainingMLP(layer, cfg.variant) for layer in layers]
    gate_params = [layer.router.proj.weight for layer in layers]
    gate_ids = {id(p) for p in gate_params}
    weights = [p for p in ctx.model.parameters() if id(p) not in gate_ids]
    optimizer = torch.optim.AdamW([{"params": weights, "lr": cfg.lr}, {"params": gate_params, "lr": cfg.gate_lr}])

    def loss(model: nn.Module, batch: Tensor) -> dict[str, Tensor]:
        with sparsity_terms(wrappers) as terms:
            lm = lm_loss(model, batch)["loss"]
        sparsity = torch.stack(terms).mean()  # 1/(LN) sum_l sum_n; Eq. 19
        return {"loss": lm + cfg.sparsity_weight * sparsity, "lm": lm, "sparsity": sparsity}  # Eq. 17

    plan = TrainPlan(steps=cfg.steps, batch_size=cfg.batch_size, seq_len=seq_len, grad_accum=cfg.grad_accum,
                     checkpoint_every=cfg.checkpoint_every, recompute=cfg.recompute)
    for i, wrapper in enumerate(wrappers):
        adapter.replace_mlp_(i, wrapper)
    try:
        log = train(ctx.model, optimizer, stream, plan, seed=train_seed(ctx),
                    device=ctx.device, loss_fn=loss, checkpointing=checkpointing, progress=ctx.progress,
                    desc=f"dsmoe ({cfg.variant}): training")
    finally:
        for i, layer in enumerate(layers):  # harden: the sparse MoE layers again
            adapter.replace_mlp_(i, layer)
        harden_gates_(layers)
    return {**log.summary(), **start, "checkpoints": None if checkpointing is None else str(checkpointing.folder)}
