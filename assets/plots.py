"""Pictures for the materialization page: saved as PNG beside the artifact and shown inline."""

import base64
from pathlib import Path


def loss_curves(curves: dict[str, list[float]], path: Path, title: str) -> str:
    """Plot each curve per epoch to `path`; returns markdown that shows the picture in the UI."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3), dpi=100)
    for name, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", label=name.replace("_", " "))
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    encoded = base64.b64encode(path.read_bytes()).decode()
    return f"![{title}](data:image/png;base64,{encoded})\n\n`{path}`"
