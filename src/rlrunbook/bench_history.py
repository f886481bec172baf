"""Benchmark history: pytest-benchmark's saved runs, the last one compared with those before it, the trend.

pytest-benchmark saves a run (``--benchmark-autosave``) as
``<storage>/<machine id>/NNNN_<commit>_<date>.json``, where NNNN counts the runs saved in that folder and
the JSON carries ``machine_info``, ``commit_info``, ``datetime`` and one entry per benchmark (its ``stats``
and ``extra_info``). This module reads those files as they are; it writes none.

A benchmark is compared by its median seconds, except one whose ``extra_info`` holds the rlrunbook/TRL
step ratio (the peer benchmark, tests/benchmarks/test_bench_peer.py): that one by the ratio, because
absolute times swing with a shared machine's load and a ratio measured within one run does not. Either figure
is lower-is-better. The last run's figure over the median of the earlier runs' figures is the change;
above ``1 + threshold`` it is a regression.

    rlrunbook bench-history                      # .benchmarks/, the machine of the newest run
    rlrunbook bench-history --png trend.png --threshold 0.15
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rlrunbook.errors import ConfigError, InputError

RATIO_KEY = "ratio_rlrunbook_over_trl"  # extra_info key of the peer benchmark (test_bench_peer.py)
RUN_GLOB = "[0-9][0-9][0-9][0-9]_*.json"  # the files --benchmark-autosave / --benchmark-save write
HOW_TO_SAVE = ("save runs with `bash scripts/test.sh -m benchmark --benchmark-enable --benchmark-autosave` "
               "(or `tox -e bench`), or pass --storage with the folder given to --benchmark-storage")


@dataclass(frozen=True)
class BenchRun:
    """One saved pytest-benchmark run.

    ``medians`` maps each benchmark (its short name, ``file.py::test[param]``) to its median seconds per
    round; ``ratios`` maps the benchmarks that report the rlrunbook/TRL ratio to that ratio.
    """

    path: Path
    number: int  # pytest-benchmark's NNNN counter in the machine folder: the order runs were saved in
    machine: str  # the folder name: pytest-benchmark's machine id
    host: str  # machine_info's node and CPU: a folder may hold runs of several hosts of one platform
    when: datetime
    commit: str
    dirty: bool
    medians: dict[str, float]
    ratios: dict[str, float]

    @property
    def label(self) -> str:
        """Date and short commit, as the trend's x-axis shows them."""
        return f"{self.when:%m-%d %H:%M}\n{self.commit[:7]}{'+' if self.dirty else ''}"


@dataclass(frozen=True)
class Comparison:
    """The last run's figure for one benchmark against the median of the earlier runs' figures."""

    name: str
    measure: str  # "median s" or "rlrunbook/TRL"
    last: float | None  # None: the benchmark is in the history but not in the last run
    history: float | None  # None: no earlier run has the benchmark
    earlier_runs: int
    threshold: float

    @property
    def change(self) -> float | None:
        """last / history, or None where either is missing."""
        if self.last is None or self.history is None:
            return None
        return self.last / self.history

    @property
    def regression(self) -> bool:
        """The last figure is more than ``threshold`` above the history (both are lower-is-better)."""
        change = self.change
        return change is not None and change > 1.0 + self.threshold

    @property
    def status(self) -> str:
        """REGRESSION, faster, ok, new (no history) or absent (not in the last run)."""
        change = self.change
        if self.last is None:
            return "absent"
        if change is None:
            return "new"
        if self.regression:
            return "REGRESSION"
        return "faster" if change < 1.0 - self.threshold else "ok"


def _short_name(bench: dict) -> str:
    fullname = bench.get("fullname") or bench["name"]
    return fullname.rsplit("/", 1)[-1]


def _host(machine_info: dict) -> str:
    cpu = machine_info.get("cpu") or {}
    brand = cpu.get("brand_raw") if isinstance(cpu, dict) else None
    node = machine_info.get("node") or "?"
    return f"{node} ({brand})" if brand else node


def read_run(path: Path) -> BenchRun:
    """One saved run; ``InputError`` naming the file when it is not a pytest-benchmark save."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        medians, ratios = {}, {}
        for bench in document["benchmarks"]:
            name = _short_name(bench)
            medians[name] = float(bench["stats"]["median"])
            ratio = (bench.get("extra_info") or {}).get(RATIO_KEY)
            if ratio is not None:
                ratios[name] = float(ratio)
        commit_info = document.get("commit_info") or {}
        return BenchRun(path=path, number=int(path.name.split("_", 1)[0]), machine=path.parent.name,
                        host=_host(document.get("machine_info") or {}),
                        when=datetime.fromisoformat(document["datetime"]),
                        commit=str(commit_info.get("id") or "unknown"), dirty=bool(commit_info.get("dirty")),
                        medians=medians, ratios=ratios)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise InputError(f"benchmark run {path} is not a pytest-benchmark save ({type(error).__name__}: "
                         f"{error}); move it out of the storage folder or delete it") from None


def load_runs(storage: Path, machine: str | None = None) -> list[BenchRun]:
    """Every saved run of one machine folder, oldest first (by pytest-benchmark's counter).

    ``machine`` is the folder name (pytest-benchmark's machine id, e.g. ``Linux-CPython-3.11-64bit``);
    by default the folder holding the newest run (by its ``datetime``). ``ConfigError`` when the storage
    folder is missing or holds no run, or the machine folder is unknown.
    """
    if not storage.is_dir():
        raise ConfigError(f"benchmark storage {str(storage)!r} is not a folder: no benchmark run was saved "
                          f"there; {HOW_TO_SAVE}")
    folders = {path.parent.name for path in storage.glob(f"*/{RUN_GLOB}")}
    if not folders:
        raise ConfigError(f"benchmark storage {str(storage)!r} holds no saved run (no <machine>/{RUN_GLOB}); "
                          f"{HOW_TO_SAVE}")
    if machine is None:
        newest = max((read_run(path) for path in storage.glob(f"*/{RUN_GLOB}")), key=lambda run: run.when)
        machine = newest.machine
    elif machine not in folders:
        raise ConfigError(f"--machine {machine!r} has no runs in {str(storage)!r}; it holds runs of "
                          f"{', '.join(sorted(folders))}: pass one of those")
    runs = [read_run(path) for path in (storage / machine).glob(RUN_GLOB)]
    return sorted(runs, key=lambda run: (run.number, run.when))


def _figure(run: BenchRun, name: str) -> float | None:
    """The figure of ``name`` compared in ``run``: its rlrunbook/TRL ratio if it has one, else its median."""
    if name in run.ratios:
        return run.ratios[name]
    return run.medians.get(name)


def compare(runs: Sequence[BenchRun], threshold: float) -> list[Comparison]:
    """The last run against the median of the earlier runs, one row per benchmark seen in any run.

    A benchmark that reports the rlrunbook/TRL ratio in the last run is compared by its ratio in every run;
    the others by median seconds. ``threshold`` is the allowed relative rise (0.15: 15% slower).
    """
    if not runs:
        raise ConfigError(f"no benchmark runs to compare; {HOW_TO_SAVE}")
    if not (math.isfinite(threshold) and threshold > 0):
        raise ConfigError(f"threshold {threshold} must be a finite number > 0, e.g. 0.15 for 15%")
    *earlier, last = runs
    names = list(last.medians) + sorted({n for run in earlier for n in run.medians} - set(last.medians))
    rows = []
    for name in names:
        in_last = name in last.medians
        by_ratio = name in last.ratios or (not in_last and any(name in r.ratios for r in earlier))
        figures = [r.ratios.get(name) if by_ratio else r.medians.get(name) for r in earlier]
        figures = [f for f in figures if f is not None]
        rows.append(Comparison(name=name, measure="rlrunbook/TRL" if by_ratio else "median s",
                               last=_figure(last, name) if in_last else None,
                               history=statistics.median(figures) if figures else None,
                               earlier_runs=len(figures), threshold=threshold))
    return rows


def _number(value: float | None, measure: str) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if measure != "median s" else f"{value:.4g} s"


def format_comparison(runs: Sequence[BenchRun], rows: Sequence[Comparison]) -> str:
    """The table ``rlrunbook bench-history`` prints: header, one line per benchmark, a verdict."""
    last = runs[-1]
    dirty = ", uncommitted changes" if last.dirty else ""
    lines = [f"{len(runs)} runs of {last.machine} in {last.path.parent.parent}",
             (f"last: run {last.number:04d} ({last.when:%Y-%m-%d %H:%M %Z}, "
              f"commit {last.commit[:12]}{dirty}) on {last.host}")]
    others = sum(run.host != last.host for run in runs[:-1])
    if others:
        lines.append(f"note: {others} earlier run(s) ran on another host than the last; their times may "
                     "not compare")
    table = [("benchmark", "measure", "last", "history (runs)", "last/history", "status")]
    for row in rows:
        change = row.change
        table.append((row.name, row.measure, _number(row.last, row.measure),
                      f"{_number(row.history, row.measure)} ({row.earlier_runs})",
                      "-" if change is None else f"{change:.3f}", row.status))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
              for line in table]
    regressions = [row.name for row in rows if row.regression]
    threshold = rows[0].threshold if rows else 0.0
    verdict = f"{len(regressions)} regression(s) beyond +{threshold:.0%} against the earlier runs' median"
    lines.append(verdict + (f": {', '.join(regressions)}" if regressions else ""))
    return "\n".join(lines)


def trend_series(runs: Sequence[BenchRun]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """What the trend plots, one value per run (NaN where a run lacks the benchmark).

    First: each benchmark's median over its median in the first run that has it (1.0 = unchanged);
    second: the rlrunbook/TRL ratio of each benchmark that reports one, as measured (its absolute
    seconds are not plotted: they swing with the machine's load, the ratio does not).
    """
    with_ratio = {n for run in runs for n in run.ratios}
    normalised: dict[str, list[float]] = {}
    for name in dict.fromkeys(n for run in runs for n in run.medians if n not in with_ratio):
        first = next(run.medians[name] for run in runs if name in run.medians)
        normalised[name] = [run.medians[name] / first if name in run.medians else math.nan for run in runs]
    ratios = {name: [run.ratios.get(name, math.nan) for run in runs]
              for name in dict.fromkeys(n for run in runs for n in run.ratios)}
    return normalised, ratios


def draw_trend(runs: Sequence[BenchRun]):
    """A matplotlib Figure of ``trend_series`` on an Agg canvas (no pyplot, no global state): a panel of
    normalised medians, and the peer ratio in a panel of its own (each only where it has lines).
    x: one point per run, labelled with its date and short commit."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    normalised, ratios = trend_series(runs)
    panels = [(series, ylabel, title) for series, ylabel, title in (
        (normalised, "median time / first run's", f"benchmarks on {runs[-1].machine} (lower is faster)"),
        (ratios, "rlrunbook / TRL step time", "peer ratio (measured within each run; lower is faster)"),
    ) if series] or [({}, "", f"no benchmark in the runs of {runs[-1].machine}")]
    figure = Figure(figsize=(max(6.0, 0.9 * len(runs) + 3.0), 3.6 * len(panels)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    x = list(range(len(runs)))
    for ax, (series, ylabel, title) in zip(axes, panels, strict=True):
        for name, values in series.items():
            ax.plot(x, values, marker="o", label=name)
        if series is normalised:
            ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if series:
            ax.legend(fontsize="x-small", loc="best")
        ax.grid(True, alpha=0.3)
    axes[-1].set_xticks(x, [run.label for run in runs], fontsize="x-small")
    return figure


def plot_trend(runs: Sequence[BenchRun], path: Path) -> Path:
    """Draw the trend (``draw_trend``) into a PNG at ``path``; returns ``path``."""
    draw_trend(runs).savefig(path, format="png", dpi=110)
    return path
