"""The shared training loop: gradient accumulation, determinism, resumable atomic checkpoints."""

import json

import pytest
import torch

from moeify.training.checkpoint import latest_step
from moeify.training.loop import Checkpointing, TrainPlan, earlier_seconds, train
from moeify.training.noise import step_noise, uniform
from tests.helpers.tiny_models import tiny_model
from tests.helpers.weights import assert_same_weights

STREAM = torch.randint(3, 128, (2000,), generator=torch.Generator().manual_seed(0))
FINGERPRINT = {"method": "test", "lr": 1e-3}


def run(steps, *, grad_accum=1, folder=None, resume=False, kill_at=None, fingerprint=FINGERPRINT, every=2,
        dtype=torch.float32, seen_dtypes=None, frozen_embeddings=False):
    """Train a fresh tiny model (its weights rounded to bfloat16, so every dtype starts from the same ones)
    held in ``dtype``; ``kill_at`` raises inside that step, after its optimizer update; ``seen_dtypes``
    collects the trained parameters' dtypes after each step."""
    model = tiny_model("llama").to(torch.bfloat16).to(dtype)
    model.model.embed_tokens.weight.requires_grad_(not frozen_embeddings)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    plan = TrainPlan(steps=steps, batch_size=4, seq_len=16, grad_accum=grad_accum, checkpoint_every=every)
    checkpointing = None if folder is None else Checkpointing(folder, fingerprint, resume=resume)
    done = []

    def after_step():
        done.append(1)
        if seen_dtypes is not None:
            seen_dtypes.update(p.dtype for p in model.parameters() if p.requires_grad)
        if len(done) == kill_at:
            raise KeyboardInterrupt("killed")

    log = train(model, optimizer, STREAM, plan, seed=0, device=torch.device("cpu"), checkpointing=checkpointing,
                after_step=after_step, progress=False)
    return model, log


def test_training_is_deterministic_and_changes_the_model():
    first, log = run(3)
    second, _ = run(3)
    assert_same_weights(first, second)
    assert len(log.losses) == 3 and all(loss > 0 for loss in log.losses)
    assert not torch.equal(first.model.embed_tokens.weight, tiny_model("llama").model.embed_tokens.weight)


def test_gradient_accumulation_equals_the_whole_batch():
    whole, log_whole = run(2, grad_accum=1)
    split, log_split = run(2, grad_accum=4)
    for (name, a), b in zip(whole.named_parameters(), split.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
    assert log_split.losses == pytest.approx(log_whole.losses, rel=1e-5)
    with pytest.raises(ValueError, match="batch_size=4 must be a multiple of grad_accum=3"):
        TrainPlan(steps=1, batch_size=4, seq_len=8, grad_accum=3)


def test_killed_run_resumes_to_the_same_weights_as_an_uninterrupted_one(tmp_path):
    reference, reference_log = run(6, folder=tmp_path / "a")
    with pytest.raises(KeyboardInterrupt):
        run(6, folder=tmp_path / "b", kill_at=5)  # checkpoints at steps 2 and 4; step 5 is lost
    assert latest_step(tmp_path / "b") == 4
    resumed, log = run(6, folder=tmp_path / "b", resume=True)
    assert log.resumed_from == 4
    assert_same_weights(resumed, reference)
    assert log.losses == reference_log.losses  # the log of the steps before the kill came back too
    assert latest_step(tmp_path / "b") == 6
    state = json.loads((tmp_path / "b" / "step-00000006" / "state.json").read_text())
    assert 0 < log.earlier_seconds and state["log"]["seconds"] == pytest.approx(log.earlier_seconds + log.seconds)
    assert earlier_seconds({"stage": log.summary(), "other": [{"earlier_seconds": 1.0}]}) == pytest.approx(
        round(log.earlier_seconds, 3) + 1.0)  # what a resumed conversion adds to its own time


def drift(model, reference, start):
    """How far ``model``'s weights are from ``reference``'s, relative to how far ``reference`` moved from
    ``start`` (sums of absolute differences over every parameter)."""
    params = [(a.detach(), b.detach(), s.detach()) for a, b, s in zip(model.parameters(), reference.parameters(),
                                                                         start.parameters())]
    off = sum(float((a.float() - b.float()).abs().sum()) for a, b, _ in params)
    moved = sum(float((b.float() - s.float()).abs().sum()) for _, b, s in params)
    return off / moved


def test_a_fully_trained_bfloat16_model_ends_as_its_float32_twin_rounded():
    """Every parameter trained: float32 masters throughout, float32 arithmetic, the working dtype at the end
    (bfloat16: its starting weights are the float32 run's; float16's range would round small ones)."""
    dtype = torch.bfloat16
    reference, reference_log = run(8)
    seen = set()
    model, log = run(8, dtype=dtype, seen_dtypes=seen)
    assert seen == {torch.float32}
    for a, b in zip(model.parameters(), reference.parameters()):
        assert a.dtype == dtype and torch.equal(a, b.detach().to(dtype))
    assert log.losses == reference_log.losses


@pytest.mark.parametrize(("dtype", "bound"), [(torch.bfloat16, 0.08), (torch.float16, 0.02)])
def test_frozen_low_precision_weights_train_the_rest_as_masters_under_autocast(dtype, bound):
    """Updated in place in bfloat16, the weights drift 0.12 of their movement from the float32 run's, and
    float16 overflows to NaN; float32 masters under autocast (and float16's loss scaling) keep them close."""
    reference, reference_log = run(8, frozen_embeddings=True)
    seen = set()
    model, log = run(8, dtype=dtype, seen_dtypes=seen, frozen_embeddings=True)
    assert seen == {torch.float32}  # master weights while training
    assert {p.dtype for p in model.parameters()} == {dtype}  # the working dtype again after it
    assert drift(model, reference, tiny_model("llama").to(torch.bfloat16)) < bound
    assert log.losses == pytest.approx(reference_log.losses, rel=2e-3)
    assert log.losses != reference_log.losses  # the low-precision arithmetic of autocast


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_run_resumes_exactly_from_its_float32_masters(tmp_path, dtype):
    reference, _ = run(6, folder=tmp_path / "a", dtype=dtype, frozen_embeddings=True)
    with pytest.raises(KeyboardInterrupt):
        run(6, folder=tmp_path / "b", kill_at=5, dtype=dtype, frozen_embeddings=True)
    state = json.loads((tmp_path / "b" / "step-00000004" / "state.json").read_text())
    assert ("scale" in state["grad_scaler"]) == (dtype == torch.float16)
    resumed, _ = run(6, folder=tmp_path / "b", resume=True, dtype=dtype, frozen_embeddings=True)
    assert_same_weights(resumed, reference)


def test_more_steps_after_a_finished_run_continue_it(tmp_path):
    reference, _ = run(5, folder=tmp_path / "a")
    run(3, folder=tmp_path / "b")
    extended, log = run(5, folder=tmp_path / "b", resume=True)
    assert log.resumed_from == 3
    assert_same_weights(extended, reference)


def test_checkpoints_are_safetensors_and_json_written_atomically(tmp_path):
    run(4, folder=tmp_path)
    (tmp_path / ".step-00000009.tmp-half").mkdir()  # what a kill while writing would leave behind
    assert latest_step(tmp_path) == 4
    [step] = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert step.name == "step-00000004"  # older checkpoints are removed
    assert sorted(p.name for p in step.iterdir()) == [
        ".moeify", "model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"]
    state = json.loads((step / "state.json").read_text())
    assert state["step"] == 4 and state["fingerprint"] == FINGERPRINT and len(state["log"]["losses"]) == 4


def test_resume_refuses_a_different_run_and_a_fresh_run_refuses_to_clobber(tmp_path):
    run(2, folder=tmp_path)
    with pytest.raises(ValueError, match=r"differs from the checkpointed one \(lr: 0.001 -> 0.002\)"):
        run(4, folder=tmp_path, resume=True, fingerprint={**FINGERPRINT, "lr": 2e-3})
    with pytest.raises(FileExistsError, match="holds a checkpoint at step 2; continue it with resume=true"):
        run(4, folder=tmp_path)
    with pytest.raises(ValueError, match="the checkpoint is at step 2, beyond steps=1"):
        run(1, folder=tmp_path, resume=True)
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        run(2, folder=tmp_path / "empty", resume=True)


def test_a_damaged_checkpoint_is_refused_in_one_line_that_names_it(tmp_path):
    run(2, folder=tmp_path)
    weights = tmp_path / "step-00000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])  # a disk that filled up while it was copied
    with pytest.raises(ValueError, match=r"step-00000002: the checkpoint cannot be read \(.+\); delete this folder"):
        run(4, folder=tmp_path, resume=True)


def test_an_epoch_sees_every_window_once_in_a_seeded_order():
    from moeify.training.loop import epoch, epoch_windows

    stream = torch.arange(100)
    windows = epoch_windows(stream, 10, 7, seed=3)
    starts = sorted(int(w[0]) for w in windows)
    assert len(set(starts)) == 7 and all(s % 10 == 0 for s in starts)  # disjoint, aligned
    assert torch.equal(windows, epoch_windows(stream, 10, 7, seed=3))
    plan = epoch(7, 2, seq_len=10)
    assert plan.steps == 4 and plan.epoch_samples == 7
    with pytest.raises(ValueError, match="fewer than the 11 samples"):
        epoch_windows(stream, 10, 11, seed=0)
    with pytest.raises(ValueError, match=r"steps=3 must be ceil\(epoch_samples / batch_size\) = 4"):
        TrainPlan(steps=3, batch_size=2, seq_len=10, epoch_samples=7)


def test_window_noise_does_not_depend_on_how_the_batch_is_split():
    like = torch.empty(4, 3, 5)
    with step_noise(7, 2, range(4)):
        whole, per_step = uniform(like, ("mask", 0)), uniform(like[0], ("s_0", 0), per_window=False)
        assert torch.equal(uniform(like, ("mask", 0)), whole)  # a recomputed forward draws it again
        assert not torch.equal(uniform(like, ("mask", 1)), whole)
    with step_noise(7, 2, [2, 3]):  # another process's share of the same step
        assert torch.equal(uniform(like[:2], ("mask", 0)), whole[2:])
        assert torch.equal(uniform(like[0], ("s_0", 0), per_window=False), per_step)
    with step_noise(7, 3, range(4)):
        assert not torch.equal(uniform(like, ("mask", 0)), whole)
    with step_noise(7, 2, [0]), pytest.raises(ValueError, match="micro-batch of 1 windows"):
        uniform(like, ("mask", 0))
    torch.manual_seed(0)  # outside a training step: torch's global generator
    drawn = uniform(like, ("mask", 0))
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.rand(like.shape))
