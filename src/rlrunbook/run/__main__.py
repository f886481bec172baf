"""``python -m rlrunbook.run RUN_DIR [RUN_DIR ...]``: print each run's rubric; exit 1 if any check fails."""

from __future__ import annotations

import sys

from rlrunbook.run.rubric import check_run, format_results, rubric_passed


def main(argv: list[str] | None = None) -> int:
    run_dirs = sys.argv[1:] if argv is None else argv
    if not run_dirs:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    ok = True
    for run_dir in run_dirs:
        results = check_run(run_dir)
        passed = rubric_passed(results)
        ok &= passed
        print(f"== {run_dir}: {'PASS' if passed else 'FAIL'}\n{format_results(results)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
