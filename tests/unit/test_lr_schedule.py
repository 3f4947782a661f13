"""The shared loop's learning-rate schedule (warm-up, then cosine decay), also across a resume; the recovery's
schedule and steps."""

import math

import pytest
import torch

from moeify.training.loop import Checkpointing, TrainPlan, WarmupCosine, train, warmup_cosine
from tests.helpers.tiny_models import tiny_model
from tests.helpers.weights import assert_same_weights

STREAM = torch.randint(3, 128, (2000,), generator=torch.Generator().manual_seed(0))


def test_warmup_then_cosine_to_the_final_ratio():
    factors = [warmup_cosine(step, 10, 4, 0.1) for step in range(10)]
    assert factors[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # never a zero-rate step
    assert factors[4] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1)
    assert factors[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 5)))
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert warmup_cosine(0, 1, 0, 0.1) == pytest.approx(0.1)  # one step: straight to the final rate
    with pytest.raises(ValueError, match="warmup=5 must be <= steps=3"):
        TrainPlan(steps=3, batch_size=2, seq_len=8, schedule=WarmupCosine(5))


def run(steps, folder=None, resume=False, kill_at=None):
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plan = TrainPlan(steps=steps, batch_size=2, seq_len=16, checkpoint_every=2, schedule=WarmupCosine(2, 0.1))
    rates = []

    def after_step():
        rates.append(optimizer.param_groups[0]["lr"])
        if len(rates) == kill_at:
            raise KeyboardInterrupt("killed")

    checkpointing = None if folder is None else Checkpointing(folder, {"steps": steps}, resume=resume)
    train(model, optimizer, STREAM, plan, seed=0, device=torch.device("cpu"), checkpointing=checkpointing,
          after_step=after_step, progress=False)
    return model, rates


def test_the_loop_follows_the_schedule_and_resumes_on_it(tmp_path):
    reference, rates = run(6)
    assert rates == pytest.approx([1e-2 * warmup_cosine(s, 6, 2, 0.1) for s in range(6)])
    with pytest.raises(KeyboardInterrupt):
        run(6, tmp_path, kill_at=3)  # checkpoint at step 2
    resumed, later = run(6, tmp_path, resume=True)
    assert later == pytest.approx(rates[2:])
    assert_same_weights(resumed, reference)


def test_linear_decay_falls_from_the_initial_rate_towards_zero_and_lora_options_choose_it():
    from moeify.methods.cmoe import CmoeConfig
    from moeify.training.loop import LinearDecay

    assert [LinearDecay().factor(s, 4) for s in range(4)] == pytest.approx([1.0, 0.75, 0.5, 0.25])
    assert [LinearDecay(2).factor(s, 6) for s in range(6)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])
    model = tiny_model("llama")
    optimizer = torch.optim.Adam([{"params": list(model.parameters())[:2], "lr": 1e-2},
                                  {"params": list(model.parameters())[2:], "lr": 1e-3}])
    seen = []
    train(model, optimizer, STREAM, TrainPlan(steps=4, batch_size=2, seq_len=16, schedule=LinearDecay()), seed=0,
          device=torch.device("cpu"), after_step=lambda: seen.append([g["lr"] for g in optimizer.param_groups]),
          progress=False)
    expected = [rate * f for f in (1.0, 0.75, 0.5, 0.25) for rate in (1e-2, 1e-3)]  # every group from its own rate
    assert [lr for step in seen for lr in step] == pytest.approx(expected)
    assert CmoeConfig(finetune_steps=4, lr_schedule="linear").plan(32).schedule == LinearDecay()
    assert CmoeConfig(finetune_steps=4).plan(32).schedule is None  # constant by default


def test_the_recovery_schedule_is_constant_by_default_and_linear_on_request(monkeypatch):
    from moeify.training.loop import LinearDecay, WarmupConstant
    from moeify.training.recovery_options import RecoveryOptions

    plan = RecoveryOptions(recover_tokens=4096).plan(512, wrap=False)
    assert plan.schedule is None and (plan.batch_size, plan.steps) == (1, 8)  # one window a step by default
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun, one window for each process
    assert RecoveryOptions(recover_tokens=4096).plan(512, wrap=False).batch_size == 2
    assert RecoveryOptions(recover_tokens=4096, recover_batch_size=4).plan(512, wrap=False).batch_size == 4
    assert RecoveryOptions(recover_tokens=4096, recover_warmup=2).plan(512, wrap=False).schedule == WarmupConstant(2)
    linear = RecoveryOptions(recover_tokens=4096, recover_warmup=2, recover_lr_schedule="linear")
    assert linear.plan(512, wrap=False).schedule == LinearDecay(2)
