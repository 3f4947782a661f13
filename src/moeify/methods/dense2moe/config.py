"""Dense2MoE's options: the variant, how many layers to remove and fuse, experts per token, fine-tuning."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from moeify.options import (
    MethodOptions,
    OptionError,
    Training,
    method_config,
    option,
    require_at_most,
    require_multiple,
)

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from moeify.arch import DecoderAdapter

PAPER_LAYERS, PAPER_PRUNED = 24, 5  # §4.2: Qwen2.5-0.5B (24 layers), the top-5 redundant layers pruned, N = 6


@method_config
class Dense2moeConfig(MethodOptions):
    variant: Literal["lfuc", "prune_upcycle", "prune_only"] = option(
        "lfuc", "lfuc: Layer-Fusion Upcycling; prune_upcycle / prune_only: Table 5's baselines")
    prune_layers: int | None = option(None, "k of §4.1: decoder layers to remove in all (default: the paper's share, "
                                            "5 of Qwen2.5-0.5B's 24 layers, rounded: 1 of 5, 6 of 30)", low=1)
    search: bool = option(False, "§2.3's search with n* free: one span, the first in S_L order of any length whose "
                                 "MLP inputs are all within delta (prune_layers and spans then unset); default: "
                                 "n fixed (prune_layers, §4.1)")
    spans: int = option(1, "separate spans the removed layers form, each fused into its own kept layer (§4.1's "
                           "top-k redundant layers need not be contiguous); 1: one span l*+1 .. l*+k (§2.3)", low=1)
    delta: float = option(0.3, "fuse only MLP inputs at cosine distance 1 - s(h^(l*), h^(l*+k)) < delta",
                          low=0.0, high=2.0, low_open=True)
    num_copies: int = option(1, "N: copies of layer l*'s MLP among the experts", low=1)
    copies_per_pruned: int = option(1, "M: copies of each removed layer's MLP among the experts", low=1)
    top_k: int = option(1, "experts per token (§2.1; the paper uses top-1)", low=1)
    router_weighting: Literal["paper", "upcycle"] = option(
        "paper", "expert weight p_i as §2.1 writes it (paper), or p_i E/k (upcycle: an untrained router keeps "
                 "the layer at one MLP's scale)")
    calib_samples: int = option(8, "calibration windows (of seq_len tokens) for the similarity", low=1)
    steps: int = option(100, "fine-tuning optimizer steps (0: none)", low=0)
    lr: float = option(1e-3, "peak learning rate (AdamW, every parameter)", low=0.0, low_open=True)
    warmup: int = option(10, "linear warm-up steps, then cosine decay to lr / 10 (§3.1)", low=0)
    seq_len: int | None = option(None, "training and calibration window (default: min(1024, context))", low=2)
    batch_size: int = option(4, "sequences per optimizer step", low=1)
    grad_accum: int = option(1, "micro-batches per step (batch_size must be a multiple): memory for time", low=1)
    checkpoint_every: int = option(50, "steps between checkpoints in the work folder (0: at the end only)", low=0)
    resume: bool = option(False, "continue from the latest checkpoint in the work folder and finish")
    recompute: bool = option(True, "activation checkpointing while training: each decoder layer's activations are "
                                   "recomputed in the backward pass (far less memory, about 1/3 more compute)")

    def validate(self) -> None:
        require_multiple("batch_size", self.batch_size, "grad_accum", self.grad_accum)
        if self.search and (self.prune_layers is not None or self.spans != 1):
            raise OptionError("search=true chooses n* itself, in one span: leave prune_layers and spans unset")
        if self.steps and self.warmup > self.steps:  # steps=0 trains nothing: the warm-up does not apply
            raise OptionError(f"warmup={self.warmup} must be <= steps={self.steps}")
        if self.prune_layers is not None:
            require_at_most("spans", self.spans, self.prune_layers, "prune_layers (each span removes one or more)")
            self._check_top_k(self.prune_layers)

    def check(self, model_config: PreTrainedConfig) -> None:
        layers = model_config.num_hidden_layers
        if layers < 2:
            raise OptionError(f"dense2moe needs at least 2 decoder layers; the model has {layers}")
        prune = self.layers_to_prune(model_config)
        require_at_most("prune_layers", prune, layers - self.spans, "the layers less one kept layer per span")
        require_at_most("spans", self.spans, prune, "prune_layers (each span removes one or more)")
        self._check_top_k(prune)
        require_at_most("seq_len", self.seq_len, model_config.max_position_embeddings, "the model's context")

    def layers_to_prune(self, model_config: PreTrainedConfig) -> int:
        """``prune_layers``, or the paper's share of the model's layers (5 of 24), at least 1; with ``search``
        the shortest span the search may choose (1), which the checks of the experts per span need."""
        if self.search:
            return 1
        if self.prune_layers is not None:
            return self.prune_layers
        return max(1, round(model_config.num_hidden_layers * PAPER_PRUNED / PAPER_LAYERS))

    def _check_top_k(self, prune_layers: int) -> None:
        smallest = min(span_sizes(prune_layers, self.spans))
        experts = self.num_copies + self.copies_per_pruned * smallest
        if self.variant != "prune_only" and self.top_k > experts:
            raise OptionError(f"top_k={self.top_k} must be <= the experts of the smallest span, num_copies + "
                              f"copies_per_pruned x {smallest} removed layers = {experts}")

    def effective_seq_len(self, model_config: PreTrainedConfig) -> int:
        return self.seq_len or min(1024, model_config.max_position_embeddings)

    def calibration_windows(self, model_config: PreTrainedConfig) -> tuple[int, int]:
        return self.calib_samples, self.effective_seq_len(model_config)

    def training(self, model_config: PreTrainedConfig) -> Training | None:
        """The fine-tune of every weight after the fusion (none at ``steps=0``)."""
        if not self.steps:
            return None
        return Training(False, self.batch_size, self.grad_accum, self.effective_seq_len(model_config), self.recompute)


def span_sizes(prune_layers: int, spans: int) -> list[int]:
    """``prune_layers`` removed layers split into ``spans`` spans as evenly as possible, largest first."""
    return [prune_layers // spans + (i < prune_layers % spans) for i in range(spans)]


def match_budget(apr: float, adapter: DecoderAdapter) -> tuple[list[dict[str, Any]], str]:
    """At top-1 a removed layer takes its attention and one MLP's worth of compute with it (its MLP lives on as
    an expert run instead of, not beside, the kept one), so APR = (L - k) / L: remove k = round(L (1 - apr))
    layers, in one span (§2.3), else, where no span that long is similar enough (delta), in two or three."""
    layers = adapter.num_layers
    k = min(max(1, round(layers * (1 - apr))), layers - 1)
    tries = [{"prune_layers": k}] + [{"prune_layers": k, "spans": spans} for spans in (2, 3) if spans <= k]
    return tries, f"prune_layers={k} of {layers} (APR (L - k) / L = {(layers - k) / layers:.3f})"
