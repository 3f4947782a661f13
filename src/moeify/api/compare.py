"""``moeify compare``: every method on the same calibration and evaluation text at a matched activated-
parameter ratio (APR over attention + MLP projections, MoRE Eq. 16), then one report.

Each method says how it is matched (``Method.match_budget``: the option sets to try in order), or why
it cannot be (``Method.unmatched``; it then runs with its defaults and the report shows the APR it
reached).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeify.api.convert import convert, save
from moeify.arch import DecoderAdapter
from moeify.methods import Method, get_method


def matched_options(method: Method, active: float, adapter: DecoderAdapter) -> tuple[list[dict[str, Any]], str]:
    """Option sets to try in order for ``method`` at APR ``active``, and how it was matched."""
    if method.match_budget is None:
        return [{}], f"not matched: {method.unmatched}"
    return method.match_budget(active, adapter)


def run_comparison(model: str | None, methods: list[str], active: float, out: Path, *, calib: str | None = None,
                   eval: str | None = None, seed: int = 0, progress: bool = False) -> list[dict[str, Any]]:
    """Convert with every method into ``out/<method>`` and write ``out/report``; returns one summary per
    method (its folder, the options used, how they were matched, or the error that stopped it)."""
    import moeify
    from moeify.report.build import write_report

    dense, _ = moeify.load_model(model)
    adapter = DecoderAdapter(dense)
    summaries = []
    for method in methods:
        attempts, how = matched_options(get_method(method), active, adapter)
        summary: dict[str, Any] = {"method": method, "matched": how}
        for options in attempts:
            try:
                result = convert(model, method, options, calib=calib, eval=eval, seed=seed, progress=progress)
            except ValueError as error:  # e.g. a budget this method cannot reach with these options
                summary["error"] = str(error)
                continue
            summary.update(options=options, folder=str(save(result, out / method, overwrite=True)))
            summary.pop("error", None)
            break
        summaries.append(summary)
    done = [Path(s["folder"]) for s in summaries if "folder" in s]
    if done:
        write_report(done, out / "report", overwrite=True)
    return summaries
