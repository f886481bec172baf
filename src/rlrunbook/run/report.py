"""``report.png``: the curves a person looks at after a run (reward, loss, length, learning signal).

Drawn with matplotlib's object API on an Agg canvas, not ``pyplot``: no global figure state and
no dependence on whatever backend the user's environment selects (a GPU box has no display).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlrunbook.errors import InputError
from rlrunbook.run.jsonio import fsync_dir


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    """``key`` of every row as floats; NaN where absent, so a gap shows as a gap, not a zero."""
    out = []
    for row in rows:
        value = row.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        out.append(float(value) if ok else math.nan)
    return out


def _has(rows: Sequence[Mapping[str, Any]], key: str) -> bool:
    return any(key in row for row in rows)


def _plot_debate_rewards(ax, steps: list, rows: Sequence[Mapping[str, Any]]) -> None:
    """Debate: the verdict win rate (what ``reward`` holds: 0.5 by construction, one winner per debate) beside
    the task reward of the winners (what rejection and rs_grpo train on) and of every debater."""
    ax.plot(steps, _series(rows, "verdict/win_rate"), marker="o", linestyle=":",
            label="verdict win rate (0.5 by construction)")
    if _has(rows, "task_reward/winners_mean"):
        ax.plot(steps, _series(rows, "task_reward/winners_mean"), marker="s", label="task reward, winners (trained)")
    ax.plot(steps, _series(rows, "task_reward/mean"), marker="^", label="task reward, all debaters")
    ax.legend(loc="best", fontsize="small")


def _plot_validation(ax, rows: Sequence[Mapping[str, Any]]) -> None:
    """Held-out mean reward and pass@k per validation, each with its bootstrap interval as error bars."""
    rows = sorted(rows, key=lambda row: row.get("step", 0))
    steps = [row.get("step", i) for i, row in enumerate(rows)]
    keys = ["mean_reward"] + sorted({k for row in rows for k in row if k.startswith("pass@") and "_" not in k},
                                    key=lambda k: int(k[len("pass@"):]))
    for key in keys:
        ci_key = "mean_ci" if key == "mean_reward" else f"{key}_ci"
        values = _series(rows, key)
        below, above = [], []
        for row, value in zip(rows, values, strict=True):
            ci = row.get(ci_key)
            ok = isinstance(ci, list) and len(ci) == 2 and math.isfinite(value)
            below.append(max(0.0, value - ci[0]) if ok else 0.0)
            above.append(max(0.0, ci[1] - value) if ok else 0.0)
        ax.errorbar(steps, values, yerr=[below, above], marker="o", capsize=3, label=key)
    ax.legend(loc="best", fontsize="small")


def plot_report(
    train_log_rows: Sequence[Mapping[str, Any]], out_path: str | os.PathLike[str], title: str | None = None,
    validation_rows: Sequence[Mapping[str, Any]] = (),
) -> Path:
    """Write a PNG of per-step curves from train-log rows; ``title`` defaults to the run directory name.

    Panels: reward mean with its min-max band, ``loss/sum``, mean completion length, and the
    non-zero advantage fraction (or count) when logged; with ``validation_rows`` (validation.jsonl)
    a last panel of held-out mean reward and pass@k with their intervals. Every point has a
    marker, so a one-step run still shows its values.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    if not train_log_rows:
        raise InputError(f"no train-log rows to plot into {out_path}: the run logged no step")
    out_path = Path(out_path)
    rows = sorted(train_log_rows, key=lambda row: row.get("step", 0))
    steps = [row.get("step", i) for i, row in enumerate(rows)]

    panels: list[tuple[str, str]] = [
        ("reward/mean", "reward"),
        ("loss/sum", "loss (sum)"),
        ("completion_length/mean", "completion length (tokens)"),
    ]
    for key, label in (
        ("advantage/nonzero_fraction", "non-zero advantage fraction"),
        ("advantage/nonzero_count", "non-zero advantages"),
    ):
        if _has(rows, key):
            panels.append((key, label))
            break

    count = len(panels) + bool(validation_rows)
    fig = Figure(figsize=(4.5 * count, 3.6))
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.14, top=0.82, wspace=0.3)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, count, squeeze=False)[0]
    if validation_rows:
        _plot_validation(axes[-1], validation_rows)
        axes[-1].set_title("validation (held-out)")
        axes[-1].set_xlabel("optimizer steps applied")
        axes[-1].grid(True, alpha=0.3)
        axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    debate = _has(rows, "verdict/win_rate")
    for ax, (key, label) in zip(axes[:len(panels)], panels, strict=True):
        if key == "reward/mean" and debate:
            _plot_debate_rewards(ax, steps, rows)
            label = "debate: verdict and task reward"
        else:
            ax.plot(steps, _series(rows, key), marker="o", label=key)
        if key == "reward/mean" and not debate and _has(rows, "task_reward/mean"):
            ax.plot(steps, _series(rows, "task_reward/mean"), marker="s", label="task_reward/mean")
        if key == "reward/mean" and not debate and _has(rows, "reward/min") and _has(rows, "reward/max"):
            low, high = _series(rows, "reward/min"), _series(rows, "reward/max")
            if len(steps) > 1:
                ax.fill_between(steps, low, high, alpha=0.25, label="min-max")
            else:  # a band over one x has no width: draw the range as a bar
                ax.vlines(steps, low, high, alpha=0.5, linewidth=6, label="min-max")
            ax.legend(loc="best", fontsize="small")
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(steps) == 1:  # a lone point would otherwise sit on an autoscaled axis of width 0
            ax.set_xlim(steps[0] - 1, steps[0] + 1)
    fig.suptitle(title if title is not None else out_path.parent.name)

    # Same-directory temp file + rename, like the JSON artifacts: the rubric never sees half a PNG.
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    try:
        with open(tmp, "wb") as handle:
            fig.savefig(handle, format="png", dpi=80)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(out_path.parent)
    return out_path
