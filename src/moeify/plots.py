"""Small PNG figures written next to a converted model (matplotlib is imported only when drawing)."""

from __future__ import annotations

import io


def per_layer_bars(labels: list[str], values: list[float], *, title: str, ylabel: str) -> bytes:
    """A bar per layer, e.g. the routing JSD of MoRE's Fig. 2. Returns PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(values) + 2), 3.2), dpi=120)
    ax.bar(range(len(values)), values, color="#4C72B0")
    ax.set_xticks(range(len(values)), labels, rotation=0 if len(values) < 12 else 90)
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def heatmap(values: list[list[float]], *, row_labels: list[str], title: str, xlabel: str,
            vmax: float | None = None) -> bytes:
    """A rows x columns heatmap with each cell's value written in it (e.g. DSMoE's Fig. 3: evaluation
    files x layers). Returns PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = len(values[0])
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * columns + 3), 1.0 + 0.5 * len(values)), dpi=120)
    image = ax.imshow(values, cmap="viridis", vmin=0, vmax=vmax, aspect="auto")
    for r, row in enumerate(values):
        for c, value in enumerate(row):
            ax.text(c, r, f"{value:.2f}", ha="center", va="center", color="white", fontsize=8)
    ax.set_xticks(range(columns), [str(c) for c in range(columns)])
    ax.set_yticks(range(len(values)), row_labels)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def training_curves(curves: dict[str, list[float]], *, title: str) -> bytes:
    """One small panel per logged quantity against the optimizer step (e.g. ToMoE's Fig. 3: KD loss, R_P,
    R_U, R_L). Returns PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(curves)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.0), dpi=120, squeeze=False)
    for ax, name in zip(axes[0], names):
        ax.plot(range(1, len(curves[name]) + 1), curves[name], color="#4C72B0", linewidth=1.2)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
