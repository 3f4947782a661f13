"""The one training loop of the methods that train (CMoE's light fine-tune, DSMoE's continued training).

Each optimizer step draws ``batch_size`` windows of ``seq_len`` tokens from the training stream (random
windows drawn with replacement, or, with ``epoch_samples``, the next ones of a fixed shuffled set of
disjoint windows: one pass over them, as CMoE's fine-tune does) and splits them into ``grad_accum``
micro-batches whose gradients add up (each micro-batch loss is weighted by its share of the windows, so
a step equals one step on the whole batch, and the batches do not depend on ``grad_accum``: it trades
memory for time only). Under torchrun the batch is first shared among the processes and their gradients
summed (``distributed.py``; with FSDP the model, its gradients and the optimizer state are sharded over
the processes while training, ``sharding.py``); the result does not depend on the process count, nor does
noise that a loss draws (``noise.py``: each window's own, whatever process or micro-batch holds it). Then
the optimizer steps and ``after_step`` runs (e.g. CMoE's load-balancing bias update). The loss is
pluggable (``loss_fn`` returns the total to minimise under ``"loss"`` and any parts to log).

A model held in bfloat16 or float16 trains float32 master weights (``precision.py``): the optimizer updates
float32 copies of what it trains, which return to the working dtype at the end; the forward runs under
autocast where low-precision weights stay frozen, in float32 where every weight trains.

Deterministic: the windows come from one ``torch.Generator`` seeded with ``seed``. With a
``Checkpointing``, a checkpoint (model, optimizer, generator and RNG states, the log so far; see
``checkpoint.py``) is written every ``checkpoint_every`` steps and after the last one; ``resume=True``
restores the latest one and continues, so a run killed and resumed ends with the same weights as an
uninterrupted one. The learning rate is constant unless the plan has a ``schedule`` (a pure function of
the step, so there is no scheduler state to restore either); a constant rate makes resuming with more
``steps`` the same as having asked for them at first, a schedule depends on ``steps`` (keep them in the
fingerprint).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from moeify.interrupt import raise_if_interrupted
from moeify.offload.allocator import fix_mmap_threshold
from moeify.runtime.moe import drop_inference_copies
from moeify.training import distributed
from moeify.training.checkpoint import latest_step, load_checkpoint, save_checkpoint
from moeify.training.distributed import all_reduce_gradients_, all_reduce_sum_, barrier, is_main, rank, world_size
from moeify.training.losses import lm_loss
from moeify.training.noise import step_noise
from moeify.training.precision import Precision, mixed_precision
from moeify.training.recompute import recomputed_layers
from moeify.training.sharding import sharded

LossFn = Callable[[nn.Module, Tensor], dict[str, Tensor]]


def warmup_cosine(step: int, steps: int, warmup: int, final_ratio: float) -> float:
    """Learning-rate factor of optimizer step ``step`` (0-based) of ``steps``: linear warm-up, (step + 1) /
    warmup, over the first ``warmup`` steps, then a cosine decay from 1 to ``final_ratio`` at the last step
    (Dense2MoE §3.1: warm-up from 0 to 1e-4, cosine decay to 1e-5)."""
    if step < warmup:
        return (step + 1) / warmup
    span = steps - 1 - warmup
    progress = 1.0 if span <= 0 else (step - warmup) / span
    return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class WarmupCosine:
    """A ``TrainPlan.schedule``: ``warmup_cosine`` with these parameters, times each group's base rate."""

    warmup: int
    final_ratio: float = 0.1

    def factor(self, step: int, steps: int) -> float:
        return warmup_cosine(step, steps, self.warmup, self.final_ratio)


@dataclass(frozen=True)
class WarmupConstant:
    """A ``TrainPlan.schedule``: linear warm-up, (step + 1) / warmup, then the base rate: every step after
    the warm-up learns as any other, so a longer run's first n steps are a run of n steps."""

    warmup: int

    def factor(self, step: int, steps: int) -> float:
        return min(1.0, (step + 1) / self.warmup)


@dataclass(frozen=True)
class LinearDecay:
    """A ``TrainPlan.schedule``: linear warm-up over ``warmup`` steps, then the base rate falling linearly
    towards 0 at the last step (Hugging Face Trainer's default schedule, whose default warm-up is none)."""

    warmup: int = 0

    def factor(self, step: int, steps: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        return (steps - step) / (steps - self.warmup)


def earlier_seconds(details: Any) -> float:
    """The training time of runs before a resume, summed over every ``TrainLog.summary`` in a method's
    details (its stages may each have resumed), so that a resumed conversion records its whole time."""
    if isinstance(details, dict):
        return float(details.get("earlier_seconds") or 0.0) + sum(earlier_seconds(v) for k, v in details.items()
                                                                   if k != "earlier_seconds")
    if isinstance(details, list):
        return sum(earlier_seconds(v) for v in details)
    return 0.0


def scale_lr_(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Every group's rate := factor x its base rate, kept as ``initial_lr`` (as torch's schedulers do), which
    the optimizer state, hence a checkpoint, carries."""
    for group in optimizer.param_groups:
        group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor


@dataclass(frozen=True)
class TrainPlan:
    """``steps`` optimizer steps on ``batch_size`` windows of ``seq_len`` tokens, split into ``grad_accum``
    micro-batches; with checkpointing, a checkpoint every ``checkpoint_every`` steps (0: only the last);
    ``schedule``: the learning-rate schedule (None: constant); ``recompute``: activation checkpointing of
    the decoder layers (``recompute.py``); ``epoch_samples``: > 0 trains on that many disjoint windows, each
    seen once, in ``steps = ceil(epoch_samples / batch_size)`` steps (``epoch``); ``wrap``: or, where the
    text holds fewer, in passes over them (``epoch_windows``)."""

    steps: int
    batch_size: int
    seq_len: int
    grad_accum: int = 1
    checkpoint_every: int = 0
    schedule: WarmupCosine | WarmupConstant | LinearDecay | None = None
    recompute: bool = True
    epoch_samples: int = 0
    wrap: bool = False

    def __post_init__(self) -> None:
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size={self.batch_size} must be a multiple of grad_accum={self.grad_accum}")
        if self.epoch_samples and self.steps != math.ceil(self.epoch_samples / self.batch_size):
            raise ValueError(f"steps={self.steps} must be ceil(epoch_samples / batch_size) = "
                             f"{math.ceil(self.epoch_samples / self.batch_size)}")
        if self.schedule is not None and self.schedule.warmup > self.steps:
            raise ValueError(f"warmup={self.schedule.warmup} must be <= steps={self.steps}")


@dataclass(frozen=True)
class Checkpointing:
    """Where checkpoints go, whether to continue the latest one, and the run's fingerprint (the options
    a resumed run must share with the checkpointed one)."""

    folder: Path
    fingerprint: dict[str, Any]
    resume: bool = False
    resume_option: str = "resume"  # the option that asks for ``resume``, for the error that names it


@dataclass
class TrainLog:
    """Per-step losses and parts; ``seconds``: wall time of the steps this process ran; ``earlier_seconds``:
    that of the runs before a resume, up to the checkpoint it continues (a checkpoint holds the sum, so a
    run resumed twice counts every part); ``trainable_params``: the parameters the optimizer updates."""

    losses: list[float] = field(default_factory=list)
    parts: dict[str, list[float]] = field(default_factory=dict)  # every logged part, per step
    resumed_from: int | None = None
    seconds: float = 0.0
    earlier_seconds: float = 0.0
    trainable_params: int = 0

    def append(self, values: dict[str, float]) -> None:
        self.losses.append(values["loss"])
        for name, value in values.items():
            if name != "loss":
                self.parts.setdefault(name, []).append(value)

    def as_dict(self) -> dict[str, Any]:
        return {"losses": self.losses, "parts": self.parts, "seconds": self.earlier_seconds + self.seconds}

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": len(self.losses), "first_loss": self.losses[0], "last_loss": self.losses[-1],
                               "losses": [round(x, 5) for x in self.losses], "resumed_from": self.resumed_from,
                               "seconds": round(self.seconds, 3), "earlier_seconds": round(self.earlier_seconds, 3),
                               "trainable_params": self.trainable_params}
        for name, values in self.parts.items():
            out[f"first_{name}"], out[f"last_{name}"] = values[0], values[-1]
        return out


def random_windows(stream: Tensor, seq_len: int, batch_size: int, generator: torch.Generator) -> Tensor:
    """A batch of ``batch_size`` random windows of ``seq_len`` tokens from ``stream``: (batch, seq_len)."""
    if len(stream) <= seq_len:
        raise ValueError(f"training text has {len(stream)} tokens, fewer than seq_len={seq_len} + 1")
    starts = torch.randint(0, len(stream) - seq_len, (batch_size,), generator=generator)
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()]).long()


def epoch(samples: int, batch_size: int, **plan: Any) -> TrainPlan:
    """The plan of one pass over ``samples`` disjoint windows, ``batch_size`` per step (the last step may
    be smaller)."""
    return TrainPlan(steps=math.ceil(samples / batch_size), batch_size=batch_size, epoch_samples=samples, **plan)


def epoch_windows(stream: Tensor, seq_len: int, samples: int, seed: int, *, wrap: bool = False) -> Tensor:
    """``samples`` disjoint windows of ``seq_len`` tokens from ``stream`` in a seeded random order:
    (samples, seq_len). The order depends on ``seed`` alone, so a resumed run sees the same epoch, and the
    windows of fewer samples are the first ones of more. ``wrap``: more samples than the text holds make
    further passes over the same windows, each in its own order (else an error)."""
    slots = len(stream) // seq_len
    if slots < samples and not wrap or not slots:
        raise ValueError(f"training text has {len(stream)} tokens: {slots} windows of seq_len={seq_len}, "
                         f"fewer than the {samples} samples asked for")
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.cat([torch.randperm(slots, generator=generator) for _ in range(math.ceil(samples / slots))])
    return torch.stack([stream[s * seq_len:(s + 1) * seq_len] for s in chosen[:samples].tolist()]).long()


def _start(model: nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator, precision: Precision,
           checkpointing: Checkpointing | None, steps: int) -> tuple[int, TrainLog]:
    """(first step to run, log so far): 0 and an empty log, or what the latest checkpoint holds."""
    if checkpointing is None:
        return 0, TrainLog()
    if not checkpointing.resume:
        existing = latest_step(checkpointing.folder)
        if existing is not None:
            raise FileExistsError(f"{str(checkpointing.folder)!r} holds a checkpoint at step {existing}; continue it "
                                  f"with {checkpointing.resume_option}=true, or delete the folder to start again")
        return 0, TrainLog()
    resumed = load_checkpoint(checkpointing.folder, model, optimizer, generator, checkpointing.fingerprint)
    precision.load_state(resumed.scaler)
    if resumed.step > steps:
        raise ValueError(f"the checkpoint is at step {resumed.step}, beyond steps={steps}")
    log = TrainLog(resumed.log["losses"], resumed.log["parts"], resumed_from=resumed.step,
                   earlier_seconds=resumed.log.get("seconds", 0.0))
    return resumed.step, log


def _gradients(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Tensor, grad_accum: int,
               loss_fn: LossFn, precision: Precision, seed: int, step: int) -> dict[str, float]:
    """One step's gradients: this process's share of ``batch``, in ``grad_accum`` micro-batches, each loss
    weighted by its share of the whole batch's windows, then summed over the processes; returns the loss
    parts (of the whole batch). Noise drawn in a micro-batch is its windows' own (``noise.py``)."""
    optimizer.zero_grad(set_to_none=True)
    rows = torch.arange(len(batch)).tensor_split(world_size())[rank()]
    sums: dict[str, float] = {}
    for windows in (w for w in rows.tensor_split(grad_accum) if len(w)):
        weight = len(windows) / len(batch)
        with step_noise(seed, step, windows.tolist()):
            with precision.autocast():
                parts = loss_fn(model, batch[windows].to(precision.device))
            precision.backward(parts["loss"] * weight)
        for name, value in parts.items():
            sums[name] = sums.get(name, 0.0) + float(value.detach()) * weight
    all_reduce_gradients_(model)
    totals = torch.tensor(list(sums.values()), dtype=torch.float64)
    all_reduce_sum_([totals])
    return dict(zip(sums, totals.tolist()))


def _check_shares(plan: TrainPlan) -> None:
    """Every process must get windows in each step, and as many micro-batches as the others (a loss may
    gather statistics of a whole micro-batch across the processes)."""
    smallest = plan.epoch_samples - (plan.steps - 1) * plan.batch_size if plan.epoch_samples else plan.batch_size
    if smallest < world_size():
        raise ValueError(f"a step of {smallest} windows cannot be shared among {world_size()} processes: "
                         "use fewer processes or a larger batch_size")
    if world_size() > 1 and smallest // world_size() < plan.grad_accum:
        raise ValueError(f"a step of {smallest} windows shared among {world_size()} processes leaves fewer than "
                         f"grad_accum={plan.grad_accum} windows to a process: lower grad_accum")


def train(model: nn.Module, optimizer: torch.optim.Optimizer, stream: Tensor, plan: TrainPlan, *, seed: int,
          device: torch.device, loss_fn: LossFn = lm_loss, checkpointing: Checkpointing | None = None,
          after_step: Callable[[], None] | None = None, progress: bool = True, desc: str = "training",
          network: nn.Module | None = None, replicated: Iterable[nn.Parameter] = ()) -> TrainLog:
    """Train ``model`` for ``plan.steps`` optimizer steps (see the module docstring); returns the loss log.

    ``network``: the causal LM whose decoder layers ``plan.recompute`` checkpoints, when ``model`` is not
    it (ToMoE trains its own modules; an adapter wrapper hides the layers). ``replicated``: parameters
    inside the decoder layers that the loss also uses outside them, which FSDP must leave whole
    (``sharding.py``)."""
    fix_mmap_threshold()  # freed activations go back to the system instead of fragmenting the heap
    _check_shares(plan)
    generator = torch.Generator().manual_seed(seed)
    network = model if network is None else network
    drop_inference_copies(network)  # training runs (and changes) the experts' own weights
    model.train()
    try:
        # Sharded, the masters are made a layer at a time as it is sharded, and a checkpoint is restored
        # into the shards, so no process ever holds the whole training state.
        shard = distributed.fsdp()
        with (mixed_precision(network, optimizer, device, upcast=not shard) as precision,
              recomputed_layers(network, plan.recompute),
              sharded(network, optimizer, device, replicated, enabled=shard) as shards):
            start, log = _start(model, optimizer, generator, precision, checkpointing, plan.steps)
            log.trainable_params = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
            windows = (epoch_windows(stream, plan.seq_len, plan.epoch_samples, seed, wrap=plan.wrap)
                       if plan.epoch_samples else None)
            began = time.perf_counter()
            bar = tqdm(range(start, plan.steps), initial=start, total=plan.steps, desc=desc,
                       disable=not progress or not is_main())
            for step in bar:
                raise_if_interrupted()  # a signal whose KeyboardInterrupt a finaliser swallowed
                if plan.epoch_samples:
                    batch = windows[step * plan.batch_size:(step + 1) * plan.batch_size]
                else:
                    batch = random_windows(stream, plan.seq_len, plan.batch_size, generator)
                sums = _gradients(model, optimizer, batch, plan.grad_accum, loss_fn, precision, seed, step)
                if plan.schedule is not None:
                    scale_lr_(optimizer, plan.schedule.factor(step, plan.steps))
                precision.step(optimizer)
                if after_step is not None:
                    after_step()
                log.append(sums)
                log.seconds = time.perf_counter() - began
                bar.set_postfix(loss=f"{sums['loss']:.4f}")
                done = step + 1
                if checkpointing is not None and (done == plan.steps or
                                                  (plan.checkpoint_every and done % plan.checkpoint_every == 0)):
                    if shards is not None or is_main():  # sharded: every process gathers shards
                        save_checkpoint(checkpointing.folder, done, model, optimizer, generator, log.as_dict(),
                                        checkpointing.fingerprint, precision.state(), write=is_main())
                    barrier()
    finally:
        # the last step's gradients would stay as large as the trained parameters (in float32) in every
        # later forward and in a saved model's memory, and make a bfloat16 model uncompilable
        optimizer.zero_grad(set_to_none=True)
        model.eval()
    return log
