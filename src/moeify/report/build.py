"""``moeify report``: a markdown table and PNG plots from the records of several runs.

Plots: perplexity against the activated-parameter ratio with the Pareto front (lower-left is better),
per-layer expert load (share of tokens per expert, one panel per run with routed layers), routing JSD
per layer, and the measured speed-up against the dense model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeify.evaluation.record import describe_change, read_record


def read_runs(folders: list[Path]) -> list[dict[str, Any]]:
    runs = []
    for folder in folders:
        record = read_record(folder)
        record["_name"] = Path(folder).name
        runs.append(record)
    if not runs:
        raise ValueError("moeify report needs at least one run folder")
    return runs


def markdown_table(runs: list[dict[str, Any]]) -> str:
    """One row per run, by APR; runs that were recovered add their perplexity before the recovery and the
    recovery's tokens and time."""
    recovered = any(r.get("recovery") for r in runs)
    extra = " ppl before recovery | recovery tokens | recovery s |" if recovered else ""
    head = (f"| run | method | dense ppl | ppl | change +- sampling error | APR (measured) | APR (nominal) | MLP ratio "
            f"| speed-up | convert s |{extra}\n|{'---|' * (10 + 3 * recovered)}\n")
    rows = []
    for r in sorted(runs, key=lambda r: r["active"]["apr"]):
        speed = f"{r['speed']['speedup']:.2f}x" if r.get("speed") else "-"
        nominal = f"{r['nominal_active']['apr']:.3f}" if r.get("nominal_active") else "-"  # None: data-dependent
        row = (f"| {r['_name']} | {r['method']} | {r['metrics']['dense_ppl']:.3f} | {r['metrics']['ppl']:.3f} | "
               f"{_change(r['metrics'])} | {r['active']['apr']:.3f} | {nominal} | "
               f"{r['active']['mlp_ratio']:.3f} | {speed} | {r['timings']['convert_s']:.1f} |")
        if recovered:
            recovery = r.get("recovery")
            row += (" - | - | - |" if not recovery else f" {r['pre_recovery']['ppl']:.3f} | {recovery['tokens']:,} | "
                                                          f"{recovery['wall_s']:.0f} |")
        rows.append(row)
    return head + "\n".join(rows) + "\n"


def settings(runs: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The runs grouped by what makes their perplexities comparable: the base model and the evaluation text
    (by content). Runs of different groups belong on no common front."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        text = r.get("data", {}).get("eval", {})
        groups.setdefault((str(r.get("model")), str(text.get("sha256") or text.get("name"))), []).append(r)
    return groups


def settings_note(runs: list[dict[str, Any]]) -> str:
    """A warning where the runs differ in base model or evaluation text (else nothing): their perplexities
    are not comparable across settings, and each setting gets its own front."""
    groups = settings(runs)
    if len(groups) < 2:
        return ""
    lines = [f"- setting {n}: {group[0].get('model')}, evaluated on {group[0].get('data', {}).get('eval', {}).get('name')}"
             f" ({', '.join(r['_name'] for r in group)})" for n, group in enumerate(groups.values(), start=1)]
    return (f"**These runs differ in base model or evaluation text ({len(groups)} settings): compare perplexities "
            "only within a setting; the plot draws a front per setting.**\n\n" + "\n".join(lines) + "\n")


def bench_table(runs: list[dict[str, Any]]) -> str:
    """The ``moeify bench`` results kept in the records (eager and compiled): each prefill shape's and decode
    batch size's speed-up against the dense model, or "" where no run was benched."""
    lines = [f"| {r['_name']} | {mode} ({b['device']}) | "
             + ", ".join(f"{p['batch_size']}x{p['seq_len']}: {p['speedup']:.2f}x" for p in b["prefill"]) + " | "
             + ", ".join(f"b={d['batch_size']}: {d['speedup']:.2f}x" for d in b["decode"])
             + f" | {b['ideal_speedup']:.2f}x |"
             for r in runs for mode, b in sorted(r.get("bench", {}).items())]
    if not lines:
        return ""
    return ("\n## moeify bench (MoE / dense tokens/s, same process)\n\n| run | mode | prefill | decode | ideal |\n"
            "|---|---|---|---|---|\n" + "\n".join(lines) + "\n")


def recovery_curve(record: dict[str, Any]) -> list[tuple[int, float]]:
    """(tokens, perplexity) of a recovered run: before it (0 tokens), at each milestone, at the end."""
    recovery = record["recovery"]
    points = [(0, record["pre_recovery"]["ppl"])] + [(p["tokens"], p["ppl"]) for p in recovery["curve"]]
    return points + [(recovery["tokens"], record["metrics"]["ppl"])]


def _change(metrics: dict[str, Any]) -> str:
    """The perplexity change against the dense model with its sampling error ("-" in records that predate it)."""
    if metrics.get("ppl_change") is None:
        return "-"
    return describe_change(metrics["ppl_change"], metrics.get("ppl_change_stderr"))


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats in both coordinates (lower is better in both)."""
    return [i for i, (x, y) in enumerate(points)
            if not any((x2 <= x and y2 <= y) and (x2, y2) != (x, y) for x2, y2 in points)]


def _figure(plt, width: float = 6.0, height: float = 4.0):
    return plt.subplots(figsize=(width, height), dpi=120)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(plt, fig) -> bytes:
    import io

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def recovery_plot(curves: dict[str, list[tuple[int, float]]], dense_ppl: float) -> bytes:
    """PNG of perplexity against recovery tokens, one line per run (name -> its ``recovery_curve``); it needs
    only the curves, so a comparison whose run folders are gone can still be drawn from its rows."""
    plt = _pyplot()
    fig, ax = _figure(plt)
    for name, curve in curves.items():
        ax.plot([t for t, _ in curve], [ppl for _, ppl in curve], marker="o", label=name)
    ax.axhline(dense_ppl, color="black", lw=0.8, label=f"dense ({dense_ppl:.2f})")
    ax.set(xlabel="recovery tokens", ylabel="perplexity (log scale)", yscale="log",
           title="Perplexity against recovery tokens")
    ax.xaxis.set_major_formatter(lambda tokens, _: f"{tokens / 1000:g}k")
    ax.legend(fontsize=8)
    return _png(plt, fig)


def plots(runs: list[dict[str, Any]]) -> dict[str, bytes]:
    """PNG bytes by file name."""
    plt = _pyplot()

    def png(fig) -> bytes:
        return _png(plt, fig)

    out = {}
    fig, ax = _figure(plt)
    points = [(r["active"]["apr"], r["metrics"]["ppl"]) for r in runs]
    for n, (r, (x, y)) in enumerate(zip(runs, points)):
        ax.scatter(x, y, s=36)
        # runs at (nearly) the same point get their labels stacked, not printed over each other
        twins = sum(1 for px, py in points[:n] if abs(px - x) < 0.01 and abs(py - y) <= 0.03 * max(py, y))
        ax.annotate(r["_name"], (x, y), textcoords="offset points", xytext=(4, 4 - 10 * twins), fontsize=8)
    groups = list(settings(runs).values())
    for n, group in enumerate(groups, start=1):  # one front per setting: no front across base models or texts
        own = [(r["active"]["apr"], r["metrics"]["ppl"]) for r in group]
        front = sorted(own[i] for i in pareto_front(own))
        suffix = f" (setting {n})" if len(groups) > 1 else ""
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", label=f"Pareto front{suffix}")
        dense = group[0]["metrics"]["dense_ppl"]
        ax.axhline(dense, color="black", lw=0.8, ls=":" if n > 1 else "-", label=f"dense{suffix} ({dense:.2f})")
    ax.set(xlabel="activated-parameter ratio (APR, measured)", ylabel="perplexity (log scale)", yscale="log",
           title="Quality vs activated parameters")
    ax.legend(fontsize=8)
    out["pareto.png"] = png(fig)

    routed = [r for r in runs if r.get("routing")]
    if routed:
        fig, axes = plt.subplots(len(routed), 1, figsize=(6.5, 1.9 * len(routed) + 0.6), dpi=120, squeeze=False)
        for ax, r in zip(axes[:, 0], routed):
            loads = [[c / max(1, sum(layer["load"])) for c in layer["load"]] for layer in r["routing"]]
            width = max(len(load) for load in loads)
            grid = [load + [float("nan")] * (width - len(load)) for load in loads]
            image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0)
            ax.set(title=f"{r['_name']}: share of tokens per expert", xlabel="expert", ylabel="layer", xticks=range(width),
                   yticks=range(len(loads)), yticklabels=[layer["layer"].split(".")[-2] for layer in r["routing"]])
            fig.colorbar(image, ax=ax)
        out["expert_load.png"] = png(fig)

        fig, ax = _figure(plt)
        for r in routed:
            ax.plot([layer["layer"].split(".")[-2] for layer in r["routing"]],
                    [layer["jsd"] for layer in r["routing"]], marker="o", label=r["_name"])
        ax.set(xlabel="layer", ylabel="JSD to uniform (bits)", title="Routing divergence per layer (MoRE Eq. 18)")
        ax.legend(fontsize=8)
        out["routing_jsd.png"] = png(fig)

    recovered = [r for r in runs if r.get("recovery")]
    if recovered:
        out["recovery.png"] = recovery_plot({r["_name"]: recovery_curve(r) for r in recovered},
                                            recovered[0]["metrics"]["dense_ppl"])

    timed = [r for r in runs if r.get("speed")]
    if timed:
        fig, ax = _figure(plt)
        ax.bar([r["_name"] for r in timed], [r["speed"]["speedup"] for r in timed], color="#55A868")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set(ylabel="MoE / dense tokens/s", title="Measured speed-up (same run)")
        ax.tick_params(axis="x", rotation=30)
        out["speedup.png"] = png(fig)
    return out


def write_report(folders: list[Path], out: Path, overwrite: bool = False) -> Path:
    """Write ``report.md`` and the plots into ``out`` (atomically); ``out`` may not be, hold or lie inside a run."""
    from moeify.files import atomic_dir, check_not_an_input

    check_not_an_input(out, folders)
    runs = read_runs(folders)
    images = plots(runs)
    with atomic_dir(out, overwrite=overwrite, command="report") as tmp:
        text = ("# moeify report\n\n" + settings_note(runs) + markdown_table(runs) + bench_table(runs) + "\n"
                + "".join(f"![{name}]({name})\n" for name in images))
        (tmp / "report.md").write_text(text)
        for name, content in images.items():
            (tmp / name).write_bytes(content)
    return out
