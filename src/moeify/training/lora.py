"""Light LoRA fine-tuning of a converted model, merged back into its weights afterwards.

CMoE's recovery step (§V: LoRA rank 8, alpha 32, Adam betas (0.9, 0.95), one pass over 2,048 samples) and
the same budget given to a baseline (static pruning + LoRA), so that a fine-tuned method is compared with
a baseline that had the same chance to recover. LoRA wraps every linear layer except the output head and
the routers; a method adds its own trainable tensors (CMoE's score scale u) with their own learning rate,
and its own per-step hook (CMoE's load-balancing bias).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from moeify.moe.accounting import moe_layers
from moeify.options import OptionError, option, require_multiple
from moeify.training.loop import TrainLog, TrainPlan, epoch, train


@dataclasses.dataclass(frozen=True)
class LoraOptions:
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

    def plan(self, calib_seq_len: int) -> TrainPlan:
        shape = {"seq_len": self.finetune_seq_len or calib_seq_len, "grad_accum": self.grad_accum,
                 "recompute": self.recompute}
        if self.finetune_samples:
            return epoch(self.finetune_samples, self.finetune_batch_size, **shape)
        return TrainPlan(steps=self.finetune_steps, batch_size=self.finetune_batch_size, **shape)


def lora_targets(model: nn.Module) -> list[str]:
    """Full names of the linear layers LoRA wraps: all but the output head and the routers."""
    head = model.get_output_embeddings()
    routers = {id(m) for layer in moe_layers(model) if layer.router is not None for m in layer.router.modules()}
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not head and id(m) not in routers]


@contextmanager
def _trainable(tensors: list[Tensor]) -> Iterator[None]:
    """The method's own tensors learn beside LoRA (peft freezes every base parameter)."""
    for t in tensors:
        t.requires_grad_(True)
    try:
        yield
    finally:
        for t in tensors:
            t.requires_grad_(False)


def lora_finetune(model: PreTrainedModel, options: LoraOptions, stream: Tensor, plan: TrainPlan, *, seed: int,
                  device: torch.device, progress: bool, desc: str, extra: Sequence[Tensor] = (),
                  extra_lr: float = 0.0, after_step: Callable[[], None] | None = None) -> tuple[PreTrainedModel, TrainLog]:
    """Fine-tune ``model`` with LoRA on ``stream`` and return (the model with LoRA merged, the log)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=options.lora_rank, lora_alpha=options.lora_alpha, lora_dropout=options.lora_dropout,
                      target_modules=lora_targets(model))
    peft_model = get_peft_model(model, lora)
    with _trainable(list(extra)):
        lora_params = [p for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" in n]
        groups: list[dict[str, Any]] = [{"params": lora_params, "lr": options.lr}]
        if extra:
            groups.append({"params": list(extra), "lr": extra_lr})
        optimizer = torch.optim.Adam(groups, betas=(0.9, 0.95))
        log = train(peft_model, optimizer, stream, plan, seed=seed, device=device, after_step=after_step,
                    progress=progress, desc=desc, network=model)
    return peft_model.merge_and_unload(), log
