"""Recovery: a converted model trained further for a budget of tokens, by the LM loss or by distillation
from its dense model.

Any conversion loses quality that a little training wins back. Distillation gives every token the dense
model's whole next-token distribution where the LM loss gives one label, so it is the standard recovery of
a compressed model (ToMoE's own loss, the pruning literature's). Measured at a matched budget (CMoE and
static pruning of SmolLM2 at 200,000 tokens, ``benchmarks/compare_recovery.py``), the LM loss alone
recovered perplexity on text like the training text further than distillation alone, and distillation
held up better on other text; half of each recovered further than either on text like the training text,
further than the LM loss alone on other text, and is the default (``recover_lm_share=0.5``); distillation
alone is ``recover_lm_share=0``, the LM loss alone (no teacher pass) ``1``. The recovery runs after a
method's own, paper-specified training, with a budget in tokens, so that conversions can be compared at
equal training compute (``moeify compare --recover-tokens``).

The run: one pass over ``ceil(recover_tokens / seq_len)`` disjoint windows of the training text in a
seeded order (further passes where the text holds fewer), ``recover_batch_size`` windows per AdamW step
(one per process by default: at a budget in tokens, more and smaller steps recovered further), a linear
warm-up over ``recover_warmup`` steps and then a constant learning rate, so the model after n tokens of a
longer run is the model a run of n tokens ends with (``recover`` evaluates those points of the curve on
the way; ``recover_lr_schedule=linear`` decays it to 0 instead, and the curve's earlier points are then
points of the longer run). The loss is (1 - s) KL(teacher || student) + s LM (``losses.distillation_loss``),
over the whole vocabulary or the teacher's top-k tokens plus one bucket for the rest; the teacher runs
alongside or is read from a top-k cache (``teacher.py``). What trains is a choice of parts
(``parts.py``), their weights directly or through LoRA adapters merged afterwards, so the recovered model
has its conversion's structure and exports wherever that did. bfloat16, checkpoints and resume, torchrun
and FSDP are the shared loop's (``loop.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from moeify.arch.head import output_head
from moeify.files import atomic_file
from moeify.options import OptionError
from moeify.training.checkpoint import latest_step
from moeify.training.distributed import barrier, is_main
from moeify.training.loop import Checkpointing, TrainPlan, epoch_windows, train
from moeify.training.losses import distillation_loss, lm_loss
from moeify.training.parts import lora_targets, parameter_parts
from moeify.training.recovery_options import RecoveryOptions
from moeify.training.teacher import LiveTeacher, TeacherCache, build_teacher_cache, cache_key

Milestone = Callable[[int], dict[str, Any]]  # tokens trained so far -> what to record at that point
CHECKPOINTS = "recovery_checkpoints"  # the recovery's checkpoint folder in the work folder


@contextmanager
def _only_trainable(model: nn.Module, params: Sequence[nn.Parameter]) -> Iterator[None]:
    """Inside the block exactly ``params`` of ``model`` need gradients; the flags come back after it."""
    before = [(p, p.requires_grad) for p in model.parameters()]
    chosen = {id(p) for p in params}
    for p, _ in before:
        p.requires_grad_(id(p) in chosen)
    try:
        yield
    finally:
        for p, flag in before:
            p.requires_grad_(flag)


def teacher_cache(teacher: nn.Module, stream: Tensor, options: RecoveryOptions, plan: TrainPlan, *, seed: int,
                  identity: dict[str, Any], cache_dir: Path, device: torch.device, progress: bool) -> Path:
    """The top-k teacher cache of every window ``plan`` trains on (built by the main process where it does
    not exist yet; the others wait for it). Its name follows from what it holds, so runs that distil the
    same windows from the same teacher share it (``moeify compare`` builds it once for every method)."""
    path = cache_dir / cache_key(k=options.recover_top_k, seq_len=plan.seq_len, seed=seed, **identity)
    if is_main():
        windows = epoch_windows(stream, plan.seq_len, plan.epoch_samples, seed, wrap=True)
        build_teacher_cache(teacher, windows, options.recover_top_k, path, batch_size=plan.batch_size,
                            device=device, progress=progress)
    barrier()
    return path


def _teacher(teacher: nn.Module, stream: Tensor, options: RecoveryOptions, plan: TrainPlan, *, seed: int,
             identity: dict[str, Any], cache_dir: Path | None, device: torch.device,
             progress: bool) -> tuple[Callable[[Tensor], tuple[Tensor, ...]], str]:
    """The teacher's targets of a batch, and how they come: ``live`` (the teacher runs) or ``cache`` (its top-k
    targets read back, ``teacher_cache``). ``auto`` takes the cache, where there is a folder for it, when the
    windows repeat or a cache of them exists: only then does it save teacher passes."""
    mode = options.recover_teacher
    if mode == "auto":
        exists = cache_dir is not None and options.recover_top_k and (cache_dir / cache_key(
            k=options.recover_top_k, seq_len=plan.seq_len, seed=seed, **identity)).is_file()
        repeats = plan.epoch_samples > len(stream) // plan.seq_len
        mode = "cache" if options.recover_top_k and cache_dir is not None and (repeats or exists) else "live"
    if mode == "live":
        return LiveTeacher(teacher, options.recover_top_k), mode
    if cache_dir is None:
        raise OptionError("recover_teacher=cache needs a work folder for the cache (moeify keeps <out>.work)")
    return TeacherCache(teacher_cache(teacher, stream, options, plan, seed=seed, identity=identity,
                                      cache_dir=cache_dir, device=device, progress=progress)), mode


class _Milestones:
    """The training loop's ``after_step``: after the step that reaches each milestone (in tokens), the
    model is evaluated (``on_milestone``) and the point kept in the work folder (``curve``), so that a
    resumed run keeps the points before its checkpoint."""

    def __init__(self, milestones: Sequence[int], on_milestone: Milestone | None, plan: TrainPlan,
                 start: int | None, path: Path | None) -> None:
        self.path, self.on_milestone, self.plan = path, on_milestone, plan
        self.step = start or 0
        self.tokens_per_step = plan.batch_size * plan.seq_len
        total = plan.epoch_samples * plan.seq_len
        self.pending = sorted(t for t in set(milestones) if self.step * self.tokens_per_step < t <= total)
        self.points: list[dict[str, Any]] = []
        if path is not None and start is not None and path.is_file():
            self.points = json.loads(path.read_text())
        self.network: nn.Module | None = None  # the model as it trains (evaluated in eval mode)

    def __call__(self) -> None:
        self.step += 1
        while self.pending and (self.step * self.tokens_per_step >= self.pending[0] or self.step == self.plan.steps):
            tokens = self.pending.pop(0)
            self.network.eval()
            self.points.append({"tokens": tokens, "steps": self.step,
                                **(self.on_milestone(tokens) if self.on_milestone else {})})
            self.network.train()
            if self.path is not None and is_main():
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with atomic_file(self.path) as tmp:
                    tmp.write_text(json.dumps(self.points, indent=1) + "\n")


def recover(model: nn.Module, teacher: nn.Module, stream: Tensor, options: RecoveryOptions, *, seed: int,
            device: torch.device, identity: dict[str, Any], work_dir: Path | None = None,
            cache_dir: Path | None = None, milestones: Sequence[int] = (), on_milestone: Milestone | None = None,
            progress: bool = True) -> tuple[nn.Module, dict[str, Any]]:
    """Distil ``teacher`` into ``model`` (see the module docstring); returns (the recovered model, what to
    record: tokens, steps, wall time, trainable parameters, the loss curve and the ``milestones`` evaluated
    by ``on_milestone``).

    ``identity``: names the run for its checkpoints and teacher cache (the model and the training text's
    digest); ``work_dir`` holds checkpoints (None: none, no resume); ``cache_dir`` the teacher cache (default
    ``work_dir``)."""
    seq_len = options.seq_len(model.config)
    plan = options.plan(seq_len, wrap=True)
    fingerprint = {"recovery": True, **{k: v for k, v in vars(options).items() if k not in (
        "recover_tokens", "recover_resume", "recover_checkpoint_every", "recover_recompute", "recover_grad_accum",
        "recover_teacher")}, "seq_len": seq_len, "seed": seed, **identity}
    lm_only = options.recover_lm_share == 1  # the teacher's share is 0: no teacher pass, no cache
    targets, mode = (None, "none") if lm_only else _teacher(
        teacher, stream, options, plan, seed=seed, identity=identity, cache_dir=cache_dir or work_dir,
        device=device, progress=progress)
    teacher_head = output_head(teacher)
    parts = parameter_parts(model)
    chosen = options.parts
    direct = [p for part in chosen if options.recover_lora_rank == 0 or part in ("routers", "norms")
              for p in parts[part].values()]
    checkpointing = None if work_dir is None else Checkpointing(
        work_dir / CHECKPOINTS, fingerprint, resume=options.recover_resume, resume_option="recover_resume")
    start = latest_step(checkpointing.folder) if checkpointing is not None and options.recover_resume else None
    milestones_hook = _Milestones(milestones, on_milestone, plan, start,
                                  None if work_dir is None else work_dir / "recovery_curve.json")

    def loss(student: nn.Module, batch: Tensor) -> dict[str, Tensor]:
        if lm_only:
            return {**(parts := lm_loss(student, batch)), "lm": parts["loss"]}
        return distillation_loss(student, batch, targets(batch), lm_share=options.recover_lm_share,
                                 teacher_head=teacher_head)

    with _only_trainable(model, direct):
        network = model
        if options.recover_lora_rank:
            from peft import LoraConfig, get_peft_model

            network = get_peft_model(model, LoraConfig(r=options.recover_lora_rank,
                                                       lora_alpha=options.recover_lora_alpha,
                                                       target_modules=lora_targets(model, chosen)))
            for p in direct:  # peft froze every base parameter
                p.requires_grad_(True)
        trained = direct + [p for n, p in network.named_parameters() if "lora_" in n]
        optimizer = torch.optim.AdamW(trained, lr=options.recover_lr, weight_decay=options.recover_weight_decay)
        milestones_hook.network = network
        log = train(network, optimizer, stream, plan, seed=seed, device=device, loss_fn=loss,
                    checkpointing=checkpointing, after_step=milestones_hook, progress=progress,
                    desc="recovery: LM loss" if lm_only else "recovery: distillation", network=model)
        if options.recover_lora_rank:
            model = network.merge_and_unload()
    summary = {**log.summary(), **{name: [round(v, 5) for v in values] for name, values in log.parts.items()},
               "tokens": plan.epoch_samples * seq_len, "seq_len": seq_len,
               "batch_size": plan.batch_size, "passes": round(plan.epoch_samples / (len(stream) // seq_len), 3),
               "teacher": mode, "parts": list(chosen), "curve": milestones_hook.points,
               "checkpoints": None if checkpointing is None else str(checkpointing.folder)}
    return model.eval(), summary
