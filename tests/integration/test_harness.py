"""Zero-shot tasks through lm-eval, offline on the ../shared task files: ``moeify eval --tasks`` on the
dense and on a CMoE-converted stories260K, checked against log-likelihoods computed here by hand from
each task's lm-eval formulation (written out below, independently of the packaged YAMLs)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moeify
from moeify.api import EMBEDDED_MODEL
from moeify.cli.main import main
from moeify.evaluation.harness import run_tasks
from moeify.evaluation.tasks.utils import clean_hellaswag

pytestmark = pytest.mark.slow  # zero-shot tasks on the real stories260K checkpoint


@pytest.fixture(scope="module")
def task_data(shared_assets: Path) -> Path:
    pytest.importorskip("lm_eval")
    return shared_assets / "data"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A 260K-parameter model's passes are many times faster on one thread when the CPU is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def no_network(monkeypatch):
    """Any attempt to reach the network fails the test: the tasks must run from local files only."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")
    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture(scope="module")
def models(stories, task_data, tmp_path_factory) -> dict[str, tuple[str, object, object]]:
    """name -> (CLI argument, model, tokenizer) for the dense model and a converted folder."""
    folder = moeify.save(moeify.convert(None, "cmoe", {}, measure_speed=False),
                         tmp_path_factory.mktemp("cmoe") / "model")
    return {"dense": (EMBEDDED_MODEL, *stories), "cmoe": (str(folder), moeify.load(folder), stories[1])}


def _rows(path: Path, n: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def direct_items(task: str, data: Path, n: int) -> list[tuple[list[tuple[str, str]], int]]:
    """The first ``n`` items of ``task`` as lm-eval poses them: [(context, continuation)] per choice, gold."""
    if task == "arc_easy":
        return [([(f"Question: {d['question']}\nAnswer:", " " + c) for c in d["choices"]["text"]],
                 d["choices"]["label"].index(d["answerKey"])) for d in _rows(data / "arc/ARC-Easy-test.jsonl", n)]
    if task == "piqa":
        labels = (data / "piqa/valid-labels.lst").read_text().split()
        return [([(f"Question: {d['goal']}\nAnswer:", " " + d[s]) for s in ("sol1", "sol2")], int(label))
                for d, label in zip(_rows(data / "piqa/valid.jsonl", n), labels)]
    if task == "hellaswag":
        return [([(clean_hellaswag(f"{d['activity_label']}: {d['ctx_a']} {d['ctx_b'].capitalize()}"),
                   " " + clean_hellaswag(e)) for e in d["endings"]], d["label"])
                for d in _rows(data / "hellaswag/hellaswag_val_subset1000.jsonl", n)]
    assert task == "winogrande"  # partial scoring: the options fill the contexts, one continuation
    return [([(c, " " + d["continuation"]) for c in d["context_options"]], d["gold"])
            for d in _rows(data / "winogrande/winogrande_dev_partial.jsonl", n)]


@torch.no_grad()
def loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """Sum of log p(continuation tokens | everything before), tokenizing context + continuation together
    (the tokenizer's own BOS included) and taking the tokens after the context's own tokenization."""
    whole = tokenizer(context + continuation).input_ids
    n_context = len(tokenizer(context).input_ids)
    assert len(whole) <= model.config.max_position_embeddings  # lm-eval would truncate the context
    ids = torch.tensor([whole])
    logp = model(input_ids=ids[:, :-1], use_cache=False).logits.float().log_softmax(-1)[0]
    targets = ids[0, n_context:]
    return float(logp[n_context - 1:].gather(-1, targets[:, None]).sum())


def direct_scores(model, tokenizer, task: str, data: Path, n: int) -> list[dict]:
    """Per item: the choices' log-likelihoods, acc (argmax = gold) and acc_norm (argmax of the
    log-likelihood per character of the choice, lm-eval's normalisation; bytes for this ASCII text)."""
    out = []
    for requests, gold in direct_items(task, data, n):
        lls = torch.tensor([loglikelihood(model, tokenizer, c, x) for c, x in requests])
        lengths = torch.tensor([len(x) - 1 for _, x in requests], dtype=torch.float)  # without the " "
        out.append({"loglikelihoods": lls.tolist(), "acc": float(lls.argmax() == gold),
                    "acc_norm": float((lls / lengths).argmax() == gold)})
    return out


@pytest.mark.parametrize("name", ["dense", "cmoe"])
def test_cli_arc_easy_offline_matches_direct_computation(name, models, task_data, tmp_path, no_network):
    arg, model, tokenizer = models[name]
    out = tmp_path / "eval.json"
    assert main(["eval", arg, "--tasks", "arc_easy", "--task-data", str(task_data), "--limit", "50",
                 "--json", str(out)]) == 0
    scores = json.loads(out.read_text())["tasks"]["arc_easy"]
    direct = direct_scores(model, tokenizer, "arc_easy", task_data, 50)
    assert scores["n"] == 50
    assert scores["acc"] == pytest.approx(sum(d["acc"] for d in direct) / 50)
    assert scores["acc_norm"] == pytest.approx(sum(d["acc_norm"] for d in direct) / 50)


@pytest.mark.parametrize("task", ["arc_easy", "piqa", "hellaswag", "winogrande"])
@pytest.mark.parametrize("name", ["dense", "cmoe"])
def test_per_choice_loglikelihoods_match_direct_computation(name, task, models, task_data, no_network):
    _, model, tokenizer = models[name]
    run = run_tasks(model, tokenizer, [task], task_data, limit=5, samples=True)
    direct = direct_scores(model, tokenizer, task, task_data, 5)
    assert run.scores[task]["n"] == 5
    for logged, expected in zip(run.samples[task], direct, strict=True):
        assert logged["loglikelihoods"] == pytest.approx(expected["loglikelihoods"], rel=1e-4, abs=1e-3)
        assert logged["acc"] == expected["acc"]
        if task != "winogrande":  # acc only, as in lm-eval
            assert logged["acc_norm"] == expected["acc_norm"]


def test_arc_challenge_runs(models, task_data):
    _, model, tokenizer = models["dense"]
    scores = run_tasks(model, tokenizer, ["arc_challenge"], task_data, limit=3).scores["arc_challenge"]
    assert scores["n"] == 3 and 0 <= scores["acc"] <= 1 and 0 <= scores["acc_norm"] <= 1


def test_choice_longer_than_the_context_is_a_clear_error(models, task_data, tmp_path):
    """PIQA item 314 has a solution of more than 512 stories260K tokens: lm-eval can only assert."""
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa/valid.jsonl").write_text((task_data / "piqa/valid.jsonl").read_text().splitlines()[314])
    (tmp_path / "piqa/valid-labels.lst").write_text("0\n")
    _, model, tokenizer = models["dense"]
    with pytest.raises(ValueError, match="longer than the model's context of 512 tokens"):
        run_tasks(model, tokenizer, ["piqa"], tmp_path)


def test_hellaswag_clean_up():
    assert clean_hellaswag(" Wash [title] Rinse the cup. [step] Dry it.  ") == "Wash. Rinse the cup. Dry it."


def test_import_moeify_does_not_import_lm_eval():
    code = "import sys, moeify, moeify.api, moeify.cli.main; assert 'lm_eval' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "arc_easy", "--task-data", "{tmp}"], 'pip install -e ".[eval]"'),
    (["--tasks", "mmlu", "--task-data", "{tmp}"], "unknown task(s) mmlu; allowed: arc_easy"),
    (["--tasks", "arc_easy"], "tasks need --task-data DIR"),
    (["--tasks", "arc_easy", "--task-data", "{tmp}"], "task data file not found"),
    (["--tasks", "arc_easy", "--task-data", "{tmp}", "--limit", "0"], "limit=0 is out of range"),
])
def test_task_errors_before_loading_the_model(argv, message, tmp_path, monkeypatch, capsys):
    if "pip install" in message:
        monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    else:
        pytest.importorskip("lm_eval")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["eval", "/nonexistent/model", *argv]) == 2
    assert message in capsys.readouterr().err
