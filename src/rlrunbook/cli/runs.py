"""Commands on run directories: ``check-run``, ``summarize``, ``package``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlrunbook.errors import ConfigError


def _existing_run_dir(path: str) -> Path:
    """``path`` if it is a directory; ``ConfigError`` naming what it is otherwise (check-run, not 13 FAILs)."""
    run_dir = Path(path)
    if not run_dir.exists():
        raise ConfigError(f"run directory {path!r} does not exist. Pass the folder a run wrote, "
                          "logs/<timestamp>_<mode>_<env>_<name> (train prints it as 'run directory: ...').")
    if not run_dir.is_dir():
        raise ConfigError(f"{path!r} is a file, not a run directory. Pass the folder that holds its "
                          "run_metadata.json.")
    return run_dir


def cmd_check_run(args: argparse.Namespace) -> int:
    from rlrunbook.run import check_run, format_results, rubric_passed

    results = check_run(_existing_run_dir(args.run_dir))
    print(format_results(results))
    return 0 if rubric_passed(results) else 1


def cmd_summarize(args: argparse.Namespace) -> int:
    from rlrunbook.run.tools import TERMINAL_LEGEND, format_table, summarize_runs, write_table

    if args.out:
        from rlrunbook.rl.setup.preflight import check_output_file

        check_output_file(args.out)
    rows = summarize_runs([Path(d) for d in args.run_dirs])
    print(format_table(rows))
    print(TERMINAL_LEGEND)
    if args.out:
        print(f"table: {write_table(rows, Path(args.out))}")
    return 1 if any(row["status"] == "unreadable" for row in rows) else 0


def cmd_package(args: argparse.Namespace) -> int:
    from rlrunbook.run.paths import check_run_directory
    from rlrunbook.run.tools import find_secrets, package_run, verify_package

    run_dir = _existing_run_dir(args.run_dir)
    check_run_directory(run_dir)  # any other folder is not archived as a run
    if args.out:
        from rlrunbook.run.outputs import check_not_a_run_file

        check_not_a_run_file(args.out)
    findings = [] if args.allow_secrets else find_secrets(run_dir, os.environ)
    if findings:
        print("refusing to package: possible secrets (file:line: kind; values not shown):", *findings,
              sep="\n  ", file=sys.stderr)
        print("remove or rename those files, or remove the values, or pass --allow-secrets if they are not secrets",
              file=sys.stderr)
        return 1
    archive = package_run(run_dir, Path(args.out) if args.out else None, overwrite=args.overwrite)
    problems = verify_package(archive)
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    print(f"archive: {archive} ({'verified' if not problems else 'NOT verified'})")
    return 1 if problems else 0


def add_commands(commands) -> None:
    check_run = commands.add_parser("check-run", help="apply the runbook's rubrics to a run directory; "
                                                      "exit 1 if any check fails")
    check_run.add_argument("run_dir")
    check_run.set_defaults(func=cmd_check_run)

    summarize = commands.add_parser("summarize", help="one table row per run directory: status, rewards, loss, "
                                                      "tokens, timings; exit 1 if any run is unreadable")
    summarize.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    summarize.add_argument("--out", help="also write the table: .csv, .tsv or .md")
    summarize.set_defaults(func=cmd_summarize)

    package = commands.add_parser("package", help="archive a run directory as .tar.gz with a MANIFEST.sha256, "
                                                  "after a secret scan; verify the archive")
    package.add_argument("run_dir", metavar="RUN_DIR")
    package.add_argument("--archive", action="store_true", help="accepted for clarity: an archive is always made")
    package.add_argument("--out", help="archive path (default: RUN_DIR.tar.gz next to the run directory)")
    package.add_argument("--overwrite", action="store_true", help="replace an existing archive")
    package.add_argument("--allow-secrets", action="store_true",
                         help="package even if the scan finds secret values or credentials files")
    package.set_defaults(func=cmd_package)
