"""The rows of ``serve_llamacpp.py``: the SmolLM2 conversions llama.cpp runs, and their files (the native
folder, a GGUF per quantisation, a standard Hugging Face export), each made once in the work folder."""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compare_recovery import DEFAULT_RUN, RUNS  # this folder is on sys.path when run

if TYPE_CHECKING:
    from torch import nn

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
MODEL = ASSETS / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CALIB = ASSETS / "data" / "wikitext2" / "valid.txt"
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Row:
    """A conversion llama.cpp runs: made here from the SmolLM2 GGUF with ``options``, or a finished folder of
    ``compare_recovery.py``'s run (``folder``: converted at APR 0.5 and recovered with 200,000 tokens, the
    models a user would serve); ``export``: its ``moeify export`` options beyond the format."""

    method: str
    options: dict[str, Any] = field(default_factory=dict)
    export: tuple[str, ...] = ()
    folder: Path | None = None


@dataclass(frozen=True)
class Cut:
    """A speed yardstick, not a model: the dense SmolLM2 with every MLP cut to its first neurons, as many as
    the experts of row ``of``'s GGUF hold (its other weights as they are). It reads per token what a top-1
    export of that expert width reads, without routing: the generation speed such an export can at best
    reach in llama.cpp. Only speed is measured on it (it predicts nothing)."""

    of: str


COMPARED = RUNS[DEFAULT_RUN].out
# row -> its conversion; None: the dense model
ROWS: dict[str, Row | Cut | None] = {
    "dense": None,
    "more": Row("more"),
    # ToMoE's routers trained for compare_recovery.py's budget (its default is 600 steps, hours on this CPU)
    "tomoe": Row("tomoe", {"attention": "off", "steps": 250, "checkpoint_every": 0}),
    "cmoe": Row("cmoe", export=("--approximate",)),
    "dense2moe": Row("dense2moe", {"steps": 30, "lr": 1e-4, "seq_len": 256, "checkpoint_every": 0}),
    # the default CMoE and a 10-step ToMoE (routers barely trained: narrow experts, routing margins that
    # rounding crosses) trained further by distillation (`recover_tokens`), as a served model is
    "cmoe_recovered": Row("cmoe", {"recover_tokens": 100_000, "recover_lm_share": 0.0, "recover_recompute": False},
                          ("--approximate",)),
    "tomoe_recovered": Row("tomoe", {"attention": "off", "steps": 10, "checkpoint_every": 0,
                                     "recover_tokens": 200_000, "recover_lm_share": 0.0, "recover_recompute": False}),
    # the comparison's rows (each method's own training, then the same recovery): what a user would serve;
    # CMoE's router and ToMoE's per-token attention dimensions (on by default) through ``--approximate``
    **{f"{method}_compared": Row(method, export=("--approximate",) if method in ("cmoe", "tomoe") else (),
                                 folder=COMPARED / method) for method in ("more", "tomoe", "cmoe", "dense2moe")},
    # yardsticks: the dense model as wide per token as the top-1 exports of the 10-step ToMoE and of CMoE
    "dense_tomoe_width": Cut("tomoe_recovered"),
    "dense_cmoe_width": Cut("cmoe"),
}
QUANTS = ("f32", "f16", "q8_0", "q4_k_m")


def moeify_cli(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "moeify", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"moeify {' '.join(args)} failed:\n{done.stderr[-3000:]}")


def made_here(row: str) -> bool:
    """Whether this script makes ``row`` (the ``_compared`` rows run ``compare_recovery.py``'s models)."""
    definition = ROWS[row]
    return not isinstance(definition, Row) or definition.folder is None


def cut_width(row: str, work: Path, eval_text: Path) -> int:
    """The expert width of a yardstick's row, from that row's f16 GGUF (the width every layer's experts are
    padded to: what llama.cpp reads per expert)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_file(ROWS[row].of, "f16", work, eval_text))
    arch = reader.fields["general.architecture"].contents()
    return int(reader.fields[f"{arch}.feed_forward_length"].contents())


def dense_model(width: int | None = None) -> nn.Module:
    """The dense SmolLM2 in float32, with every MLP cut to its first ``width`` neurons where one is given."""
    import torch

    from moeify.loading import load_model

    model = load_model(str(MODEL), dtype="float32")[0]
    if width is not None:
        for layer in model.model.layers:
            mlp = layer.mlp
            for linear in (mlp.gate_proj, mlp.up_proj):
                linear.weight = torch.nn.Parameter(linear.weight[:width].clone())
                linear.out_features = width
            mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight[:, :width].clone())
            mlp.down_proj.in_features = width
        model.config.intermediate_size = width
    return model


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
    """``row``'s GGUF in ``quant`` (written once): the dense model (or a yardstick cut from it) through the
    llama form, an export through ``moeify export --format gguf``."""
    width = cut_width(row, work, eval_text) if isinstance(ROWS[row], Cut) else None
    out = work / (f"{row}.{quant}.gguf" if width is None else f"dense_mlp{width}.{quant}.gguf")  # by what it holds
    if out.is_file():
        return out
    if not isinstance(ROWS[row], Row):
        from moeify.export.gguf import vocabulary, write_gguf
        from moeify.export.hf_export import HfExport

        model = dense_model(width)
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
    if isinstance(definition, Cut):
        return {"method": "dense", "mlp_cut_to_the_expert_width_of": definition.of}
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


def kv_cache_type(quant: str, asked: str) -> str:
    """The KV cache's type for a file in ``quant``: ``asked``, or for ``auto`` float32 with an f32 file (so
    the file alone is measured against the native float32 model) and llama.cpp's default f16 otherwise."""
    return asked if asked != "auto" else "f32" if quant == "f32" else "f16"


def build_of(row: str, work: Path, eval_text: Path) -> str | None:
    """Which conversion of ``row`` was measured (None for the dense model): the start of the sha256 of its
    ``record.json``, which each conversion writes anew (timings included), so the table takes no line of a
    conversion made again since, even of the same definition; a yardstick's is its row's."""
    if ROWS[row] is None:
        return None
    if isinstance(ROWS[row], Cut):
        return build_of(ROWS[row].of, work, eval_text)
    return hashlib.sha256((native_folder(row, work, eval_text) / "record.json").read_bytes()).hexdigest()[:12]


def ideal_speedup(row: str, path: Path, context: int) -> float | None:
    """The dense model's multiply-accumulates per token over those of ``row``'s GGUF file ``path`` (``file_macs``:
    what llama.cpp computes, the experts' zero padding included; the same in every quantisation), at ``context``
    tokens; None for the dense model."""
    return None if ROWS[row] is None else dense_macs(context) / file_macs(path, context)


@functools.cache
def dense_macs(context: int) -> float:
    """The dense model's multiply-accumulates per token at ``context`` tokens (``file_macs`` of its file counts
    the same), loaded once for every row."""
    from moeify.evaluation.speed import macs_per_token

    return macs_per_token(dense_model(), context)


def file_macs(path: Path, context: int) -> float:
    """Multiply-accumulates per token of the model in the GGUF file ``path``, by ``macs_per_token``'s
    accounting on the file's own tensors: every matrix a token multiplies, each layer's experts at top-k of E
    of their stored (padded) width, the attention scores over ``context`` / 2 keys on average (QK^T and AV),
    and the output head (the embedding where the file ties it); routers and norms left out (small)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    experts = reader.fields.get(f"{arch}.expert_count")
    share = reader.fields[f"{arch}.expert_used_count"].contents() / experts.contents() if experts else 1.0
    names = {tensor.name for tensor in reader.tensors}
    macs = 0.0
    for tensor in reader.tensors:
        name = tensor.name
        if len(tensor.shape) < 2 or name.endswith("ffn_gate_inp.weight") or (
                name == "token_embd.weight" and "output.weight" in names):  # a lookup where the head is its own
            continue
        macs += int(tensor.n_elements) * (share if "_exps." in name else 1.0)
    hidden = reader.fields[f"{arch}.embedding_length"].contents()
    return macs + reader.fields[f"{arch}.block_count"].contents() * context * hidden
