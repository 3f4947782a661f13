"""The model card (``README.md``) of a converted folder: the Hugging Face metadata block that the hub reads when
a user publishes the folder (base model, library, tags), and what the record measured, so that the numbers
travel with the weights."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# A hub repository id: "name" or "owner/name", of the characters the hub allows
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def hub_id(model: str) -> str | None:
    """``model`` as a hub repository id, or None for a local folder or file, which the hub cannot name."""
    if model.startswith(("embedded:", ".", "/", "~")) or Path(model).exists() or not _HUB_ID.match(model):
        return None
    return model


def _measured(record: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows of what the record measured (a record written by hand, e.g. a test's, may hold none)."""
    rows = []
    if "metrics" in record:
        metrics = record["metrics"]
        evaluated = f"{metrics['eval_tokens']:,} tokens of {record['data']['eval']['name']}"
        rows.append(("perplexity, dense -> converted",
                     f"{metrics['dense_ppl']:.3f} -> {metrics['ppl']:.3f} ({evaluated})"))
    if "active" in record:
        active = record["active"]
        rows += [("activated parameter ratio (APR)", f"{active['apr']:.3f}"),
                 ("active / total parameters", f"{active['active_params']:,.0f} / {active['total_params']:,}")]
    if "paper_ratio" in record:
        ratio = record["paper_ratio"]
        rows.append((f"as the paper counts it ({ratio.get('label', ratio['kind'])})", f"{ratio['value']:.3f}"))
    if record.get("speed"):
        speed = record["speed"]
        rows.append(("speed against dense", f"{speed['speedup']:.2f}x ({speed['batch_size']} x {speed['seq_len']} "
                                            f"tokens, {record['config']['device']})"))
    if record.get("recovery"):
        rows.append(("recovery", f"{record['recovery']['tokens']:,} tokens distilled from the dense model (perplexity "
                                 f"before: {record['pre_recovery']['ppl']:.3f})"))
    return rows


def model_card(record: dict[str, Any]) -> str:
    """Markdown with YAML front matter, from a conversion's (or recovery's) record."""
    method, model = record["method"], record.get("model")
    base = None if model is None else hub_id(str(model))
    front = ["---", *([f"base_model: {base}"] if base else []), "library_name: transformers",
             "tags:", "- moe", "- moeify", f"- {method}", "---", ""]
    name = "a dense model" if model is None else Path(str(model)).name
    local = name if model is None else f"`{name}` (a local checkpoint)"
    source = f"[{base}](https://huggingface.co/{base})" if base else local
    rows = _measured(record)
    table = ["| measured | value |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)] if rows else []
    paper = f": {record['paper']}" if "paper" in record else ""
    body = [f"# {method} conversion of {name}", "",
            f"A Mixture-of-Experts model converted from {source} by moeify with `{method}`{paper}.", "", *table,
            *([""] if table else []), "Load it with transformers (its MoE layers are code in this folder):", "",
            "```python", "from transformers import AutoModelForCausalLM", "",
            'model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True)', "```", "",
            "`record.json` holds every option, measurement and library version of the run."]
    return "\n".join(front + body) + "\n"
