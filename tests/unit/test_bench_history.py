"""rlrunbook bench-history on real pytest-benchmark storage and on hand-written runs.

The real storage: a throwaway benchmark file in a throwaway git repository, run three times by
pytest-benchmark itself (``--benchmark-autosave --benchmark-storage``), one commit per run. Its ``sleep``
benchmark sleeps 10, 10, then 30 ms (a regression, ~3x); its ``peer`` benchmark reports an rlrunbook/TRL
ratio of 0.50, 0.40, 0.46 in ``extra_info`` while its own time goes from 10 to 40 ms: compared by the
ratio, 0.46 / median(0.50, 0.40) = 0.46 / 0.45 = 1.022, no regression; by seconds it would be one.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlrunbook import cli
from rlrunbook.bench_history import RATIO_KEY, compare, draw_trend, format_comparison, load_runs, trend_series
from rlrunbook.errors import ConfigError, InputError

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

BENCH_FILE = f'''
import os
import time


def test_sleep(benchmark):
    benchmark.pedantic(time.sleep, args=(float(os.environ["SLEEP_S"]),), rounds=3, iterations=1)


def test_peer(benchmark):
    benchmark.pedantic(time.sleep, args=(float(os.environ["PEER_SLEEP_S"]),), rounds=1, iterations=1)
    benchmark.extra_info["{RATIO_KEY}"] = float(os.environ["PEER_RATIO"])
'''
RUNS = [  # (SLEEP_S, PEER_SLEEP_S, PEER_RATIO) of the three saved runs
    ("0.01", "0.01", "0.50"),
    ("0.01", "0.01", "0.40"),
    ("0.03", "0.04", "0.46"),
]


def _git(repo: Path, *args: str) -> str:
    command = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.invalid", *args]
    return subprocess.run(command, cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Three runs saved by pytest-benchmark: (storage folder, the commit of each run)."""
    base = tmp_path_factory.mktemp("bench")
    repo, storage = base / "repo", base / "storage"
    repo.mkdir()
    (repo / "pytest.ini").write_text("[pytest]\n")  # its own rootdir: the project's addopts do not apply
    (repo / "test_tiny_bench.py").write_text(BENCH_FILE)
    _git(repo, "init", "-q")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    commits = []
    for index, (sleep, peer_sleep, ratio) in enumerate(RUNS):
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "--allow-empty", "-m", f"run {index}")
        commits.append(_git(repo, "rev-parse", "HEAD"))
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_tiny_bench.py",
             "--benchmark-autosave", f"--benchmark-storage={storage}"],
            cwd=repo, env={**env, "SLEEP_S": sleep, "PEER_SLEEP_S": peer_sleep, "PEER_RATIO": ratio},
            capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    return storage, commits


@pytest.mark.slow
def test_loader_reads_what_pytest_benchmark_saved(saved):
    from pytest_benchmark.utils import get_machine_id

    storage, commits = saved
    runs = load_runs(storage)
    assert [run.machine for run in runs] == [get_machine_id()] * 3  # the folder pytest-benchmark names
    assert [run.number for run in runs] == [1, 2, 3]
    assert [run.commit for run in runs] == commits and not any(run.dirty for run in runs)
    assert runs[0].when < runs[1].when < runs[2].when
    assert [run.ratios for run in runs] == [{"test_tiny_bench.py::test_peer": r} for r in (0.50, 0.40, 0.46)]
    for run, (sleep, peer_sleep, _) in zip(runs, RUNS, strict=True):
        assert float(sleep) <= run.medians["test_tiny_bench.py::test_sleep"] < float(sleep) + 0.1
        assert float(peer_sleep) <= run.medians["test_tiny_bench.py::test_peer"] < float(peer_sleep) + 0.1
    # The same medians as the saved JSON, read independently of the loader.
    document = json.loads(runs[2].path.read_text())
    stored = {b["name"]: b["stats"]["median"] for b in document["benchmarks"]}
    assert runs[2].medians == {f"test_tiny_bench.py::{name}": median for name, median in stored.items()}


def test_peer_compared_by_ratio_and_the_rest_by_median(saved):
    storage, _ = saved
    runs = load_runs(storage)
    rows = {row.name: row for row in compare(runs, threshold=0.15)}
    peer = rows["test_tiny_bench.py::test_peer"]
    assert peer.measure == "rlrunbook/TRL" and peer.last == 0.46
    assert peer.history == pytest.approx(0.45) and peer.change == pytest.approx(0.46 / 0.45)  # 1.022
    assert peer.status == "ok" and not peer.regression  # its seconds went 10 -> 40 ms; the ratio held
    sleep = rows["test_tiny_bench.py::test_sleep"]
    medians = [run.medians["test_tiny_bench.py::test_sleep"] for run in runs]
    assert sleep.measure == "median s" and sleep.earlier_runs == 2
    assert sleep.change == pytest.approx(medians[2] / ((medians[0] + medians[1]) / 2))
    assert sleep.change > 2 and sleep.status == "REGRESSION"


def test_the_command_exits_1_on_a_regression_and_draws_the_trend(saved, tmp_path):
    from pytest_benchmark.utils import get_machine_id

    storage, commits = saved
    command = Path(sys.executable).parent / "rlrunbook"  # the installed entry point
    png = tmp_path / "trend.png"
    done = subprocess.run([str(command), "bench-history", "--storage", str(storage), "--png", str(png)],
                          capture_output=True, text=True, timeout=300, check=False)
    print(done.stdout)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"3 runs of {get_machine_id()} in {storage}"
    assert lines[1].startswith("last: run 0003 (") and f"commit {commits[2][:12]})" in lines[1]
    (sleep_line,) = [line for line in lines if line.startswith("test_tiny_bench.py::test_sleep ")]
    (peer_line,) = [line for line in lines if line.startswith("test_tiny_bench.py::test_peer ")]
    assert sleep_line.split()[-1] == "REGRESSION"
    assert peer_line.split()[1:] == ["rlrunbook/TRL", "0.460", "0.450", "(2)", "1.022", "ok"]
    assert "1 regression(s) beyond +15%" in done.stdout and f"trend: {png}" in done.stdout
    assert png.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert height > 300 and width > 300


def test_exit_0_when_within_the_threshold(saved, capsys):
    storage, _ = saved
    assert cli.main(["bench-history", "--storage", str(storage), "--threshold", "100"]) == 0
    assert "0 regression(s) beyond +10000%" in capsys.readouterr().out


def _save(storage: Path, number: int, benchmarks: dict, *, machine: str = "Linux-CPython-3.11-64bit",
          when: str = "2026-11-24T10:00:00+00:00", commit: str = "a" * 40, node: str = "box") -> Path:
    """A run file with the fields pytest-benchmark's --benchmark-autosave writes and bench_history reads.

    ``benchmarks``: name -> median seconds, or (median seconds, rlrunbook/TRL ratio)."""
    entries = []
    for name, value in benchmarks.items():
        median, ratio = value if isinstance(value, tuple) else (value, None)
        extra_info = {} if ratio is None else {RATIO_KEY: ratio}
        entries.append({"name": name, "fullname": f"tests/benchmarks/test_b.py::{name}",
                        "stats": {"median": median}, "extra_info": extra_info})
    document = {"machine_info": {"node": node, "cpu": {"brand_raw": "EPYC"}},
                "commit_info": {"id": commit, "dirty": False}, "datetime": when, "benchmarks": entries}
    path = storage / machine / f"{number:04d}_{commit}_20261124_100000.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))
    return path


def test_history_is_the_median_of_the_earlier_runs(tmp_path):
    # a: earlier 1, 3, 2 (absent from run 4) -> median 2.0; last 2.6 -> 1.3, a regression at 0.15, ok at 0.35.
    # b: earlier 1, 2, 4, 10 -> median (2 + 4) / 2 = 3.0; last 2.4 -> 0.8, below 1 - 0.15: faster.
    # peer: ratios 0.5, 0.4, 0.6, 0.45 -> median (0.45 + 0.5) / 2 = 0.475; last 0.5 -> 1.0526: ok, though its
    #   seconds went 10 -> 40. new: only in the last run. gone: only in run 1.
    _save(tmp_path, 1, {"a": 1.0, "b": 1.0, "peer": (10.0, 0.5), "gone": 5.0})
    _save(tmp_path, 2, {"a": 3.0, "b": 2.0, "peer": (10.0, 0.4)})
    _save(tmp_path, 3, {"a": 2.0, "b": 4.0, "peer": (10.0, 0.6)})
    _save(tmp_path, 4, {"b": 10.0, "peer": (10.0, 0.45)})
    _save(tmp_path, 5, {"a": 2.6, "b": 2.4, "peer": (40.0, 0.5), "new": 1.0})
    rows = {row.name.split("::")[-1]: row for row in compare(load_runs(tmp_path), threshold=0.15)}
    assert list(rows) == ["a", "b", "peer", "new", "gone"]
    assert (rows["a"].history, rows["a"].earlier_runs, rows["a"].status) == (2.0, 3, "REGRESSION")
    assert rows["a"].change == pytest.approx(1.3)
    assert (rows["b"].history, rows["b"].earlier_runs, rows["b"].status) == (3.0, 4, "faster")
    assert rows["b"].change == pytest.approx(0.8)
    assert rows["peer"].measure == "rlrunbook/TRL" and rows["peer"].history == pytest.approx(0.475)
    assert rows["peer"].change == pytest.approx(0.5 / 0.475) and rows["peer"].status == "ok"
    assert (rows["new"].history, rows["new"].status, rows["new"].regression) == (None, "new", False)
    assert (rows["gone"].last, rows["gone"].status, rows["gone"].regression) == (None, "absent", False)
    assert compare(load_runs(tmp_path), threshold=0.35)[0].status == "ok"  # a: 1.3 is within +35%


def test_one_run_has_no_history_and_no_regression(tmp_path, capsys):
    _save(tmp_path, 1, {"a": 1.0})
    assert cli.main(["bench-history", "--storage", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 runs of" in out and "0 regression(s)" in out and out.splitlines()[-2].split()[-1] == "new"


def test_default_machine_is_the_newest_runs_and_another_is_chosen_by_name(tmp_path, capsys):
    # The newest run (by its datetime) is in the middle folder by name and was written first.
    _save(tmp_path, 1, {"a": 1.0}, machine="Linux-CPython-3.11-64bit", when="2026-11-24T12:00:00+00:00")
    _save(tmp_path, 1, {"a": 1.0}, machine="Linux-CPython-3.10-64bit", when="2026-11-24T09:00:00+00:00")
    _save(tmp_path, 2, {"a": 9.0}, machine="Linux-CPython-3.10-64bit", when="2026-11-24T10:00:00+00:00")
    _save(tmp_path, 1, {"a": 1.0}, machine="Linux-CPython-3.12-64bit", when="2026-11-24T11:00:00+00:00")
    assert [run.machine for run in load_runs(tmp_path)] == ["Linux-CPython-3.11-64bit"]
    older = load_runs(tmp_path, "Linux-CPython-3.10-64bit")
    assert [run.medians["test_b.py::a"] for run in older] == [1.0, 9.0]
    command = ["bench-history", "--storage", str(tmp_path), "--machine"]
    assert cli.main([*command, "Linux-CPython-3.10-64bit"]) == 1  # 9.0 against 1.0
    assert cli.main([*command, "Darwin-CPython-3.11-64bit"]) == 2
    err = capsys.readouterr().err
    assert "'Darwin-CPython-3.11-64bit'" in err
    assert "runs of Linux-CPython-3.10-64bit, Linux-CPython-3.11-64bit, Linux-CPython-3.12-64bit: pass" in err


def test_runs_of_another_host_are_pointed_out(tmp_path):
    _save(tmp_path, 1, {"a": 1.0}, node="laptop")
    _save(tmp_path, 2, {"a": 1.0}, node="ci-gpu-1")
    runs = load_runs(tmp_path)
    text = format_comparison(runs, compare(runs, 0.15))
    assert text.splitlines()[1].endswith("on ci-gpu-1 (EPYC)")
    assert text.splitlines()[2].startswith("note: 1 earlier run(s) ran on another host")


def test_bad_storage_is_refused_with_how_to_make_runs(tmp_path, capsys):
    missing = tmp_path / "no-such-folder"
    assert cli.main(["bench-history", "--storage", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "--benchmark-autosave" in err
    empty = tmp_path / "empty"
    (empty / "Linux-CPython-3.11-64bit").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds no saved run.*--benchmark-autosave"):
        load_runs(empty)
    broken = _save(tmp_path / "broken", 1, {"a": 1.0})
    broken.write_text("{not json")
    with pytest.raises(InputError, match=str(broken)):
        load_runs(tmp_path / "broken")
    _save(tmp_path / "ok", 1, {"a": 1.0})
    with pytest.raises(ConfigError, match="threshold 0"):
        compare(load_runs(tmp_path / "ok"), 0.0)
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses a threshold <= 0 before anything runs
        cli.main(["bench-history", "--storage", str(tmp_path / "ok"), "--threshold", "-1"])
    assert exit_info.value.code == 2 and "must be a finite number > 0" in capsys.readouterr().err


def test_trend_series_normalises_each_benchmark_to_its_first_run(tmp_path):
    # a: 2, 3, 1 -> 1, 1.5, 0.5; late: absent, 4, 2 -> nan, 1, 0.5;
    # peer: its ratio as measured, 0.5, nan, 0.4, and not its seconds.
    _save(tmp_path, 1, {"a": 2.0, "peer": (8.0, 0.5)})
    _save(tmp_path, 2, {"a": 3.0, "late": 4.0})
    _save(tmp_path, 3, {"a": 1.0, "late": 2.0, "peer": (8.0, 0.4)})
    runs = load_runs(tmp_path)
    normalised, ratios = trend_series(runs)
    a, late, peer = "test_b.py::a", "test_b.py::late", "test_b.py::peer"
    assert list(normalised) == [a, late] and normalised[a] == [1.0, 1.5, 0.5]  # peer: by its ratio only
    assert math.isnan(normalised[late][0]) and normalised[late][1:] == [1.0, 0.5]
    assert list(ratios) == [peer] and ratios[peer][0] == 0.5 and math.isnan(ratios[peer][1])
    figure = draw_trend(runs)
    top, bottom = figure.axes
    plotted = {line.get_label(): list(line.get_ydata()) for line in top.get_lines()}
    assert plotted[a] == [1.0, 1.5, 0.5] and set(plotted) >= {a, late} and peer not in plotted
    assert [line.get_label() for line in bottom.get_lines()] == [peer]
    assert [tick.get_text() for tick in bottom.get_xticklabels()] == [run.label for run in runs]
    _save(tmp_path / "plain", 1, {"a": 1.0})
    (only,) = draw_trend(load_runs(tmp_path / "plain")).axes  # no ratio: no second panel
    assert only.get_ylabel() == "median time / first run's"
    _save(tmp_path / "peer", 1, {"peer": (8.0, 0.5)})
    (only,) = draw_trend(load_runs(tmp_path / "peer")).axes  # only the peer benchmark: only its ratio
    assert only.get_ylabel() == "rlrunbook / TRL step time"
    assert [line.get_ydata()[0] for line in only.lines] == [0.5]


def test_the_peer_benchmark_reports_the_ratio_under_the_key_read_here():
    source = (ROOT / "tests" / "benchmarks" / "test_bench_peer.py").read_text()
    assert f'"{RATIO_KEY}"' in source
