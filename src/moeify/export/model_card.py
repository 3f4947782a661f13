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


def model_card(record: dict[str, Any]) -> str:
    """Markdown with YAML front matter, from a conversion's (or recovery's) record."""
    method, metrics, active = record["method"], record["metrics"], record["active"]
    base = hub_id(record["model"])
    front = ["---", *([f"base_model: {base}"] if base else []), "library_name: transformers",
             "tags:", "- moe", "- moeify", f"- {method}", "---", ""]
    source = f"[{base}](https://huggingface.co/{base})" if base else f"`{Path(record['model']).name}` (a local checkpoint)"
    rows = [("perplexity, dense -> converted", f"{metrics['dense_ppl']:.3f} -> {metrics['ppl']:.3f} "
                                             f"({metrics['eval_tokens']:,} tokens of {record['data']['eval']['name']})"),
            ("activated parameter ratio (APR)", f"{active['apr']:.3f}"),
            (f"as the paper counts it ({record['paper_ratio']['kind']})", f"{record['paper_ratio']['value']:.3f}"),
            ("active / total parameters", f"{active['active_params']:,.0f} / {active['total_params']:,}")]
    if record.get("speed"):
        speed = record["speed"]
        rows.append(("speed against dense", f"{speed['speedup']:.2f}x ({speed['batch_size']} x {speed['seq_len']} "
                                            f"tokens, {record['config']['device']})"))
    if record.get("recovery"):
        recovery = record["recovery"]
        rows.append(("recovery", f"{recovery['tokens']:,} tokens distilled from the dense model (perplexity before: "
                                 f"{record['pre_recovery']['ppl']:.3f})"))
    table = ["| measured | value |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]
    body = [f"# {method} conversion of {Path(record['model']).name}", "",
            f"A Mixture-of-Experts model converted from {source} by moeify with "
            f"`{method}`: {record['paper']}.", "", *table, "",
            "Load it with transformers (its MoE layers are code in this folder):", "", "```python",
            "from transformers import AutoModelForCausalLM", "",
            'model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True)', "```", "",
            "`record.json` holds every option, measurement and library version of the run."]
    return "\n".join(front + body) + "\n"
