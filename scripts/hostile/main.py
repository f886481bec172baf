"""The command line of the hostile-input run: options, case selection, --list, the pool of workers, the report.

``main`` selects cases by class, id or regex (``--only``, ``--exclude``), lists them (``--list``: class, id,
expect and arguments, one line each, then the counts) or prepares the template run and runs them in parallel
through ``runner.run_case``, slowest first, printing one line per case, then the table of outcomes per class
(``table``) and one line per failing case; ``--json`` is rewritten after each case. It returns 0 when every
case passes, 1 otherwise. scripts/hostile_inputs.py is its entry point.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

from .case import Case, make_mutable
from .cases import cases
from .classify import OUTCOMES, PASSING
from .runner import Result, build_template, run_case

REPO = Path(__file__).resolve().parents[2]
DESCRIPTION = ("Hostile-input run: hundreds of bad, contradictory or malicious inputs against the installed "
               "``rlrunbook``.")


def resolve_exe(arg: str | None) -> list[str]:
    """The rlrunbook command of a venv (its bin/), a folder or a command name; the repository's .venv by default."""
    target = Path(arg) if arg else REPO / ".venv"
    if target.is_dir():
        for cand in (target / "bin" / "rlrunbook", target / "rlrunbook"):
            if cand.exists():
                return [str(cand)]
        raise SystemExit(f"no rlrunbook command in {target} (looked in bin/ and the folder itself)")
    if target.exists() or shutil.which(str(target)):
        return [str(target) if target.exists() else shutil.which(str(target))]
    raise SystemExit(f"{target}: not a venv, folder or command")


def table(results: list[Result]) -> str:
    """The outcomes per class and in total, one column per outcome that occurred."""
    classes = sorted({r.cls for r in results})
    used = [o for o in OUTCOMES if any(r.outcome == o for r in results)]
    head = ["class", "cases"] + used
    rows = []
    for cls in classes + ["TOTAL"]:
        rs = [r for r in results if cls == "TOTAL" or r.cls == cls]
        rows.append([cls, str(len(rs))] + [str(sum(r.outcome == o for r in rs) or "") for o in used])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(wd) for c, wd in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * wd for wd in widths])] + [line(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", nargs="?", help="a venv (its bin/rlrunbook), a bin folder or the rlrunbook command "
                                              "(default: the repository's .venv)")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="cases run in parallel (2)")
    ap.add_argument("--only", action="append", default=[], metavar="CLASS_OR_ID",
                    help="run only this class or case id, or those matching it as a regex (repeatable)")
    ap.add_argument("--exclude", action="append", default=[], metavar="CLASS_OR_ID",
                    help="leave out this class or case id, or those matching it as a regex (repeatable)")
    ap.add_argument("--json", metavar="OUT", help="write every result as JSON (rewritten after each case, so an "
                                                  "interrupted run keeps what it finished)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds per case unless the case sets its own (120)")
    ap.add_argument("--mem-gib", type=float, default=12.0, help="address-space limit of each case in GiB (12; 0 = "
                                                                 "none)")
    ap.add_argument("--keep", action="store_true", help="keep every case's folder (under the --tmp folder)")
    ap.add_argument("--tmp", help="folder for the case folders (default: a new one under $TMPDIR)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    args = ap.parse_args(argv)

    all_cases = cases()
    ids = [c.id for c in all_cases]
    dup = {i for i in ids if ids.count(i) > 1}
    assert not dup, f"duplicate case ids: {dup}"
    def matches(c: Case, pats: list[str]) -> bool:
        return any(o == c.cls or o == c.id or re.fullmatch(o, c.id) for o in pats)

    selected = [c for c in all_cases if (not args.only or matches(c, args.only)) and not matches(c, args.exclude)]
    if args.only or args.exclude:
        if not selected:
            raise SystemExit(f"--only {args.only}: no case; classes: {sorted({c.cls for c in all_cases})}")
    if args.list:
        for c in selected:
            shown = " ".join(os.fsdecode(a) if isinstance(a, bytes) else a for a in c.argv)
            print(f"{c.cls:14} {c.id:45} expect={c.expect:14} {shown!r}"[:240])
        counts = {}
        for c in selected:
            counts[c.cls] = counts.get(c.cls, 0) + 1
        print(f"{len(selected)} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        return 0

    exe = resolve_exe(args.target)
    tmp_root = Path(args.tmp) if args.tmp else Path(tempfile.mkdtemp(prefix="hostile-inputs-"))
    tmp_root.mkdir(parents=True, exist_ok=True)
    mem = int(args.mem_gib * (1 << 30))
    started = time.time()
    print(f"[hostile] {len(selected)} cases against {exe[0]}, {args.jobs} workers, case folders in {tmp_root}",
          flush=True)
    template = build_template(exe, tmp_root, mem)
    print(f"[hostile] prepared in {time.time() - started:.0f}s", flush=True)

    results: list[Result] = []
    lock = threading.Lock()

    def write_json() -> None:
        if not args.json:
            return
        done = sorted(results, key=lambda r: (r.cls, r.id))
        counts = {cls: {o: sum(1 for r in done if r.cls == cls and r.outcome == o) for o in OUTCOMES}
                  for cls in sorted({r.cls for r in done})}
        totals = {o: sum(1 for r in done if r.outcome == o) for o in OUTCOMES}
        Path(args.json).write_text(json.dumps({
            "target": exe[0], "cases": len(done), "selected": len(selected),
            "seconds": round(time.time() - started), "totals": totals, "counts": counts,
            "failing": [r.id for r in done if r.outcome not in PASSING],
            "results": [r.__dict__ for r in done]}, indent=1, ensure_ascii=True))

    # the slow cases first, so that the tail of the run is not one long case on one worker
    order = sorted(selected, key=lambda c: -(c.timeout or args.timeout))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_case, c, exe, tmp_root, template, args.timeout, mem, args.keep): c for c in order}
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            with lock:
                results.append(r)
                mark = "ok " if r.outcome in PASSING else "BAD"
                print(f"[{len(results):3}/{len(selected)}] {mark} {r.cls:13} {r.id:42} {r.outcome:14} "
                      f"{r.seconds:6.1f}s  {r.message[:110]}", flush=True)
                write_json()
    results.sort(key=lambda r: (r.cls, r.id))
    print()
    print(table(results))
    bad = [r for r in results if r.outcome not in PASSING]
    print(f"\n{len(results)} cases in {time.time() - started:.0f}s: {len(results) - len(bad)} pass, {len(bad)} fail")
    for r in bad:
        print(f"  {r.id}: {r.outcome}: {r.message.splitlines()[0][:160] if r.message else ''}")
    if args.json:
        write_json()
        print(f"written: {args.json}")
    if not args.keep:
        make_mutable(tmp_root)
        shutil.rmtree(tmp_root, ignore_errors=True)
    return 1 if bad else 0
