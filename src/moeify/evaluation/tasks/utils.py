"""Document processing that lm-eval loads next to moeify's task YAMLs (``!function utils.<name>``).

Lives beside the YAMLs because lm-eval resolves ``!function`` relative to the YAML's folder; it imports
nothing, so it costs nothing when moeify is imported without lm-eval."""

from __future__ import annotations

import re
from typing import Any


def clean_hellaswag(text: str) -> str:
    """HellaSwag's text clean-up as lm-eval does it: WikiHow's " [title]" markers become sentence breaks,
    other bracketed artefacts ("[header]", "[step]") are dropped, and the double spaces left behind
    collapse -- scores are only comparable with published ones on the same text."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def process_hellaswag(dataset: Any) -> Any:
    """Map raw HellaSwag rows (ctx_a, ctx_b, activity_label, endings, label) to query/choices/gold; the
    second context part starts a sentence, hence the capitalisation."""
    def one(doc: dict[str, Any]) -> dict[str, Any]:
        context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {"query": clean_hellaswag(doc["activity_label"] + ": " + context),
                "choices": [clean_hellaswag(ending) for ending in doc["endings"]],
                "gold": int(doc["label"])}

    return dataset.map(one)
