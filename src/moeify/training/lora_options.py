"""The light fine-tuning options (``lora.py``) that a method config inherits: a module of their own, free of
torch, so that a command validates them before it imports the training code."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from moeify.options import MethodOptions, OptionError, Training, option, require_multiple

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from moeify.training.loop import TrainPlan


@dataclasses.dataclass(frozen=True)
class LoraOptions(MethodOptions):
    """The fine-tuning options a method config inherits (its ``validate`` calls ``check_lora``)."""

    finetune_steps: int = option(0, "light fine-tuning steps on random windows (0 and finetune_samples=0: "
                                    "training-free)", low=0)
    finetune_samples: int = option(0, "fine-tune for one pass over this many disjoint windows instead of "
                                      "finetune_steps (the CMoE paper: 2048)", low=0)
    finetune_batch_size: int = option(4, "fine-tuning sequences per step", low=1)
    finetune_seq_len: int | None = option(None, "fine-tuning window length (default: the calibration seq_len)",
                                          low=2)
    grad_accum: int = option(1, "fine-tuning micro-batches per step (finetune_batch_size must be a multiple)", low=1)
    recompute: bool = option(True, "activation checkpointing while training: each decoder layer's activations are "
                                   "recomputed in the backward pass (far less memory, about 1/3 more compute)")
    lr: float = option(5.95e-5, "learning rate of the LoRA weights (CMoE paper)", low=0.0, low_open=True)
    lr_schedule: Literal["constant", "linear"] = option(
        "constant", "fine-tuning learning rates: constant, or linear decay from each one's initial rate to 0 over "
                    "the run (Hugging Face Trainer's default; the CMoE paper names only initial rates)")
    lora_rank: int = option(8, "LoRA rank", low=1)
    lora_alpha: float = option(32.0, "LoRA alpha", low=0.0, low_open=True)
    lora_dropout: float = option(0.0, "LoRA dropout (the CMoE reference code uses 0.1)", low=0.0, high=0.99)

    def check_lora(self) -> None:
        require_multiple("finetune_batch_size", self.finetune_batch_size, "grad_accum", self.grad_accum)
        if self.finetune_steps and self.finetune_samples:
            raise OptionError(f"finetune_steps={self.finetune_steps} and finetune_samples={self.finetune_samples} "
                              "are alternatives: set one of them")

    @property
    def finetunes(self) -> bool:
        return bool(self.finetune_steps or self.finetune_samples)

    def training(self, model_config: PreTrainedConfig) -> Training | None:
        """The fine-tune, in windows of ``finetune_seq_len`` (default: the calibration window)."""
        if not self.finetunes:
            return None
        seq_len = self.finetune_seq_len or self.calibration_windows(model_config)[1]
        return Training(True, self.finetune_batch_size, self.grad_accum, seq_len, self.recompute)

    def plan(self, calib_seq_len: int) -> TrainPlan:
        from moeify.training.loop import LinearDecay, TrainPlan, epoch

        shape = {"seq_len": self.finetune_seq_len or calib_seq_len, "grad_accum": self.grad_accum,
                 "recompute": self.recompute, "schedule": LinearDecay() if self.lr_schedule == "linear" else None}
        if self.finetune_samples:
            return epoch(self.finetune_samples, self.finetune_batch_size, **shape)
        return TrainPlan(steps=self.finetune_steps, batch_size=self.finetune_batch_size, **shape)
