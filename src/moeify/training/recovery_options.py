"""The recovery's options (``recovery.py``) and the parts it can train (``parts.py``): a module of their own,
free of torch, so that a command validates them before it imports the training code."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING, Any, Literal

from moeify.options import OptionError, method_config, option, require_at_most, require_multiple

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from moeify.training.loop import LinearDecay, TrainPlan, WarmupConstant

PARTS = ("routers", "experts", "shared", "attention", "norms")


def parse_parts(text: str) -> tuple[str, ...]:
    """``"experts,shared"`` -> ``("experts", "shared")``; unknown or no names raise ``ValueError``."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise ValueError(f"recover_parts={text!r}: {'unknown ' + ', '.join(unknown) if unknown else 'no part'}; "
                         f"choose a comma-separated subset of {', '.join(PARTS)}")
    return names


@method_config
class RecoveryOptions:
    """The recovery stage's options (``--set recover_*=...`` on convert, ``moeify recover``'s ``--set``)."""

    recover_tokens: int = option(0, "training tokens of the recovery after the method's own training (0: none)",
                                 low=0)
    recover_lr: float = option(3e-4, "AdamW learning rate of the trained parts (after the warm-up, the start of "
                                     "recover_lr_schedule); 3e-4: below 1e-3 in held-out KL on SmolLM2 "
                                     "(benchmarks/bench_recovery.py)",
                               low=0.0, low_open=True)
    recover_parts: str = option(",".join(PARTS), f"what trains, comma-separated: {', '.join(PARTS)} (embeddings "
                                                 "and the output head stay frozen)")
    recover_lora_rank: int = option(0, "0: the parts' weights train; r > 0: LoRA adapters of rank r on their "
                                       "projections (experts, shared, attention), merged afterwards; routers and "
                                       "norms train directly", low=0)
    recover_lora_alpha: float = option(32.0, "LoRA alpha (scale alpha / r)", low=0.0, low_open=True)
    recover_lm_share: float = option(0.5, "s: the loss is (1 - s) KL(teacher || student) + s LM (0: distillation "
                                          "only; 1: the LM loss alone, with no teacher pass); 0.5: for CMoE and "
                                          "static pruning of SmolLM2 at 200,000 tokens, below either alone on text "
                                          "like the training text, below the LM loss alone on other text, level "
                                          "with distillation over both (benchmarks/compare_recovery.py)",
                                     low=0.0, high=1.0)
    recover_top_k: int = option(64, "teacher tokens kept per position: the top k plus one bucket for the rest (what "
                                    "a cache holds: no teacher pass, no teacher logits per step); 0: the whole "
                                    "vocabulary, the teacher run alongside", low=0)
    recover_teacher: Literal["auto", "live", "cache"] = option(
        "auto", "live: the dense model runs beside the student; cache: its top-k targets written once to the "
                "work folder and read back (needs recover_top_k > 0); auto: cache where the windows repeat or a "
                "cache of them exists, else live")
    recover_seq_len: int | None = option(None, "training window (default: min(512, model context))", low=2)
    recover_batch_size: int | None = option(
        None, "windows per optimizer step (default: one per process, so 1 without torchrun): at a budget in tokens, "
              "more and smaller steps recover further (static pruning of SmolLM2 at 200,000 tokens: 1 below 4, "
              "benchmarks/bench_recovery.py)", low=1)
    recover_grad_accum: int = option(1, "micro-batches per step (recover_batch_size must be a multiple)", low=1)
    recover_warmup: int = option(0, "linear warm-up steps before the learning rate of recover_lr_schedule", low=0)
    recover_lr_schedule: Literal["constant", "linear"] = option(
        "constant", "the learning rate after the warm-up: constant (the model after n tokens of a longer run is a "
                    "run of n tokens, so one run measures a curve of budgets) or linear (falling to 0 at the "
                    "last step: a curve's earlier points are not runs of their own budget; at the end of one budget "
                    "below the constant rates tried, for CMoE with attention thresholds on SmolLM2 over 200,000 "
                    "tokens, benchmarks/compare_recovery.py)")
    recover_weight_decay: float = option(0.0, "AdamW weight decay", low=0.0)
    recover_checkpoint_every: int = option(25, "steps between checkpoints in the work folder (0: at the end only)",
                                           low=0)
    recover_resume: bool = option(False, "continue the recovery from the latest checkpoint in the work folder")
    recover_recompute: bool = option(True, "activation checkpointing while training: each decoder layer's "
                                           "activations are recomputed in the backward pass (far less memory, "
                                           "about 1/3 more compute)")

    def validate(self) -> None:
        require_multiple("recover_batch_size", self.batch_size, "recover_grad_accum", self.recover_grad_accum)
        try:
            parse_parts(self.recover_parts)
        except ValueError as error:
            raise OptionError(str(error)) from None
        if self.recover_teacher == "cache" and not self.recover_top_k:
            raise OptionError("recover_teacher=cache needs recover_top_k > 0 (a cache holds the top-k tokens)")

    def check(self, model_config: PreTrainedConfig) -> None:
        require_at_most("recover_seq_len", self.recover_seq_len, model_config.max_position_embeddings,
                        "the model's context")
        require_at_most("recover_top_k", self.recover_top_k, model_config.vocab_size - 1,
                        "the vocabulary less one (the bucket of the rest)")

    @property
    def enabled(self) -> bool:
        return self.recover_tokens > 0

    @property
    def batch_size(self) -> int:
        """``recover_batch_size``, or one window for each process that torchrun started."""
        return self.recover_batch_size or int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def parts(self) -> tuple[str, ...]:
        return parse_parts(self.recover_parts)

    def seq_len(self, model_config: PreTrainedConfig) -> int:
        return self.recover_seq_len or min(512, model_config.max_position_embeddings)

    def schedule(self) -> LinearDecay | WarmupConstant | None:
        """The learning-rate schedule of ``recover_warmup`` and ``recover_lr_schedule`` (None: constant)."""
        from moeify.training.loop import LinearDecay, WarmupConstant

        if self.recover_lr_schedule == "linear":
            return LinearDecay(self.recover_warmup)
        return WarmupConstant(self.recover_warmup) if self.recover_warmup else None

    def plan(self, seq_len: int, wrap: bool) -> TrainPlan:
        from moeify.training.loop import TrainPlan

        samples = math.ceil(self.recover_tokens / seq_len)
        return TrainPlan(steps=math.ceil(samples / self.batch_size), batch_size=self.batch_size,
                         seq_len=seq_len, grad_accum=self.recover_grad_accum,
                         checkpoint_every=self.recover_checkpoint_every,
                         schedule=self.schedule(),
                         recompute=self.recover_recompute, epoch_samples=samples, wrap=wrap)


RECOVERY_KEYS = frozenset(f.name for f in dataclasses.fields(RecoveryOptions))


def split_recovery_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the method's options, the recovery's) of one ``--set`` dictionary."""
    return ({k: v for k, v in options.items() if k not in RECOVERY_KEYS},
            {k: v for k, v in options.items() if k in RECOVERY_KEYS})
