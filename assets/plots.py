"""Pictures for the materialization page: saved as PNG beside the artifact and shown inline."""

import base64
from pathlib import Path

from habitus.models.storage.files import atomic_path


def _pyplot():
    """matplotlib's pyplot on the Agg backend (no display; imported when a picture is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _saved(fig, path: Path, title: str) -> str:
    """Save `fig` as PNG to `path` and close it; returns markdown that shows the picture in the UI."""
    plt = _pyplot()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:  # a killed run never leaves half a picture
        fig.savefig(tmp, format="png")
    plt.close(fig)
    encoded = base64.b64encode(path.read_bytes()).decode()
    return f"![{title}](data:image/png;base64,{encoded})\n\n`{path}`"


def loss_curves(curves: dict[str, list[float]], path: Path, title: str) -> str:
    """Plot each curve per epoch to `path`; returns markdown that shows the picture in the UI."""
    fig, ax = _pyplot().subplots(figsize=(5, 3), dpi=100)
    for name, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", label=name.replace("_", " "))
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    return _saved(fig, path, title)


def calibration_and_lift(y, p, path: Path, title: str) -> str:
    """For a binary scenario on the hold-out: the observed rate against the predicted probability by
    decile (calibration), and the share of positives found when targeting the top x% (cumulative gains,
    against random targeting). Returns markdown that shows the picture in the UI."""
    import numpy as np

    y, p = np.asarray(y, float), np.asarray(p, float)
    order = np.argsort(-p, kind="stable")
    bins = np.array_split(order, 10)
    fig, (cal, gain) = _pyplot().subplots(1, 2, figsize=(9, 3.6), dpi=100)
    cal.plot([0, 1], [0, 1], ls="--", c="grey", lw=1, label="perfect")
    cal.plot([p[b].mean() for b in bins], [y[b].mean() for b in bins], marker="o", label="model (deciles)")
    cal.set_xlabel("predicted probability")
    cal.set_ylabel("observed rate")
    cal.set_title("calibration")
    cal.legend()
    share = np.arange(1, len(y) + 1) / len(y)
    found = np.cumsum(y[order]) / max(y.sum(), 1)
    gain.plot(np.r_[0, share], np.r_[0, found], label="model")
    gain.plot([0, 1], [0, 1], ls="--", c="grey", lw=1, label="random")
    top = max(1, len(y) // 10)
    lift = (y[order[:top]].mean() / max(y.mean(), 1e-12)) if len(y) else float("nan")
    gain.set_xlabel("share of entities targeted (highest scores first)")
    gain.set_ylabel("share of positives found")
    gain.set_title(f"gains (top 10%: {lift:.2f}x lift)")
    gain.legend()
    fig.suptitle(title)
    return _saved(fig, path, title)


def importance_chart(importance: list[tuple[str, str, float]], path: Path, title: str, rows: int = 15) -> str:
    """Horizontal bars of mean |attribution| by source.column, largest on top; markdown showing it."""
    shown = importance[:rows][::-1]
    fig, ax = _pyplot().subplots(figsize=(6, 0.35 * len(shown) + 1.2), dpi=100)
    ax.barh([f"{s}.{c}" for s, c, _ in shown], [v for _, _, v in shown], color="#4878a8")
    ax.set_xlabel("mean |attribution| (score units)")
    ax.set_title(title)
    return _saved(fig, path, title)
