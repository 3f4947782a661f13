"""ToMoE's objective (Eq. 10) and its training run on the shared loop, the model's weights frozen.

Per step: E_all = HN(z); the teacher logits come from the same model with every mask off (in-place
distillation, Listing 1); the student pass routes and masks; then

    loss = KL(teacher || student) + alpha R_P + beta R_U + gamma R_L                        (Eq. 10)

- R_P (Eq. 8): f_reg(T(d_MoE), p T_total), f_reg(x, y) = log(max(x, y) / min(x, y)); T counts the
  projections a token uses: per layer the MLP at its widest expert, max_i sum s_e^i (s_e from Eq. 11 with
  its own Gumbel sample), and, with attention, Q/K at the kept width sum s_0' and V/O at the mean over
  tokens of sum s_t (the per-token width; K after training is its rounded mean, §3.3), or with head
  pruning the kept key/value heads' projections (each with its query heads). T_total counts
  the dense projections (the accounting of ``moe.accounting``), so p is the activated-parameter ratio.
- R_U (Eq. 7): mean over the union terms of f_reg(sum u / |u|, 1); MLP unions over the N experts' s_e
  (Eq. 16), attention unions over the batch's tokens' s_t (Eq. 6). The static s_0 has no union to grow.
- R_L (Eq. 9): N sum_i F_i P_i per MLP layer, F from the hard decisions, P from the Gumbel-softmax
  probabilities, averaged over layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from moeify.calibration.data import token_stream
from moeify.methods.base import ConversionContext
from moeify.methods.tomoe.config import TomoeConfig
from moeify.methods.tomoe.modules import (
    AttentionMasks,
    HyperNetwork,
    LayerModules,
    MaskedMLP,
    st_gumbel_sigmoid,
)
from moeify.moe.attention.head_dim import attention_geometry, head_dim_costs, head_group_costs
from moeify.training.distributed import gathered
from moeify.training.loop import TrainPlan, train
from moeify.training.losses import distillation_kl, final_hidden_states, lm_loss


def f_reg(x: Tensor, y: Tensor | float) -> Tensor:
    """log(max(x, y) / min(x, y)) (§3.4)."""
    y = torch.as_tensor(y, dtype=x.dtype)
    return torch.log(torch.maximum(x, y) / torch.minimum(x, y))


class TomoeModules(nn.Module):
    """Theta: the hypernetwork and every layer's modules (what the optimizer and checkpoints hold)."""

    def __init__(self, ctx: ConversionContext, cfg: TomoeConfig) -> None:
        super().__init__()
        adapter = ctx.adapter
        self.hypernet = HyperNetwork(adapter.num_layers, cfg.num_experts, ctx.seed)
        self.layers = nn.ModuleList(
            LayerModules(adapter.mlp(i).hidden_size, adapter.mlp(i).intermediate_size, cfg.num_experts,
                         adapter.attention_module(i).head_dim if cfg.attention == "on" else None,
                         vo_routing=cfg.vo_routing, local=cfg.embeddings == "local",
                         kv_heads=attention_geometry(adapter, i)[2] if cfg.attention == "heads" else None)
            for i in range(adapter.num_layers))


class MaskedModel:
    """The frozen model with ToMoE's training masks in place (``MaskedMLP`` + ``AttentionMasks``)."""

    def __init__(self, ctx: ConversionContext, theta: TomoeModules, cfg: TomoeConfig) -> None:
        self.ctx, self.theta, self.cfg = ctx, theta, cfg
        adapter = ctx.adapter
        self.dense = [adapter.mlp_module(i) for i in range(adapter.num_layers)]
        self.weights = [adapter.mlp(i) for i in range(adapter.num_layers)]
        self.mlps = [MaskedMLP(w, m, cfg.tau, cfg.mask_noise, layer=i)
                     for i, (w, m) in enumerate(zip(self.weights, theta.layers))]
        self.attention = []
        if cfg.attention in ("on", "heads"):
            self.attention = [AttentionMasks(adapter.attention_module(i), adapter.attention_projections(i), m,
                                             cfg.tau, cfg.mask_noise, layer=i) for i, m in enumerate(theta.layers)]
        self.total = sum(adapter.attention_params(i) + w.num_params for i, w in enumerate(self.weights))
        for i, mlp in enumerate(self.mlps):
            adapter.replace_mlp_(i, mlp)
        self.restored = False

    def restore(self) -> None:
        """The dense model again, no hooks (once: later calls do nothing)."""
        if self.restored:
            return
        for i, module in enumerate(self.dense):
            self.ctx.adapter.replace_mlp_(i, module)
        for masks in self.attention:
            masks.remove()
        self.restored = True

    def set_embeddings(self, embeddings: Tensor) -> None:
        for i, mlp in enumerate(self.mlps):
            mlp.embeddings = embeddings[i]
        for i, masks in enumerate(self.attention):
            masks.embedding = self.theta.layers[i].attention_embedding(embeddings[i])

    def set_enabled(self, on: bool) -> None:
        for part in (*self.mlps, *self.attention):
            part.enabled = on

    @contextmanager
    def recording(self) -> Iterator[None]:
        """The masks keep the token statistics of the passes inside the block for ``regularisers``, and
        drop them on leaving it (what the backward pass recomputes is not kept: ``modules``)."""
        parts = (*self.mlps, *self.attention)
        for part in parts:
            part.recording = True
        try:
            yield
        finally:
            for part in parts:
                part.recording = False
            for mlp in self.mlps:
                mlp.hard = mlp.soft = None
            for masks in self.attention:
                masks.qk_kept = masks.tokens_kept = masks.heads_kept = None

    def regularisers(self, embeddings: Tensor) -> dict[str, Tensor]:
        """R_P, R_U, R_L of the student pass recorded (``recording``), and the activated ratio T / T_total
        it implies. Their token statistics (R_L's F and P, the attention widths and unions) are those of the
        step's whole micro-batch, every process's share of it (``batch_statistics``), so a run does not
        depend on how many processes share the batch."""
        adapter = self.ctx.adapter
        n = self.cfg.num_experts
        routed = [(mlp.hard.reshape(-1, n), mlp.soft.reshape(-1, n)) for mlp in self.mlps]
        per_token = [masks for masks in self.attention if masks.tokens_kept is not None]  # not head pruning
        counts, shares, widths, kept = batch_statistics(
            torch.tensor([float(len(routed[0][0]))], device=embeddings.device),
            torch.stack([torch.stack([hard.sum(0), soft.sum(0)]) for hard, soft in routed]),
            [masks.tokens_kept.sum(dim=1).sum() for masks in per_token],
            [torch.prod(1 - masks.tokens_kept, dim=0) for masks in per_token])
        tokens = counts[0]
        active, unions, balance = [], [], []
        for i, (mlp, weights) in enumerate(zip(self.mlps, self.weights)):
            s_e = st_gumbel_sigmoid(mlp.modules_.proj_mlp(embeddings[i]), self.cfg.tau,
                                    key=("expert_mask", i), per_window=False)             # Eq. 11: (N, d_mid)
            active.append(s_e.sum(dim=1).max() * weights.params_per_neuron())         # widest expert
            unions.append(f_reg((1 - torch.prod(1 - s_e, dim=0)).mean(), 1.0))      # Eq. 16, 7
            f, p = shares[i] / tokens                                                # F_i, P_i over the tokens
            balance.append(n * (f * p).sum())                                          # Eq. 9
        for i, masks in enumerate(self.attention):
            if masks.heads_kept is not None:  # head pruning: whole key/value heads with their query heads
                per_group, fixed = head_group_costs(adapter, i)
                active.append(masks.heads_kept.sum() * per_group + fixed)
                continue
            per_qk, per_vo, fixed = head_dim_costs(adapter, i)
            active.append(masks.qk_kept.sum() * per_qk + widths[i] / tokens * per_vo + fixed)
            if self.cfg.vo_routing:  # a static V/O mask, like s_0, has no union to grow
                unions.append(f_reg((1 - kept[i]).mean(), 1.0))                        # Eq. 6-7
        if not self.attention:
            active.append(torch.tensor(float(sum(adapter.attention_params(i) for i in range(adapter.num_layers)))))
        total_active = torch.stack(active).sum()
        return {"r_p": f_reg(total_active, self.cfg.active_ratio * self.total),                # Eq. 8
                "r_u": torch.stack(unions).mean(), "r_l": torch.stack(balance).mean(),
                "ratio": (total_active / self.total).detach()}


def batch_statistics(counts: Tensor, shares: Tensor, widths: list[Tensor],
                     kept: list[Tensor]) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor]]:
    """Token statistics of the whole micro-batch from this process's share: ``counts``, ``shares`` (the
    per-expert sums of the hard and soft routing, (layers, 2, N)) and ``widths`` (per attention layer, the
    kept width summed over the tokens) summed over the processes; ``kept`` (per attention layer, the
    product over the tokens of 1 - s_t) multiplied over them. Differentiable (``gathered``)."""
    sums = [counts, shares.flatten(), *(w.reshape(1) for w in widths)]
    sizes = [t.numel() for t in sums]
    every = gathered(torch.cat([*sums, *kept]))
    summed, products = every[:, :sum(sizes)].sum(0), every[:, sum(sizes):].prod(0)
    counts, flat_shares, flat_widths = summed.split(sizes[:2] + [len(widths)])
    return (counts, flat_shares.view_as(shares), list(flat_widths),
            list(products.split([k.numel() for k in kept])))


@contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """The model's trainable parameters frozen inside the block (ToMoE keeps the weights), thawed after."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


@contextmanager
def learned_masks(ctx: ConversionContext, cfg: TomoeConfig,
                  seq_len: int) -> Iterator[tuple[TomoeModules, MaskedModel, dict[str, Any]]]:
    """Train Theta with the model frozen; inside the block: Theta, the masked model (masks in place) and
    the training log (per-step KD loss, R_P, R_U, R_L, activated ratio). The dense model comes back on
    leaving the block, also when an exception escapes it (unless the block restored it itself)."""
    masked = None
    try:
        # Theta's init and the Gumbel noise from the seed; the caller's CPU and work-device RNGs untouched
        with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
            torch.manual_seed(ctx.seed)
            theta = TomoeModules(ctx, cfg).to(ctx.device)
            with frozen(ctx.model):
                masked = MaskedModel(ctx, theta, cfg)
                log = _learn(ctx, cfg, seq_len, theta, masked)
        yield theta, masked, log
    finally:
        if masked is not None:
            masked.restore()


def _learn(ctx: ConversionContext, cfg: TomoeConfig, seq_len: int, theta: TomoeModules,
           masked: MaskedModel) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(theta.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def loss(_theta: nn.Module, batch: Tensor) -> dict[str, Tensor]:
        embeddings = theta.hypernet()
        masked.set_embeddings(embeddings)
        if cfg.objective == "kd":
            with torch.no_grad():
                masked.set_enabled(False)
                teacher = final_hidden_states(ctx.model, batch)
                masked.set_enabled(True)
        with masked.recording():
            if cfg.objective == "kd":  # KL(teacher || student)
                task = distillation_kl(ctx.model, teacher, final_hidden_states(ctx.model, batch))
            else:
                task = lm_loss(ctx.model, batch)["loss"]
            reg = masked.regularisers(embeddings)
        total = task + cfg.alpha * reg["r_p"] + cfg.beta * reg["r_u"] + cfg.gamma * reg["r_l"]  # Eq. 10
        return {"loss": total, cfg.objective: task, **reg}

    plan = TrainPlan(steps=cfg.steps, batch_size=cfg.batch_size, seq_len=seq_len, grad_accum=cfg.grad_accum,
                     checkpoint_every=cfg.checkpoint_every, recompute=cfg.recompute)
    # steps may grow on resume: the lr is constant
    checkpointing = ctx.checkpointing("tomoe", cfg, seq_len, free=("steps", "grad_accum", "recompute"))
    log = train(theta, optimizer, token_stream(ctx.calib, ctx.tokenizer), plan, seed=ctx.seed + 1,
                device=ctx.device, loss_fn=loss, checkpointing=checkpointing, progress=ctx.progress,
                desc="tomoe: learning experts and routers", network=ctx.model, replicated=theta.parameters())
    theta.eval()
    return {**log.summary(), "curves": log.as_dict()["parts"],
            "checkpoints": None if checkpointing is None else str(checkpointing.folder)}
