"""Training curves of runs, side by side (`megadlms plot RUN_DIR [RUN_DIR ...] --output curves.png`).

Reads each run's `metrics.jsonl` (written by `megadlms train` into --save, or --tensorboard-dir) and draws, one
colour per run: the training loss, the validation loss (the ELBO; an AR run's exact NLL), tokens/s and, for runs
logged with --fp8-stats, the FP8 amax and underflow per tensor role. A resumed run's repeated iterations keep their
last record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..errors import import_extra
from ..jsonl import read_jsonl


def read_metrics(run: str | Path) -> dict[str, list[dict[str, Any]]]:
    """{'train': [...], 'valid': [...]} records of a run's metrics.jsonl, by iteration, the last of repeats."""
    path = Path(run)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"{run}: no metrics.jsonl there; pass the --save (or --tensorboard-dir) folder of a "
                         "`megadlms train` run")
    by_split: dict[str, dict[int, dict[str, Any]]] = {}
    for _, rec in read_jsonl(path):
        if "iteration" in rec:
            by_split.setdefault(rec.get("split", "train"), {})[int(rec["iteration"])] = rec
    return {split: [recs[i] for i in sorted(recs)] for split, recs in by_split.items()}


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["iteration"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def plot_runs(runs: list[str], output: str, labels: list[str] | None = None, title: str | None = None) -> Path:
    """Draw the runs' curves into `output`; returns its path."""
    mpl = import_extra("matplotlib", "plot", "megadlms plot")
    mpl.use("Agg")
    import matplotlib.pyplot as plt

    if labels is not None and len(labels) != len(runs):
        raise ConfigError(f"--labels has {len(labels)} names for {len(runs)} runs")
    data = [read_metrics(r) for r in runs]
    names = labels or [Path(r).name if Path(r).is_dir() else Path(r).parent.name for r in runs]
    fp8_keys = sorted({k for d in data for r in d.get("train", []) for k in r if k.startswith("fp8/")})
    roles = sorted({k[4:].rsplit("_", 1)[0] for k in fp8_keys})
    panels = ["loss", "valid", "tokens_per_s"] + (["amax", "underflow"] if fp8_keys else [])
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    titles = {"loss": "training loss", "valid": "validation loss (ELBO; AR: NLL)", "tokens_per_s": "tokens / s",
              "amax": "FP8 amax per role", "underflow": "FP8 underflow fraction per role"}
    for ax, panel in zip(axes.flat, panels):
        ax.set_title(titles[panel])
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        for i, (d, name) in enumerate(zip(data, names)):
            color = colors[i % len(colors)]
            if panel in ("loss", "tokens_per_s"):
                ax.plot(*_series(d.get("train", []), panel), color=color, label=name)
            elif panel == "valid":
                ax.plot(*_series(d.get("valid", []), "loss"), color=color, marker="o", ms=3, label=name)
            else:
                for j, role in enumerate(roles):
                    x, y = _series(d.get("train", []), f"fp8/{role}_{panel}")
                    if x:
                        ax.plot(x, y, color=color, ls=styles[j % len(styles)], label=f"{name} {role}")
                ax.set_yscale("log" if panel == "amax" else "symlog", **({} if panel == "amax" else
                                                                        {"linthresh": 1e-6}))
        if ax.lines:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
