"""``moeify compare``: every method on the same calibration and evaluation text at a matched activated-
parameter ratio (APR over attention + MLP projections, MoRE Eq. 16), then one report.

How each method is matched (where it can be):
- ``cmoe``, ``random_split``: the S/A/E spec (E in 8/16/32, S and A as equal as possible) whose MLP
  share (S+A)/E is closest to the MLP share the target APR needs.
- ``more``: ``target_pr = 1 - active`` on its default middle-deep layers, or on every layer when the
  default layers cannot reach it.
- ``static_prune`` and ``tomoe``: ``active_ratio = active``.
- ``dsmoe`` learns its sparsity (the threshold sets it, not a budget) and ``dense2moe`` removes whole
  attention blocks: they run with their defaults and the report shows the APR they reached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeify.arch import DecoderAdapter

UNMATCHED = {"dsmoe": "sparsity is learned (threshold tau), not set by a budget",
             "dense2moe": "removes whole attention blocks; its APR follows from the pruned layers"}


def cmoe_spec(mlp_share: float) -> str:
    """The SxAyEz closest to ``mlp_share`` = (S+A)/E, preferring fewer experts, then S = A."""
    best = min(((s, a, e) for e in (8, 16, 32) for s in range(1, e) for a in range(1, e - s + 1)),
               key=lambda sae: (round(abs((sae[0] + sae[1]) / sae[2] - mlp_share), 4), sae[2], abs(sae[0] - sae[1])))
    return f"S{best[0]}A{best[1]}E{best[2]}"


def matched_options(method: str, active: float, adapter: DecoderAdapter) -> tuple[list[dict[str, Any]], str]:
    """Option sets to try in order for ``method`` at APR ``active``, and how it was matched."""
    n = adapter.num_layers
    attn = sum(adapter.attention_params(i) for i in range(n))
    mlp = sum(adapter.dense_mlp_params(i) for i in range(n))
    share = (active * (attn + mlp) - attn) / mlp
    if method in ("cmoe", "random_split"):
        spec = cmoe_spec(share)
        return [{"spec": spec}], f"spec={spec} (MLP share {share:.3f} needed)"
    if method == "more":
        every = ",".join(map(str, range(n)))
        return [{"target_pr": 1 - active}, {"target_pr": 1 - active, "layers": every}], f"target_pr={1 - active:.3f}"
    if method in ("static_prune", "tomoe"):
        return [{"active_ratio": active}], f"active_ratio={active}"
    return [{}], f"not matched: {UNMATCHED.get(method, 'no budget option')}"


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
        attempts, how = matched_options(method, active, adapter)
        summary: dict[str, Any] = {"method": method, "matched": how}
        for options in attempts:
            try:
                result = moeify.convert(model, method, options, calib=calib, eval=eval, seed=seed, progress=progress)
            except ValueError as error:  # e.g. a budget this method cannot reach with these options
                summary["error"] = str(error)
                continue
            summary.update(options=options, folder=str(moeify.save(result, out / method, overwrite=True)))
            summary.pop("error", None)
            break
        summaries.append(summary)
    done = [Path(s["folder"]) for s in summaries if "folder" in s]
    if done:
        write_report(done, out / "report", overwrite=True)
    return summaries
