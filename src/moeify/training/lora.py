"""Light LoRA fine-tuning of a converted model, merged back into its weights afterwards.

CMoE's recovery step (§V: LoRA rank 8, alpha 32, Adam betas (0.9, 0.95), one pass over 2,048 samples) and
the same budget given to a baseline (static pruning + LoRA), so that a fine-tuned method is compared with
a baseline that had the same chance to recover. LoRA wraps every linear layer except the output head and
the routers; a method adds its own trainable tensors (CMoE's score scale u) with their own learning rate,
and its own per-step hook (CMoE's load-balancing bias).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from moeify.moe.accounting import moe_layers
from moeify.training.loop import TrainLog, TrainPlan, train
from moeify.training.lora_options import LoraOptions


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
