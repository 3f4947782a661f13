"""llama.cpp runs moeify's GGUF exports of SmolLM2: the native greedy tokens, perplexity per quantisation,
and prompt and generation speed against the dense model in the same quantisation.

Rows (``llamacpp_rows.py``): the dense SmolLM2 (written through the ``llama`` form, so both sides go through
the same writer) and each default conversion that llama.cpp holds, in the form ``moeify export --format gguf``
picks: MoRE and ToMoE (its routers trained 250 steps) exactly in the mixtral form (llama.cpp's llama with
experts), CMoE through ``--approximate`` in mixtral too (its fitted top-1 routers), Dense2MoE exactly in
qwen2moe (bench_real's ``dense2moe`` options; its dense layers as identical experts, so the file holds E copies
of their MLPs), each in every ``--quants``; the default CMoE and a ToMoE trained 10 steps, each trained further
by distillation (``recover_tokens``), as a served model is; the ``_compared`` rows, the
folders of ``compare_recovery.py``'s run (MoRE, ToMoE, CMoE and Dense2MoE at APR 0.5, each after its own
training and the same 200,000 tokens of recovery: that run makes them); and two speed yardsticks, the dense
model with every MLP cut to the expert width of the recovered ToMoE's and of CMoE's GGUF (no routing, and no
perplexity or agreement: they predict nothing). Per row and quantisation, one JSON line in ``--out`` (with the row's
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
  time per token, its mean beside it), with ``--threads`` threads; beside it the FLOP ideal, the dense file's
  multiply-accumulates per token over the row's, counted from the files (``llamacpp_rows.file_macs``).

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
    python benchmarks/serve_llamacpp.py --quants f16,q8_0,q4_k_m --measure speed --repeats 9  # every row made here
    python benchmarks/serve_llamacpp.py --rows dense,cmoe,tomoe,cmoe_recovered,tomoe_recovered --quants q4_k_m \
        --measure speed --repeats 9 --threads 1 --out benchmarks/results/serve_llamacpp_threads1.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llamacpp_rows import (  # this folder is on sys.path when run
    ASSETS,
    HERE,
    MODEL,
    QUANTS,
    ROWS,
    Cut,
    build_of,
    conversion,
    gguf_file,
    gguf_format,
    ideal_speedup,
    kv_cache_type,
    made_here,
    native_folder,
    standard_export,
)
from llamacpp_table import markdown
from results_file import append_row

if TYPE_CHECKING:
    from torch import Tensor, nn

EVAL = ASSETS / "data" / "wikitext2_raw" / "wiki.test.raw.txt"
OUT = HERE / "results" / "serve_llamacpp.jsonl"
EVAL_CHARS, SEQ_LEN = 100_000, 2048  # bench_real's perplexity protocol
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 32, 64  # serve_vllm's agreement prompts
SPEED_PROMPT, SPEED_NEW = 512, 128

AGREEMENT_QUANTS = ("f32", "f16")
MEASURES = ("agreement", "perplexity", "speed")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(row for row in ROWS if made_here(row)),
                        help=f"comma-separated, of {', '.join(ROWS)} (default: the rows made here; the _compared "
                             "rows run compare_recovery.py's models)")
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
    build = {row: build_of(row, args.work, eval_text) for row in rows}

    def line(row: str, quant: str, path: Path, kv_cache: str) -> dict[str, Any]:
        return {"row": row, "conversion": conversion(row), "quant": quant, "format": gguf_format(path),
                "engine": "llama.cpp (llama-cpp-python 0.3.36)", "kv_cache": kv_cache, "bytes": path.stat().st_size,
                "ideal_speedup": ideal_speedup(row, path, SPEED_PROMPT + SPEED_NEW), "build": build[row]}

    for quant in quants:
        kv_cache = kv_cache_type(quant, args.kv_cache)
        paths = {row: gguf_file(row, quant, args.work, eval_text) for row in rows
                 if "speed" in measures or not isinstance(ROWS[row], Cut)}  # a yardstick is only timed
        models = [row for row in paths if not isinstance(ROWS[row], Cut)]
        for row in models if {"agreement", "perplexity"} & set(measures) else ():
            path = paths[row]
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
