"""llama.cpp runs moeify's GGUF exports of SmolLM2: the native greedy tokens, perplexity per quantisation,
and prompt and generation speed against the dense model in the same quantisation.

Rows: the dense SmolLM2 (written through the ``llama`` form, so both sides go through the same writer) and
each default conversion that llama.cpp holds, in the form ``moeify export --format gguf`` picks: MoRE and
ToMoE exactly in the mixtral form (llama.cpp's llama with experts), CMoE through ``--approximate`` in
mixtral too (its fitted top-1 routers), Dense2MoE exactly in qwen2moe (bench_real's ``dense2moe`` options;
its dense layers as identical experts, so the file holds E copies of their MLPs), each in every
``--quants``; the CMoE and ToMoE
rows trained further by distillation (``recover_tokens``), as a served model is (the untrained rows route
by margins that rounding crosses); and the ``_compared`` rows, the folders of ``compare_recovery.py``'s run
(MoRE, ToMoE, CMoE and Dense2MoE at APR 0.5, each after its own training and the same 200,000 tokens of
recovery: that run makes them). Per row and quantisation, one JSON line in ``--out`` (with the row's
definition, ``conversion``, and its form, ``format``):

- agreement (f32 and f16): 64 greedy tokens for the 8 prompts of ``serve_vllm.py``, fed to llama.cpp as
  token ids, against moeify's native model (float32), the f32 file with a float32 KV cache (``--kv-cache``:
  llama.cpp's default f16 cache rounds keys and values, and a routing near-tie then goes the other way:
  the file is what is measured); then, teacher-forced on the native sequences,
  llama.cpp's logits at every position against the native model's (largest difference, argmax differences,
  the native top-2 margin where they part; for a routed model the smallest routing-score gap where the
  difference is largest, a routing near-tie that llama.cpp's rounding breaks the other way); the native
  model in float64 against float32 (how far rounding alone moves it); for an approximation (CMoE), also
  llama.cpp against the standard export the file holds, run by transformers;
- perplexity through llama.cpp on the bench_real text (first 100,000 characters of WikiText-2 raw test, BOS
  once, non-overlapping 2048-token windows, each window's first token unscored: bench_real's protocol);
- speed at batch 1, the CPU to itself (perplexity and speed with llama.cpp's default f16 KV cache for every
  file but f32): prompt processing of a 512-token prompt and generation of 128 tokens (tokens/s, median of
  ``--repeats`` rounds, each running every row's file of the quantisation once, so each row's speed against
  the dense model is the median of ratios measured side by side; generation as one over a round's median
  time per token, its mean beside it), with ``--threads`` threads.

The conversions read the SmolLM2 GGUF itself, so the exports carry its tokenizer section as it is.
llama-cpp-python builds llama.cpp from source (PyPI has no wheel for this CPU):

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/llama
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install /tmp/llama/llama_cpp_python-0.3.36.tar.gz
    python benchmarks/serve_llamacpp.py [--rows dense,more,tomoe,cmoe,dense2moe] [--quants f32,f16,q8_0,q4_k_m]
    python benchmarks/serve_llamacpp.py --markdown    # the table of --out

The docs' table came from these runs, the speed alone on the CPU (the recovered CMoE's agreement is not
measured: its file is an approximation, as the default CMoE row's, whose agreement is):

    python benchmarks/serve_llamacpp.py --rows dense,more,tomoe,cmoe,dense2moe,tomoe_recovered --quants f32 \
        --measure agreement
    python benchmarks/serve_llamacpp.py --rows dense,more,tomoe --quants f32 --measure agreement --kv-cache f16
    python benchmarks/serve_llamacpp.py --rows dense,more,tomoe,cmoe,dense2moe,tomoe_recovered \
        --quants f16,q8_0,q4_k_m --measure agreement,perplexity
    python benchmarks/serve_llamacpp.py --rows cmoe_recovered --quants f16,q8_0,q4_k_m --measure perplexity
    python benchmarks/serve_llamacpp.py --quants f16,q8_0,q4_k_m --measure speed --repeats 9
    python benchmarks/serve_llamacpp.py --rows dense,cmoe,tomoe,cmoe_recovered,tomoe_recovered --quants q4_k_m \
        --measure speed --repeats 9 --threads 1 --out benchmarks/results/serve_llamacpp_threads1.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compare_recovery import DEFAULT_RUN, RUNS  # this folder is on sys.path when run
from results_file import append_row, read_rows

if TYPE_CHECKING:
    from torch import Tensor, nn

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
MODEL = ASSETS / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CALIB = ASSETS / "data" / "wikitext2" / "valid.txt"
EVAL = ASSETS / "data" / "wikitext2_raw" / "wiki.test.raw.txt"
HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "serve_llamacpp.jsonl"
EVAL_CHARS, SEQ_LEN = 100_000, 2048  # bench_real's perplexity protocol
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 32, 64  # serve_vllm's agreement prompts
SPEED_PROMPT, SPEED_NEW = 512, 128


@dataclass(frozen=True)
class Row:
    """A conversion llama.cpp runs: made here from the SmolLM2 GGUF with ``options``, or a finished folder of
    ``compare_recovery.py``'s run (``folder``: converted at APR 0.5 and recovered with 200,000 tokens, the
    models a user would serve); ``export``: its ``moeify export`` options beyond the format."""

    method: str
    options: dict[str, Any] = field(default_factory=dict)
    export: tuple[str, ...] = ()
    folder: Path | None = None


COMPARED = RUNS[DEFAULT_RUN].out
# row -> its conversion; None: the dense model
ROWS: dict[str, Row | None] = {
    "dense": None,
    "more": Row("more"),
    "tomoe": Row("tomoe", {"attention": "off", "steps": 10, "checkpoint_every": 0}),
    "cmoe": Row("cmoe", export=("--approximate",)),
    "dense2moe": Row("dense2moe", {"steps": 30, "lr": 1e-4, "seq_len": 256, "checkpoint_every": 0}),
    # the default CMoE and ToMoE trained further by distillation (`recover_tokens`), as a served model is:
    # the untrained rows route by margins that rounding crosses
    "cmoe_recovered": Row("cmoe", {"recover_tokens": 100_000, "recover_lm_share": 0.0, "recover_recompute": False},
                          ("--approximate",)),
    "tomoe_recovered": Row("tomoe", {"attention": "off", "steps": 10, "checkpoint_every": 0,
                                     "recover_tokens": 200_000, "recover_lm_share": 0.0, "recover_recompute": False}),
    # the comparison's rows (each method's own training, then the same recovery): what a user would serve;
    # CMoE's router and ToMoE's per-token attention dimensions (on by default) through ``--approximate``
    **{f"{method}_compared": Row(method, export=("--approximate",) if method in ("cmoe", "tomoe") else (),
                                 folder=COMPARED / method) for method in ("more", "tomoe", "cmoe", "dense2moe")},
}
QUANTS = ("f32", "f16", "q8_0", "q4_k_m")
AGREEMENT_QUANTS = ("f32", "f16")
MEASURES = ("agreement", "perplexity", "speed")


def moeify_cli(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "moeify", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"moeify {' '.join(args)} failed:\n{done.stderr[-3000:]}")


def native_folder(row: str, work: Path, eval_text: Path) -> Path:
    """The native conversion of ``row``: made once from the SmolLM2 GGUF, or the finished folder it names."""
    definition = ROWS[row]
    if definition.folder is not None:
        if not (definition.folder / "config.json").is_file():
            raise SystemExit(f"row {row} runs {definition.folder}, which is not there: "
                             f"python benchmarks/compare_recovery.py --methods {definition.method} makes it")
        return definition.folder
    folder = work / row
    if not (folder / "config.json").is_file():
        sets = [arg for key, value in definition.options.items() for arg in ("--set", f"{key}={value}")]
        moeify_cli("convert", str(MODEL), "--method", definition.method, "--out", str(folder), "--calib", str(CALIB),
                   "--eval", str(eval_text), "--no-speed", "--overwrite", *sets)
    return folder


def gguf_file(row: str, quant: str, work: Path, eval_text: Path) -> Path:
    """``row``'s GGUF in ``quant`` (written once): the dense model through the llama form, an export through
    ``moeify export --format gguf``."""
    out = work / f"{row}.{quant}.gguf"
    if out.is_file():
        return out
    if ROWS[row] is None:
        from moeify.export.gguf import vocabulary, write_gguf
        from moeify.export.hf_export import HfExport
        from moeify.loading import load_model

        model = load_model(str(MODEL), dtype="float32")[0]
        write_gguf(HfExport(model, "llama"), out, vocabulary([MODEL], model.config.vocab_size), quant)
        return out
    from moeify.export.gguf.quantize import LLAMA_QUANTS, llama_quantize
    from moeify.files import atomic_file

    if quant in LLAMA_QUANTS:  # as `moeify export --quant` does: llama.cpp quantises the f16 file (one fit)
        with atomic_file(out) as tmp:
            llama_quantize(gguf_file(row, "f16", work, eval_text), tmp, quant)
        return out
    moeify_cli("export", str(native_folder(row, work, eval_text)), "--format", "gguf", "--quant", quant,
               "--out", str(out), *export_options(row, eval_text))
    return out


def conversion(row: str) -> dict[str, Any] | None:
    """What ``row`` is (method, conversion options or folder, export options), written with each of its lines so that
    the table takes only the lines of the row's latest definition; None for the dense model."""
    definition = ROWS[row]
    if definition is None:
        return None
    made = {"options": definition.options} if definition.folder is None else {
        "folder": str(definition.folder.relative_to(HERE))}
    return {"method": definition.method, **made, "export": list(definition.export)}


def export_options(row: str, eval_text: Path) -> tuple[str, ...]:
    """``row``'s ``moeify export`` options beyond the format (an approximation's texts with it)."""
    extra = ROWS[row].export
    return (*extra, "--calib", str(CALIB), "--eval", str(eval_text)) if extra else ()


def gguf_format(path: Path) -> str:
    """The standard form a GGUF file of moeify's was written through (``llama`` for the dense model's)."""
    from gguf import GGUFReader

    from moeify.export.gguf import RECORD_KEY

    return json.loads(GGUFReader(path).fields[RECORD_KEY].contents()).get("format", "llama")


def standard_export(row: str, fmt: str, work: Path, eval_text: Path) -> Path:
    """``row``'s standard Hugging Face folder in ``fmt``, with the options of its GGUF (made once): the
    dense model as transformers saves it, a conversion through ``moeify export``."""
    folder = work / f"{row}-{fmt}"
    if (folder / "config.json").is_file():
        return folder
    if ROWS[row] is None:
        from moeify.loading import load_model

        model, tokenizer = load_model(str(MODEL), dtype="float32")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    else:
        moeify_cli("export", str(native_folder(row, work, eval_text)), "--format", fmt, "--out", str(folder),
                   *export_options(row, eval_text))
    return folder


def converter_agreement(row: str, path: Path, work: Path, eval_text: Path, llama_cpp: Path) -> dict[str, Any]:
    """moeify's f32 GGUF of ``row`` against llama.cpp's own converter run on the same conversion's standard
    export (``granitemoeshared`` or ``llama``): tensors identical byte for byte, and the keys that differ
    (general.* metadata aside)."""
    import numpy as np
    from gguf import GGUFReader

    ours = GGUFReader(path)
    folder = standard_export(row, gguf_format(path), work, eval_text)
    theirs = work / f"{row}-converter.f32.gguf"
    done = subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
                           "--outfile", str(theirs)], capture_output=True, text=True, check=False)
    if done.returncode:
        return {"converter_error": done.stderr.strip().splitlines()[-1]}
    reference = GGUFReader(theirs)

    def keys(reader: GGUFReader) -> dict[str, Any]:
        return {k: f.contents() for k, f in reader.fields.items() if not k.startswith(("GGUF.", "general.", "moeify."))}

    mine, their_keys = keys(ours), keys(reference)
    differing = sorted(k for k in set(mine) | set(their_keys) if mine.get(k) != their_keys.get(k))
    a, b = {t.name: t for t in ours.tensors}, {t.name: t for t in reference.tensors}
    same = [n for n in a.keys() & b.keys() if a[n].tensor_type == b[n].tensor_type
            and np.array_equal(np.asarray(a[n].data).view(np.uint8), np.asarray(b[n].data).view(np.uint8))]
    return {"converter": {"identical_tensors": len(same), "tensors": len(a), "converter_tensors": len(b),
                          "differing_keys": differing}}


def kv_cache_type(quant: str, asked: str) -> str:
    """The KV cache's type for a file in ``quant``: ``asked``, or for ``auto`` float32 with an f32 file (so
    the file alone is measured against the native float32 model) and llama.cpp's default f16 otherwise."""
    return asked if asked != "auto" else "f32" if quant == "f32" else "f16"


def llama(path: Path, n_ctx: int, threads: int, kv_cache: str, logits_all: bool = False) -> Any:
    from llama_cpp import GGML_TYPE_F16, GGML_TYPE_F32, Llama

    kv = {"f32": GGML_TYPE_F32, "f16": GGML_TYPE_F16}[kv_cache]
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, logits_all=logits_all,
                 verbose=False, seed=0, type_k=kv, type_v=kv)


def llama_runs(path: Path, ids: list[list[int]], expected: list[list[int]], threads: int,
               kv_cache: str) -> tuple[list[list[int]], list[Tensor], bool]:
    """llama.cpp's greedy continuations of ``ids`` as long as ``expected``'s (EOS not special), its
    teacher-forced logits on the ``expected`` tokens, and whether any logit was NaN."""
    import numpy as np
    import torch

    llm = llama(path, 256, threads, kv_cache, logits_all=True)
    greedy, forced, nan = [], [], False
    for prompt, tokens in zip(ids, expected):
        llm.reset()
        llm.eval(prompt)
        out = []
        for _ in tokens:
            logits = llm.scores[llm.n_tokens - 1]
            nan |= bool(np.isnan(logits).any())
            out.append(int(logits.argmax()))
            llm.eval([out[-1]])
        greedy.append(out)
        llm.reset()
        llm.eval(prompt + tokens)
        scores = np.array(llm.scores[len(prompt) - 1:len(prompt) + len(tokens) - 1])
        nan |= bool(np.isnan(scores).any())
        forced.append(torch.from_numpy(scores))
    return greedy, forced, nan


def routing_gaps(model: nn.Module, prompt: list[int], tokens: list[int], position: int) -> dict[str, float] | None:
    """Over the native model's routed layers, the smallest gap between the k-th and the (k+1)-th routing
    score of the export's linear routers (x @ W.T) at ``position`` of the forced sequence, and the median of
    that smallest gap over the sequence's positions; None for a model without linear routers. A gap near
    zero is a routing choice that float rounding may make either way: the engine then runs another expert
    for that token, and the difference spreads to the positions after it through attention."""
    import torch

    from moeify.calibration.hooks import observing
    from moeify.runtime.moe import MoeMLP
    from moeify.runtime.routers import NotLinear

    routers = [m.router for m in model.modules() if isinstance(m, MoeMLP) and m.router is not None]
    if not routers:
        return None
    try:
        forms = [router.linear_form() for router in routers]
    except NotLinear:
        return None
    inputs: list[Tensor] = []  # in forward order: the routers' order
    with torch.no_grad(), observing({router: lambda x, _out: inputs.append(x) for router in routers}):
        model(input_ids=torch.tensor([prompt + tokens]))
    gaps = []
    for form, x in zip(forms, inputs):
        top = (x.reshape(-1, x.shape[-1]).double() @ form.weight.T).topk(form.top_k + 1, dim=-1).values
        gaps.append(top[:, form.top_k - 1] - top[:, form.top_k])
    smallest = torch.stack(gaps).min(dim=0).values[len(prompt) - 1:-1]  # the positions that predict ``tokens``
    return {"router_gap_at_largest_difference": float(smallest[position]),
            "median_router_gap": float(smallest.median())}


def agreement(row: str, path: Path, work: Path, eval_text: Path, ids: list[list[int]], threads: int,
              kv_cache: str) -> dict[str, Any]:
    """llama.cpp's greedy tokens and teacher-forced logits against the native model's (float32), and the
    native model in float64 against float32 on the same sequences: how far rounding alone moves it."""
    from moeify.evaluation.serving import compare_tokens, forced_agreement, forced_logits, margins_at, native_tokens
    from moeify.loading import load_model

    native = MODEL if ROWS[row] is None else native_folder(row, work, eval_text)
    model = load_model(str(native), dtype="float32")[0]
    expected = native_tokens(model, ids, NEW_TOKENS)
    tokens, forced, nan = llama_runs(path, ids, expected, threads, kv_cache)
    result = {"nan_logits": nan, **compare_tokens(expected, tokens)}
    result["native_margin_at_difference"] = margins_at(model, ids, expected, result["first_difference"])
    own = [forced_logits(model, p, t) for p, t in zip(ids, expected)]
    result.update(forced_agreement(expected, own, forced))
    sequence, position = result["max_abs_logit_diff_at"]
    result["routing"] = routing_gaps(model, ids[sequence], expected[sequence], position)
    wider = forced_agreement(expected, own, [forced_logits(model.double(), p, t) for p, t in zip(ids, expected)])
    result["native_float64"] = {key: wider[key] for key in ("argmax_differences", "max_abs_logit_diff")}
    if ROWS[row] is not None and ROWS[row].export:  # an approximation: what the file holds is its standard export
        result["against_export"] = export_agreement(row, path, work, eval_text, ids, threads, kv_cache)
    return result


def export_agreement(row: str, path: Path, work: Path, eval_text: Path, ids: list[list[int]], threads: int,
                     kv_cache: str) -> dict[str, Any]:
    """llama.cpp against the approximation the GGUF holds: ``row``'s standard export in the GGUF's format
    (the same ``moeify export`` options), run by transformers in float32: greedy tokens and teacher-forced
    argmax differences."""
    from transformers import AutoModelForCausalLM

    from moeify.evaluation.serving import compare_tokens, forced_agreement, forced_logits, native_tokens

    fmt = gguf_format(path)
    model = AutoModelForCausalLM.from_pretrained(standard_export(row, fmt, work, eval_text), dtype="float32").eval()
    expected = native_tokens(model, ids, NEW_TOKENS)
    tokens, forced, _ = llama_runs(path, ids, expected, threads, kv_cache)
    forced_result = forced_agreement(expected, [forced_logits(model, p, t) for p, t in zip(ids, expected)], forced)
    return {"format": fmt, **{key: value for key, value in compare_tokens(expected, tokens).items()
                              if key in ("identical_sequences", "sequences", "token_agreement")},
            **{key: forced_result[key] for key in ("argmax_differences", "forced_positions", "max_abs_logit_diff")}}


def perplexity(path: Path, tokens: list[int], threads: int, kv_cache: str) -> dict[str, Any]:
    """bench_real's protocol through llama.cpp: non-overlapping ``SEQ_LEN`` windows of ``tokens`` (BOS once,
    at the start), each window's first token unscored; float64 log-softmax of llama.cpp's logits."""
    import numpy as np

    llm = llama(path, SEQ_LEN, threads, kv_cache, logits_all=True)
    nll, scored = 0.0, 0
    for start in range(0, len(tokens) - 1, SEQ_LEN):
        window = tokens[start:start + SEQ_LEN]
        if len(window) < 2:
            break
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[:len(window) - 1], dtype=np.float64)
        peak = logits.max(axis=-1, keepdims=True)
        log_z = (peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=-1)))
        nll += float((log_z - logits[np.arange(len(window) - 1), window[1:]]).sum())
        scored += len(window) - 1
    return {"ppl": float(np.exp(nll / scored)), "scored_tokens": scored}


def speed(paths: dict[str, Path], prompt: list[int], threads: int, repeats: int,
          kv_cache: str) -> dict[str, dict[str, Any]]:
    """Batch-1 prompt processing (``len(prompt)`` tokens) and greedy generation (``SPEED_NEW`` tokens) in
    tokens/s of each row's file, interleaved: every round runs each file once (in an order that turns each
    round), so a slow spell of the CPU falls on every row alike; after one warm-up round, the median of
    ``repeats`` rounds, and where ``dense`` is among them each row's median per-round ratio to it.
    Generation speed is one over the round's median time per token (a token the CPU was taken from
    in the middle of lengthens the mean, not the median: serving benchmarks' median time per output token);
    the mean (tokens over the round's time) is kept beside it. Only the last position's logits are computed,
    read from the context (llama-cpp-python keeps ``scores`` only with ``logits_all``)."""
    import llama_cpp
    import numpy as np

    engines = {row: llama(path, len(prompt) + SPEED_NEW + 8, threads, kv_cache) for row, path in paths.items()}

    def once(llm: Any) -> dict[str, float]:
        vocab = llm.n_vocab()
        llm.reset()
        began = time.perf_counter()
        llm.eval(prompt)
        prompted = time.perf_counter()
        steps = []
        for _ in range(SPEED_NEW):
            step = time.perf_counter()
            llm.eval([int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,)).argmax())])
            steps.append(time.perf_counter() - step)
        return {"prompt": len(prompt) / (prompted - began), "generation": 1 / statistics.median(steps),
                "generation_mean": SPEED_NEW / sum(steps)}

    order = list(engines)
    runs: dict[str, list[dict[str, float]]] = {row: [] for row in order}
    for round_ in range(repeats + 1):
        turned = order[round_ % len(order):] + order[:round_ % len(order)]
        measured = {row: once(engines[row]) for row in turned}
        if round_:  # the first round warms up
            for row in order:
                runs[row].append(measured[row])
    results = {}
    for row, rounds in runs.items():
        results[row] = {"threads": threads, "repeats": repeats, "prompt_len": len(prompt), "new_tokens": SPEED_NEW,
                        "generation_statistic": "median time per token", "interleaved_with": order}
        for kind in ("prompt", "generation", "generation_mean"):
            values = [r[kind] for r in rounds]
            results[row][f"{kind}_tokens_per_s"] = statistics.median(values)
            results[row][f"{kind}_spread"] = (max(values) - min(values)) / statistics.median(values)
            if "dense" in runs and row != "dense":
                results[row][f"{kind}_x_dense"] = statistics.median(
                    r[kind] / d[kind] for r, d in zip(rounds, runs["dense"]))
    return results


def build_of(row: str, work: Path, eval_text: Path) -> str | None:
    """Which conversion of ``row`` was measured (None for the dense model): the start of the sha256 of its
    ``record.json``, which each conversion writes anew (timings included), so the table takes no line of a
    conversion made again since, even of the same definition."""
    if ROWS[row] is None:
        return None
    return hashlib.sha256((native_folder(row, work, eval_text) / "record.json").read_bytes()).hexdigest()[:12]


def ideal_speedup(row: str, work: Path, eval_text: Path) -> float | None:
    """The dense model's multiply-accumulates per token over the export's (at the speed prompt's context)."""
    if ROWS[row] is None:
        return None
    from moeify.evaluation.speed import macs_per_token
    from moeify.loading import load_model

    context = SPEED_PROMPT + SPEED_NEW
    dense = macs_per_token(load_model(str(MODEL), dtype="float32")[0], context)
    return dense / macs_per_token(load_model(str(native_folder(row, work, eval_text)), dtype="float32")[0], context)


SPEED_KEYS = ("prompt_tokens_per_s", "generation_tokens_per_s", "prompt_x_dense", "generation_x_dense")


def _agreement_cell(result: dict[str, Any]) -> str:
    return (f"{result['identical_sequences']}/{result['sequences']} / {result['argmax_differences']} of "
            f"{result['forced_positions']}")


def markdown(path: Path) -> str:
    """One line per (row, quantisation, KV cache), the latest of each in the row's latest definition, form
    (its format named with the row) and conversion (``build``): perplexity through llama.cpp and its
    change from the same row's f16, agreement with the native model, and speed against the dense model's in
    the same quantisation, from the quantisation's latest speed run (a row outside it: none); a KV cache
    other than the quantisation's default (``kv_cache_type``) is named in the quant column. Then the rows of
    the converter route (llama.cpp's ``convert_hf_to_gguf.py`` on a standard export, float32), which lines
    without a quantisation hold."""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    converted: dict[str, dict[str, Any]] = {}
    measured = read_rows(path)

    def made(line: dict[str, Any]) -> tuple[str, str, str | None]:
        return line["format"], json.dumps(line.get("conversion"), sort_keys=True), line.get("build")

    latest = {line["row"]: made(line) for line in measured if "quant" in line}
    # per quantisation, the rows of its latest speed run: speed is shown from that run alone
    speed_run = {line["quant"]: line["interleaved_with"] for line in measured if "interleaved_with" in line}
    for line in measured:  # a later line's measurements replace an earlier one's, key by key
        if "quant" not in line:
            converted[line["row"]] = line
        elif made(line) == latest[line["row"]]:  # a row converted or written otherwise since: left out
            if line.get("interleaved_with") != speed_run.get(line["quant"]):  # not that run's: no speed
                line = {k: v for k, v in line.items() if k not in SPEED_KEYS}
            rows.setdefault((line["row"], line["quant"], line["kv_cache"]), {}).update(line)
    lines = [("| row | quant | size MiB | PPL (llama.cpp) | vs own f16 | identical greedy / argmax differences "
              "teacher-forced | prompt tok/s | x dense | generation tok/s | x dense | FLOP ideal |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"] if rows else []
    for (name, quant, kv), row in sorted(rows.items(), key=lambda item: (
            list(ROWS).index(item[0][0]), QUANTS.index(item[0][1]), item[0][2] != kv_cache_type(item[0][1], "auto"))):
        default_kv = kv == kv_cache_type(quant, "auto")
        f16 = rows.get((name, "f16", "f16"), {}).get("ppl")
        change = f"{row['ppl'] / f16 - 1:+.1%}" if f16 and "ppl" in row and quant != "f16" else "-"
        agree = _agreement_cell(row) if "identical_sequences" in row else "-"
        if "against_export" in row:  # an approximation: also against what the file holds
            agree += f" (its {row['against_export']['format']} export: {_agreement_cell(row['against_export'])})"
        dense = rows.get(("dense", quant, kv), {})
        ratios = [f"{row[f'{kind}_x_dense']:.2f}x" if f"{kind}_x_dense" in row  # interleaved with dense
                  else f"{row[k] / dense[k]:.2f}x" if k in dense and k in row and name != "dense" else "-"
                  for kind, k in (("prompt", "prompt_tokens_per_s"), ("generation", "generation_tokens_per_s"))]
        ideal = f"{row['ideal_speedup']:.2f}x" if row.get("ideal_speedup") else "-"
        ppl = f"{row['ppl']:.2f}" if "ppl" in row else "-"
        prompt = f"{row['prompt_tokens_per_s']:.0f}" if "prompt_tokens_per_s" in row else "-"
        generation = f"{row['generation_tokens_per_s']:.1f}" if "generation_tokens_per_s" in row else "-"
        label = quant if default_kv else f"{quant}, KV cache {kv}"
        lines.append(f"| {name} ({row['format']}) | {label} | {row['bytes'] / 2**20:.1f} | {ppl} | {change} | "
                     f"{agree} | {prompt} | {ratios[0]} | {generation} | {ratios[1]} | {ideal} |")
    if converted:
        lines += [""] if lines else []  # a blank line between the two tables
        lines += [("| row (converter route, f32) | format | identical greedy sequences | "
                   "teacher-forced: argmax differences / positions | largest logit difference | NaN |"),
                  "|---|---|---|---|---|---|"]
        for name, row in converted.items():
            if "conversion_error" in row:
                lines.append(f"| {name} | {row['format']} | not converted: {row['conversion_error']} | - | - | - |")
                continue
            forced = f"{row['argmax_differences']} / {row['forced_positions']}" if "forced_positions" in row else "-"
            largest = f"{row['max_abs_logit_diff']:.3f}" if "max_abs_logit_diff" in row else "-"
            lines.append(f"| {name} | {row['format']} | {row['identical_sequences']}/{row['sequences']} | {forced} | "
                         f"{largest} | {'yes' if row['nan_logits'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--quants", default=",".join(QUANTS), help=f"comma-separated, of {', '.join(QUANTS)}")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moeify-llamacpp"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--measure", default=",".join(MEASURES),
                        help="comma-separated, of agreement, perplexity, speed (speed wants the CPU to itself: "
                             "measure it in a run of its own)")
    parser.add_argument("--kv-cache", choices=("auto", "f32", "f16"), default="auto",
                        help="llama.cpp's KV cache type; auto: f32 for f32 files (the file alone against the native "
                             "float32 model), llama.cpp's default f16 for the others")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--llama-cpp", type=Path, default=None,
                        help="a llama.cpp source tree: compare each f32 file with its converter's "
                             "(convert_hf_to_gguf.py)")
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.out))
        return
    rows, quants, measures = args.rows.split(","), args.quants.split(","), args.measure.split(",")
    if unknown := ([r for r in rows if r not in ROWS] + [q for q in quants if q not in QUANTS]
                   + [m for m in measures if m not in MEASURES]):
        parser.error(f"unknown rows, quants or measures: {', '.join(unknown)}")
    if "speed" in measures and "dense" not in rows:
        parser.error("speed is measured against the dense model in the same rounds: --rows must include dense")
    from moeify.calibration.data import read_text, token_stream
    from moeify.loading import load_model

    args.work.mkdir(parents=True, exist_ok=True)
    eval_text = args.work / f"wikitext2_raw_test_first{EVAL_CHARS}.txt"
    eval_text.write_text(EVAL.read_text()[:EVAL_CHARS])
    tokenizer = load_model(str(MODEL), dtype="float32")[1]
    tokens = token_stream(read_text(eval_text), tokenizer).tolist()
    paragraphs = [line.strip() for line in EVAL.read_text().splitlines() if len(line.strip()) > 400]
    ids = [tokenizer(p)["input_ids"][:PROMPT_TOKENS] for p in paragraphs[:PROMPTS]]
    speed_prompt = tokenizer(EVAL.read_text()[200_000:260_000])["input_ids"][:SPEED_PROMPT]
    ideal = {row: ideal_speedup(row, args.work, eval_text) for row in rows}
    build = {row: build_of(row, args.work, eval_text) for row in rows}

    def line(row: str, quant: str, path: Path, kv_cache: str) -> dict[str, Any]:
        return {"row": row, "conversion": conversion(row), "quant": quant, "format": gguf_format(path),
                "engine": "llama.cpp (llama-cpp-python 0.3.36)", "kv_cache": kv_cache, "bytes": path.stat().st_size,
                "ideal_speedup": ideal[row], "build": build[row]}

    for quant in quants:
        kv_cache = kv_cache_type(quant, args.kv_cache)
        paths = {row: gguf_file(row, quant, args.work, eval_text) for row in rows}
        for row, path in paths.items() if {"agreement", "perplexity"} & set(measures) else ():
            result = line(row, quant, path, kv_cache)
            if "agreement" in measures and quant in AGREEMENT_QUANTS:
                result.update(agreement(row, path, args.work, eval_text, ids, args.threads, kv_cache))
                if quant == "f32" and args.llama_cpp is not None:
                    result.update(converter_agreement(row, path, args.work, eval_text, args.llama_cpp))
            if "perplexity" in measures:
                result.update(perplexity(path, tokens, args.threads, kv_cache))
            append_row(args.out, result)
        if "speed" in measures:
            for row, measured in speed(paths, speed_prompt, args.threads, args.repeats, kv_cache).items():
                append_row(args.out, {**line(row, quant, paths[row], kv_cache), **measured})


if __name__ == "__main__":
    main()
