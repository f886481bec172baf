"""Tools around runs: ``resolve-model`` (where a model name points) and ``bench-history`` (benchmark trends)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlrunbook.cli.arguments import positive_float


def cmd_resolve_model(args: argparse.Namespace) -> int:
    from rlrunbook.models import resolve_model

    print(resolve_model(args.name))
    return 0


def cmd_bench_history(args: argparse.Namespace) -> int:
    from rlrunbook.bench_history import compare, format_comparison, load_runs, plot_trend

    if args.png:
        from rlrunbook.rl.setup.preflight import check_output_file

        check_output_file(args.png, "--png")
    runs = load_runs(Path(args.storage), args.machine)
    rows = compare(runs, args.threshold)
    print(format_comparison(runs, rows))
    if args.png:
        print(f"trend: {plot_trend(runs, Path(args.png))}")
    return 1 if any(row.regression for row in rows) else 0


def add_commands(commands) -> None:
    resolve = commands.add_parser("resolve-model", help="print the local folder a model name resolves to "
                                                        "(building a built-in model on first use)")
    resolve.add_argument("name")
    resolve.set_defaults(func=cmd_resolve_model)
    history = commands.add_parser("bench-history", help="compare the last saved benchmark run "
                                  "(pytest-benchmark --benchmark-autosave) with the earlier ones; "
                                  "exit 1 on a regression; --png draws the trend")
    history.add_argument("--storage", default=".benchmarks", help="pytest-benchmark's storage (.benchmarks)")
    history.add_argument("--machine", help="machine folder in the storage (default: the newest run's)")
    history.add_argument("--png", help="also draw the trend into this PNG")
    history.add_argument("--threshold", type=positive_float, default=0.15,
                         help="more than this fraction above the earlier runs' median is a regression (0.15)")
    history.set_defaults(func=cmd_bench_history)
