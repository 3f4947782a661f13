"""Recovery by distillation: the losses, the parts that train, LoRA merged back, the teacher cache, resume,
and the exact export of a recovered model."""

import copy
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import moeify
from moeify.api import export_folder, recover_run
from moeify.calibration.data import token_stream
from moeify.methods import get_method
from moeify.options import OptionError, build_config
from moeify.training.losses import (
    _chunk_top_k_kl,
    distillation_loss,
    lm_loss,
    top_k_targets,
)
from moeify.training.parts import PARTS, parameter_parts
from moeify.training.recovery import recover
from moeify.training.recovery_options import RecoveryOptions, split_recovery_options
from moeify.training.teacher import LiveTeacher
from tests.helpers.conversion import FAST
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model
from tests.helpers.weights import assert_same_weights

CPU = torch.device("cpu")
IDENTITY = {"teacher": "tiny", "text": "test"}


def converted(method, make_ctx, seed=0):
    """(dense tiny model, its conversion by ``method`` with the fast test options)."""
    dense = tiny_model("llama", seed=seed, **STORIES_VOCAB)
    spec = get_method(method)
    ctx = make_ctx(copy.deepcopy(dense))
    spec.run(ctx, build_config(spec.config_cls, FAST.get(method, {})))
    return dense, ctx.model.eval()


def options(**values):
    return build_config(RecoveryOptions, {"recover_tokens": 1024, "recover_seq_len": 64, "recover_batch_size": 4,
                                          "recover_lm_share": 0.0, **values})  # distillation, unless a test says


def run(model, dense, stream, work=None, **values):
    return recover(model, dense, stream, options(**values), seed=0, device=CPU, identity=IDENTITY, work_dir=work,
                   progress=False)


@pytest.fixture(scope="module")
def stream(tokenizer, calib_text):
    return token_stream(calib_text, tokenizer)


def held_out_kl(model, dense, tokenizer, eval_text):
    """The student's KL from the teacher on held-out windows."""
    batch = token_stream(eval_text, tokenizer)[:4 * 64].view(4, 64)
    with torch.no_grad():
        return float(distillation_loss(model, batch, LiveTeacher(dense, 0)(batch), lm_share=0.0,
                                       teacher_head=LiveTeacher(dense, 0).head)["kl"])


def test_top_k_kl_is_the_kl_of_the_bucketed_distributions():
    generator = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(5, 40, generator=generator) * 3, torch.randn(5, 40, generator=generator) * 3
    top, ids, tail = top_k_targets(teacher, 6)
    head = torch.nn.Identity()
    _, kl, _ = _chunk_top_k_kl(1.0, 0.0, head, student, top, ids, tail, torch.full((5,), -100))

    def bucketed(logits):
        p = torch.softmax(logits.double(), -1)
        kept = p.gather(-1, ids)
        return torch.cat([kept, 1 - kept.sum(-1, keepdim=True)], -1)

    p, q = bucketed(teacher), bucketed(student)
    assert float(kl) == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-5)
    _, same, _ = _chunk_top_k_kl(1.0, 0.0, head, teacher, top, ids, tail, torch.full((5,), -100))
    assert abs(float(same)) < 1e-5


def test_a_model_distilled_from_itself_has_no_kl_and_its_lm_part_is_the_lm_loss():
    model = tiny_model("llama").eval()
    batch = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for k in (0, 8):
            parts = distillation_loss(model, batch, LiveTeacher(model, k)(batch), lm_share=0.5,
                                      teacher_head=LiveTeacher(model, 0).head)
            assert abs(float(parts["kl"])) < 1e-5
            assert float(parts["lm"]) == pytest.approx(float(lm_loss(model, batch)["loss"]), rel=1e-5)
            assert float(parts["loss"]) == pytest.approx(0.5 * float(parts["lm"]), rel=1e-5)


def test_every_decoder_parameter_has_one_part_and_embeddings_none(make_ctx):
    _, model = converted("cmoe", make_ctx)
    parts = parameter_parts(model)
    assert all(parts[name] for name in PARTS)
    names = [n for params in parts.values() for n in params]
    assert len(names) == len(set(names))
    frozen = {"model.embed_tokens.weight", "lm_head.weight"}
    assert set(names) == {n for n, _ in model.named_parameters()} - frozen
    assert all(".router." in n for n in parts["routers"]) and all(".experts." in n for n in parts["experts"])
    assert all("self_attn" in n for n in parts["attention"]) and "model.norm.weight" in parts["norms"]


# ToMoE's routers weigh 1 and its attention's keep 0/1 masks: both train straight-through
@pytest.mark.parametrize("method,parts", [("cmoe", "routers,norms"), ("tomoe", "routers,norms"),
                                          ("tomoe", "attention")])
def test_only_the_chosen_parts_change(make_ctx, stream, method, parts):
    dense, model = converted(method, make_ctx)
    before = copy.deepcopy(model)
    recovered, summary = run(model, dense, stream, recover_parts=parts, recover_lr=1e-2)
    chosen = {n for part in parts.split(",") for n in parameter_parts(recovered)[part]}
    old = dict(before.named_parameters())
    for name, param in recovered.named_parameters():
        assert torch.equal(param, old[name]) != (name in chosen), name
    assert summary["trainable_params"] == sum(old[n].numel() for n in chosen)
    assert all(p.requires_grad for p in recovered.parameters())  # the flags as they were


def test_lora_recovery_is_merged_into_the_weights(make_ctx, stream, tokenizer, eval_text):
    dense, model = converted("cmoe", make_ctx)
    structure = [type(m) for m in model.modules()]
    before = held_out_kl(model, dense, tokenizer, eval_text)
    recovered, _ = run(model, dense, stream, recover_lora_rank=4, recover_lr=3e-3, recover_tokens=2048)
    assert [type(m) for m in recovered.modules()] == structure  # no adapter left
    assert not any("lora" in n for n, _ in recovered.named_parameters())
    assert held_out_kl(recovered, dense, tokenizer, eval_text) < before


def test_recovery_lowers_the_held_out_kl_and_records_its_curve(make_ctx, stream, tmp_path, tokenizer, eval_text):
    dense, model = converted("static_prune", make_ctx)
    before = held_out_kl(model, dense, tokenizer, eval_text)
    seen = []
    recovered, summary = recover(model, dense, stream, options(recover_tokens=2048, recover_lr=3e-3), seed=0,
                                 device=CPU, identity=IDENTITY, work_dir=tmp_path, milestones=(512, 1024, 99999),
                                 on_milestone=lambda tokens: seen.append(tokens) or {"seen": tokens}, progress=False)
    assert seen == [512, 1024] and [p["tokens"] for p in summary["curve"]] == [512, 1024]
    assert summary["tokens"] == 2048 and summary["steps"] == 8 and summary["teacher"] == "live"
    assert held_out_kl(recovered, dense, tokenizer, eval_text) < before


def test_a_cached_teacher_trains_as_the_live_one(make_ctx, stream, tmp_path):
    dense, model = converted("cmoe", make_ctx)
    live, live_log = run(copy.deepcopy(model), dense, stream, recover_top_k=16, recover_teacher="live")
    cached, cached_log = run(model, dense, stream, tmp_path, recover_top_k=16, recover_teacher="cache")
    assert cached_log["teacher"] == "cache" and list(tmp_path.glob("teacher-top16-*.safetensors"))
    assert cached_log["losses"] == pytest.approx(live_log["losses"], rel=1e-5)
    for a, b in zip(cached.parameters(), live.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    _, auto = recover(copy.deepcopy(model), dense, stream, options(recover_top_k=16), seed=0, device=CPU,
                      identity=IDENTITY, work_dir=tmp_path / "c", cache_dir=tmp_path, progress=False)
    assert auto["teacher"] == "cache"  # a cache of these windows exists


def test_the_lm_loss_alone_trains_as_a_vanishing_teacher_share_without_running_the_teacher(make_ctx, stream,
                                                                                             tmp_path):
    dense, model = converted("cmoe", make_ctx)
    nearly, nearly_log = run(copy.deepcopy(model), dense, stream, recover_lm_share=1 - 1e-9, recover_teacher="live")

    def refuse(*_):
        raise AssertionError("the teacher ran")

    hook = dense.register_forward_pre_hook(refuse)
    alone, alone_log = run(model, dense, stream, tmp_path, recover_lm_share=1.0)
    hook.remove()
    assert alone_log["teacher"] == "none" and not list(tmp_path.glob("teacher-*"))
    assert alone_log["losses"] == pytest.approx(nearly_log["losses"], rel=1e-5)
    for a, b in zip(alone.parameters(), nearly.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_budget_beyond_the_text_makes_further_passes(make_ctx, stream):
    dense, model = converted("static_prune", make_ctx)
    _, summary = run(model, dense, stream[:300], recover_tokens=640)
    assert summary["passes"] == pytest.approx(10 / 4) and summary["steps"] == 3


def test_an_interrupted_recovery_resumes_to_the_uninterrupted_weights(make_ctx, stream, tmp_path):
    dense, model = converted("cmoe", make_ctx)
    reference, reference_log = run(copy.deepcopy(model), dense, stream, tmp_path / "a", recover_checkpoint_every=2)

    def die(tokens):
        raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        recover(copy.deepcopy(model), dense, stream, options(recover_checkpoint_every=2), seed=0, device=CPU,
                identity=IDENTITY, work_dir=tmp_path / "b", milestones=(3 * 256,), on_milestone=die, progress=False)
    resumed, log = run(copy.deepcopy(model), dense, stream, tmp_path / "b", recover_checkpoint_every=2,
                       recover_resume=True)
    assert log["resumed_from"] == 2
    assert_same_weights(resumed, reference)
    assert log["losses"] == reference_log["losses"]


@pytest.mark.parametrize(("values", "message"), [
    ({"recover_parts": "experts,gates"}, "unknown gates"),
    ({"recover_teacher": "cache", "recover_top_k": 0}, "needs recover_top_k > 0"),
    ({"recover_batch_size": 6, "recover_grad_accum": 4}, "must be a multiple of"),
    ({"recover_lm_share": 1.5}, "out of range"),
])
def test_bad_recovery_options_are_refused_with_the_allowed_values(values, message):
    with pytest.raises(OptionError, match=message):
        build_config(RecoveryOptions, values)


def test_lora_cannot_reach_experts_stored_once_or_thresholded_inputs(make_ctx, stream):
    for method, message in (("tomoe", "stores overlapping experts once"), ("teal", "thresholds its inputs")):
        dense, model = converted(method, make_ctx)
        with pytest.raises(ValueError, match=message):
            run(model, dense, stream, recover_lora_rank=4)


def test_the_recovery_options_are_split_from_the_methods():
    method, recovery = split_recovery_options({"spec": "S1A1E8", "recover_tokens": "10", "recover_lr": "1e-3"})
    assert method == {"spec": "S1A1E8"} and recovery == {"recover_tokens": "10", "recover_lr": "1e-3"}


@pytest.mark.slow
def test_a_recovered_conversion_still_exports_exactly(tmp_path):
    """LoRA merged into MoRE's experts and backbone: the qwen2_moe export of the recovered model gives its
    native logits (as the export of the unrecovered model does)."""
    options = {**{k: str(v) for k, v in FAST["more"].items()}, "recover_tokens": "2048", "recover_seq_len": "64",
               "recover_lora_rank": "4", "recover_lr": "1e-2"}
    result = moeify.convert(None, "more", options, measure_speed=False)
    assert result.record["recovery"]["tokens"] == 2048
    assert result.record["metrics"]["ppl"] != result.record["pre_recovery"]["ppl"]
    native = moeify.save(result, tmp_path / "native")
    export_folder(native, "qwen2_moe", tmp_path / "export")
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        gap = float((exported(ids).logits - moeify.load(native)(ids).logits).abs().max())
    assert gap < 1e-5


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A CMoE conversion of the embedded model (fast options), saved by the CLI."""
    from moeify.cli.main import main

    out = tmp_path_factory.mktemp("runs") / "cmoe"
    assert main(["convert", "--method", "cmoe", "--out", str(out), "--no-speed", "--set", "calib_samples=4",
                 "--set", "seq_len=64"]) == 0
    return out


def test_recover_cli_keeps_the_run_and_records_both_sides(saved_run, tmp_path, capsys):
    import json

    from moeify.cli.main import main

    out = tmp_path / "recovered"
    assert main(["recover", str(saved_run), "--tokens", "1024", "--out", str(out), "--milestones", "512",
                 "--no-speed", "--set", "recover_seq_len=64", "--set", "recover_lr=3e-3"]) == 0
    printed = capsys.readouterr().out
    assert "perplexity before recovery" in printed and "after 512 tokens: perplexity" in printed
    assert re.search(r"after 512 tokens: perplexity [\d.]+, APR 0\.\d{3}", printed)
    run, record = (json.loads((folder / "record.json").read_text()) for folder in (saved_run, out))
    assert record["pre_recovery"]["metrics"] == run["metrics"]
    assert record["pre_recovery"]["ppl"] == pytest.approx(run["metrics"]["ppl"], rel=1e-6)
    assert record["metrics"]["ppl"] < record["pre_recovery"]["ppl"]
    assert record["recovery"]["tokens"] == 1024 and [p["tokens"] for p in record["recovery"]["curve"]] == [512]
    # top-k routing fixes the share but for expert widths: 172 channels make experts of 21 and 22, so the
    # routing the training moves moves the measured APR a little; the adapters in place count for nothing
    assert record["recovery"]["curve"][0]["apr"] == pytest.approx(record["active"]["apr"], rel=0.01)
    assert record["recovery"]["options"]["recover_lr"] == 3e-3 and not (tmp_path / "recovered.work").exists()
    moeify.load(out)  # a converted folder as any other


@pytest.mark.parametrize(("args", "message"), [
    (["--tokens", "0"], "needs a budget"),
    (["--tokens", "64", "--set", "spec=S1A1E8"], "recovery options (recover_*) only"),
    (["--tokens", "64", "--set", "recover_parts=gates"], "unknown gates"),
    (["--tokens", "64", "--milestones", "a"], "--milestones='a'"),
])
def test_recover_cli_refuses_bad_input_in_one_line(saved_run, tmp_path, capsys, args, message):
    from moeify.cli.main import main

    assert main(["recover", str(saved_run), "--out", str(tmp_path / "r"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "r").exists()


def test_recover_cli_refuses_its_own_run_as_output_and_asks_for_a_text_it_cannot_reread(saved_run, tmp_path,
                                                                                         capsys):
    import json

    from moeify.cli.main import main

    assert main(["recover", str(saved_run), "--tokens", "64", "--out", str(saved_run), "--overwrite"]) == 2
    assert "which this command reads" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    for name in ("record.json", "config.json"):
        (other / name).write_text((saved_run / name).read_text())
    record = json.loads((other / "record.json").read_text())
    record["data"]["calib"] = {"name": "wiki.valid.txt", "sha256": "0" * 64}
    (other / "record.json").write_text(json.dumps(record))
    assert main(["recover", str(other), "--tokens", "64", "--out", str(tmp_path / "r")]) == 2
    assert "was 'wiki.valid.txt'" in capsys.readouterr().err


def test_convert_refuses_a_recovery_layer_by_layer(capsys, tmp_path):
    from moeify.cli.main import main

    assert main(["convert", "--method", "cmoe", "--out", str(tmp_path / "o"), "--layer-by-layer",
                 "--set", "recover_tokens=64"]) == 2
    assert "cannot run layer by layer" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_recovers_every_method_with_one_budget_and_resumes_only_that_budget(tmp_path, capsys):
    import json

    from moeify.cli.main import main

    out = tmp_path / "cmp"
    assert main(["compare", "--methods", "static_prune,cmoe", "--out", str(out), "--recover-tokens", "512,1024",
                 "--set", "recover_seq_len=64", "--set", "recover_top_k=16", "--set", "recover_lm_share=0",
                 "--set", "cmoe.calib_samples=4", "--set", "cmoe.seq_len=64"]) == 0
    printed = capsys.readouterr().out
    assert "ppl before recovery" in printed and "| static_prune |" in printed
    for method in ("static_prune", "cmoe"):
        record = json.loads((out / method / "record.json").read_text())
        assert record["recovery"]["tokens"] == 1024 and record["recovery"]["curve"][0]["tokens"] == 512
    cmoe = json.loads((out / "cmoe" / "record.json").read_text())
    assert cmoe["config"]["calib_samples"] == 4 and cmoe["recovery"]["teacher"] == "cache"  # the second reads it
    assert len(list((out / "teacher_cache").glob("*.safetensors"))) == 1
    assert (out / "report" / "recovery.png").is_file()
    written = (out / "cmoe" / "record.json").stat().st_mtime_ns
    again = ["compare", "--methods", "cmoe", "--out", str(out), "--resume", "--set", "recover_seq_len=64",
             "--set", "recover_top_k=16", "--set", "recover_lm_share=0", "--set", "cmoe.calib_samples=4",
             "--set", "cmoe.seq_len=64"]
    assert main([*again, "--recover-tokens", "512,1024"]) == 0  # the same recovery: kept
    assert (out / "cmoe" / "record.json").stat().st_mtime_ns == written
    assert main([*again, "--recover-tokens", "512"]) == 0  # another budget: recovered again
    assert json.loads((out / "cmoe" / "record.json").read_text())["recovery"]["tokens"] == 512
    assert main(["compare", "--methods", "cmoe", "--out", str(tmp_path / "c2"), "--set", "spec=S1A1E8"]) == 2
    assert "name the method (METHOD.spec)" in capsys.readouterr().err
    lm = tmp_path / "lm"  # the LM loss alone: no teacher pass, shared or not
    assert main(["compare", "--methods", "static_prune,cmoe", "--out", str(lm), "--recover-tokens", "512",
                 "--set", "recover_seq_len=64", "--set", "recover_lm_share=1", "--set", "cmoe.calib_samples=4",
                 "--set", "cmoe.seq_len=64"]) == 0
    assert not (lm / "teacher_cache").exists()
    assert json.loads((lm / "cmoe" / "record.json").read_text())["recovery"]["teacher"] == "none"


def test_the_plan_counts_the_recovery_with_its_teacher():
    from moeify.memory_plan import plan

    memory = plan("llama-2-7b", "cmoe", {"recover_tokens": 1000, "recover_lm_share": 0})
    recover_phase = memory.phases["recover"]
    assert recover_phase["teacher weights"] == recover_phase["weights"] == pytest.approx(6.74e9 * 2, rel=0.01)
    assert recover_phase["gradients"] > 0.9 * 6.5e9 * 4  # every decoder weight trains, float32 gradients
    assert recover_phase["teacher log-probabilities"] > 0
    assert plan("llama-2-7b", "cmoe", {"recover_tokens": 1000}).phases["recover"] == recover_phase  # the default
    lm_alone = plan("llama-2-7b", "cmoe", {"recover_tokens": 1000, "recover_lm_share": 1}).phases["recover"]
    assert "teacher log-probabilities" not in lm_alone and lm_alone["gradients"] == recover_phase["gradients"]
    lora = plan("llama-2-7b", "cmoe", {"recover_tokens": 1000, "recover_lora_rank": 8}).phases["recover"]
    assert lora["gradients"] == 0 and "recover" not in plan("llama-2-7b", "cmoe").phases
    mlp = plan("llama-2-7b", "cmoe", {"recover_tokens": 1000, "recover_parts": "experts"}).phases["recover"]
    assert 0.6 < mlp["gradients"] / recover_phase["gradients"] < 0.7  # LLaMA-2-7B's MLP: 2/3 of each layer


def test_a_bfloat16_conversion_recovers_in_float32_masters_and_stays_bfloat16(make_ctx, stream):
    dense, model = converted("static_prune", make_ctx)
    reference, _ = run(copy.deepcopy(model), dense, stream)
    low, _ = run(model.to(torch.bfloat16), dense.to(torch.bfloat16), stream)
    assert {p.dtype for p in low.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        gaps = [float((a.float() - b.float()).abs().max() / b.float().abs().max())
                for a, b in zip(low.parameters(), reference.parameters())]
    assert max(gaps) < 0.05


@pytest.mark.slow
def test_a_recovery_calibrates_teal_again_in_convert_and_in_recover(tmp_path):
    teal = {"sparsity": 0.5, "calib_samples": 4, "seq_len": 64}
    recovery = {"recover_tokens": 512, "recover_seq_len": 64, "recover_lr": 3e-3}
    result = moeify.convert(method="teal", options={**teal, **recovery}, measure_speed=False)
    record = result.record
    fitted, refitted = record["details"]["thresholds"], record["recovery"]["refit"]["thresholds"]
    assert len(refitted) == len(fitted) and refitted != fitted  # the weights moved, the cut-offs followed
    assert record["active"]["apr"] == pytest.approx(record["pre_recovery"]["active"]["apr"], abs=0.03)
    again = recover_run(moeify.save(result, tmp_path / "teal"), recovery, measure_speed=False).record
    assert again["recovery"]["refit"]["calibration"] == record["recovery"]["refit"]["calibration"]
    assert again["recovery"]["refit"]["thresholds"] != refitted
    cmoe = moeify.convert(method="cmoe", options={"calib_samples": 4, "seq_len": 64, **recovery},
                          measure_speed=False)
    assert "refit" not in cmoe.record["recovery"]  # nothing of CMoE's routing is a calibration of the weights


@pytest.mark.slow
def test_a_recovery_matches_dsmoes_tau_again_where_it_was_matched():
    options = {"steps": 2, "seq_len": 64, "batch_size": 2, "analyses": False, "recover_tokens": 256,
               "recover_seq_len": 64}
    record = moeify.convert(method="dsmoe", options={**options, "active_ratio": 0.6}, measure_speed=False).record
    refit = record["recovery"]["refit"]
    assert refit["trained_tau"] == record["details"]["matched_tau"]["tau"]  # the recovery starts from the match
    assert abs(refit["apr"] - 0.6) <= abs(refit["trained_apr"] - 0.6) and refit["apr"] == pytest.approx(0.6, abs=0.01)
    trained = moeify.convert(method="dsmoe", options=options, measure_speed=False).record
    assert "refit" not in trained["recovery"]  # the paper's trained tau stays
