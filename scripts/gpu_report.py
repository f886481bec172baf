"""The markdown of `scripts/gpu-check.sh`: one section per part (on the GPU machine), folded into the record here.

    python scripts/gpu_report.py section PART WORK --status 0 --planned 6 --seconds 301 > "$OUT/PART.md"
    python scripts/gpu_report.py merge docs/gpu-validation.md DIR [DIR ...]

``section`` reads what one part left in its work folder (the gpu tier's JUnit XML and the properties its tests
record, check-logprobs outputs, benchmark JSON, the mini debate's run directory, and ``steps.tsv`` with each
step's exit status and seconds, its output in ``<step>.log``) and prints a self-contained section, headed by a
marker line naming the part and when it ran. Anything missing is reported as missing, never invented. A part without a renderer below gets its steps'
table only: a new part (``scale``, ...) adds a function to ``RENDERERS`` for its own figures. The ``speed`` part's
renderer turns its steps' JSON into the table of targets (``SPEED_TARGETS``), pass or fail computed here.

``merge`` appends the sections found in the folders brought back from the GPU machine (``*.md`` with a marker
line) to the record, grouped under a dated heading, in part order; a section already in the record is skipped,
so merging the same folder twice changes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from rlrunbook.testing.gpu import not_proven_part

# the order merge lists parts in; others follow by name
PART_ORDER = ("tier", "parity", "bench", "debate", "scale", "full", "invariance", "speed")
MARKER = re.compile(r"^<!-- gpu-check part=(?P<part>[\w-]+) ran=(?P<ran>[0-9TZ:-]+) -->$", re.MULTILINE)


def _machine() -> list[str]:
    import torch
    import transformers

    lines = []
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"- device: {props.name}, {props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} GPU(s)")
    else:
        lines.append("- device: no CUDA device visible")
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except OSError:
        driver = "nvidia-smi not found"
    lines += [f"- driver: {driver or 'unknown'}",
              f"- torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}"]
    return lines


_OUTCOMES = {"0": "ok", "124": "TIMED OUT", "dry-run": "dry run (not run)", "skipped": "not run: out of time"}


def _steps(work: Path) -> list[str]:
    """The table of the part's steps: exit status and seconds, from ``steps.tsv`` (name, status, seconds, gated)."""
    path = work / "steps.tsv"
    if not path.exists():
        return ["no steps recorded"]
    rows = ["| step | outcome | seconds |", "|---|---|---|"]
    for line in path.read_text().splitlines():
        name, status, seconds, gated = line.split("\t")
        outcome = _OUTCOMES.get(status, f"exit {status}")
        if status not in ("0", "dry-run") and gated == "ungated":
            outcome += " (expected, not gated)"
        rows.append(f"| {name} | {outcome} | {seconds} |")
    return rows


def _figure(props: dict, key: str) -> str:
    return f"{float(props[key]):.3g}" if key in props else ""


def _case_outcome(case: ET.Element) -> tuple[str, str]:
    """(outcome, message) of a JUnit test case: passed, failed, error, not proven (a skip of an optional part of
    the gpu tier, rlrunbook.testing.gpu.OPTIONAL_PARTS) or skipped."""
    for tag in ("failure", "error", "skipped"):
        found = case.find(tag)
        if found is not None:
            message = (found.get("message") or found.text or "").strip().splitlines()
            message = message[0] if message else ""
            if tag == "skipped":
                part = not_proven_part(message)
                return (f"not proven ({part})", message) if part else ("skipped", message)
            return {"failure": "failed", "error": "error"}[tag], message
    return "passed", ""


def _counts(outcomes: list[str]) -> str:
    """``30 passed, 1 failed, 8 not proven``: each outcome's count, in a fixed order, the not-proven parts together."""
    kinds = ["passed", "failed", "error", "not proven", "skipped"]
    counted = {kind: sum(o.split(" (")[0] == kind for o in outcomes) for kind in kinds}
    return ", ".join(f"{counted[kind]} {kind}" for kind in kinds if counted[kind]) or "no tests"


def _tier(work: Path) -> list[str]:
    path = work / "gpu-tier.xml"
    if not path.exists():
        return ["gpu tier: no JUnit XML (the tier did not run or did not finish)"]
    rows = ["| test | outcome | max abs | mean abs | tokens |", "|---|---|---|---|---|"]
    outcomes = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, _ = _case_outcome(case)
        outcomes.append(outcome)
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        rows.append(f"| {case.get('name')} | {outcome} | {_figure(props, 'max_abs_diff')} | "
                    f"{_figure(props, 'mean_abs_diff')} | {props.get('num_tokens', '')} |")
    parts = sorted({o[len("not proven ("):-1] for o in outcomes if o.startswith("not proven")})
    lines = [f"gpu tier: {_counts(outcomes)}"]
    if parts:
        lines.append(f"not proven (optional parts missing on this machine): {', '.join(parts)}")
    return [*lines, "", *rows]


def _checks(work: Path) -> list[str]:
    rows = ["| check-logprobs (smollm2, 16 x 128) | max abs | mean abs | verdict |", "|---|---|---|---|"]
    paths = sorted(work.glob("check-*.log"))
    if not paths:
        return ["check-logprobs: no outputs (they did not run)"]
    for path in paths:
        text = path.read_text(errors="replace")
        found = {k: re.search(rf"^{k}: (\S+)", text, re.MULTILINE) for k in ("max_abs_diff", "mean_abs_diff")}
        verdict = "ok" if text.rstrip().endswith("ok") else "FAIL"
        rows.append(f"| {path.stem.removeprefix('check-')} | {found['max_abs_diff'].group(1) if found['max_abs_diff'] else '-'}"
                    f" | {found['mean_abs_diff'].group(1) if found['mean_abs_diff'] else '-'} | {verdict} |")
    return rows


def _bench(work: Path) -> list[str]:
    """Every benchmark the run collected, failed and errored ones included (from the JUnit XML), with the figures
    of those pytest-benchmark measured (the JSON)."""
    path, xml = work / "bench-gpu.json", work / "bench.xml"
    if not path.exists() and not xml.exists():
        return ["benchmarks: no JSON and no JUnit XML (they did not run or did not finish)"]
    measured = {b["name"]: b for b in json.loads(path.read_text())["benchmarks"]} if path.exists() else {}
    outcomes = {case.get("name"): _case_outcome(case) for case in ET.parse(xml).getroot().iter("testcase")} \
        if xml.exists() else {}
    rows = ["| benchmark | outcome | median | extra |", "|---|---|---|---|"]
    for name in [*outcomes, *(n for n in measured if n not in outcomes)]:
        outcome, message = outcomes.get(name, ("outcome not recorded", ""))
        shown = outcome if outcome == "passed" or not message else f"{outcome.upper()}: {message}"
        bench = measured.get(name)
        median = f"{bench['stats']['median']:.4g} s" if bench else "-"
        extra = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in (bench or {}).get("extra_info", {}).items())
        rows.append(f"| {name} | {shown.replace('|', '/')} | {median} | {extra} |")
    counts = f"benchmarks: {_counts([outcomes[n][0] for n in outcomes])}" if outcomes else (
        "benchmarks: outcomes not recorded (no JUnit XML); only those measured are listed")
    return [counts, "", *rows]


def _step_status(work: Path, name: str) -> str | None:
    """The exit status ``steps.tsv`` recorded for step ``name`` (``0``, ``2``, ``124``, ``skipped``, ...)."""
    path = work / "steps.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        fields = line.split("\t")
        if fields[0] == name:
            return fields[1]
    return None


def _debate_ending(work: Path) -> tuple[str, str]:
    """(how the mini debate's process ended: its exit status and last ``error:`` line, what its rubric said: the
    count of ``FAIL`` lines among the checks it printed, or that it printed none)."""
    status = _step_status(work, "mini-debate")
    log = work / "mini-debate.log"
    tail = log.read_text(errors="replace") if log.exists() else ""
    rubric = re.findall(r"^(PASS|FAIL) \S+:", tail, re.MULTILINE)
    errors = re.findall(r"^error: .*$", tail, re.MULTILINE)
    ended = ("exit status not recorded" if status is None else "exit 0" if status == "0" else
             f"{_OUTCOMES.get(status, 'exit ' + status)}" + (f" ({errors[-1]})" if errors else ""))
    verdict = (f"rubric failures {rubric.count('FAIL')} of {len(rubric)} checks" if rubric
               else "rubric not run (the run ended before it)")
    return ended, verdict


def _debate(work: Path) -> list[str]:
    ended, verdict = _debate_ending(work)
    logs = sorted((work / "logs").glob("*/train_log.jsonl")) if (work / "logs").exists() else []
    steps = [json.loads(line) for line in logs[-1].read_text().splitlines() if line.strip()] if logs else []
    if not logs:
        return [f"mini debate: no run directory; {ended}, {verdict}"]
    if not steps:
        return [f"mini debate: the run logged no step; {ended}, {verdict}"]
    mismatch = [s.get("mismatch/abs_logprob_diff", float("nan")) for s in steps]
    counted = [s for s in steps if "engine/graph_captures" in s] or [{}]
    line = (f"mini debate RS->GRPO (-n 64 --num-groups 4 -s 10): {ended}; {len(steps)} steps, median "
            f"{statistics.median(s['time/step_s'] for s in steps):.2f} s/step (sample "
            f"{statistics.median(s['time/sample_s'] for s in steps):.2f} s), mismatch/abs_logprob_diff max "
            f"{max(mismatch):.3g}, graph captures {counted[-1].get('engine/graph_captures', '-')}, cache rebuilds "
            f"{counted[-1].get('engine/cache_rebuilds', '-')}, {verdict}")
    return [line]


def _scale(work: Path) -> list[str]:
    path = work / "scale.json"
    if not path.exists():
        return ["scale: no scale.json (stopped before its plan was made)"]
    r = json.loads(path.read_text())
    gib = 1 << 30

    def peak(measured: str, planned: str) -> str:
        if r.get(measured) is None:
            return f"planned {r[planned] / gib:.1f} GiB, not measured"
        above = ": ABOVE THE PLAN" if r[measured] > r[planned] else ""
        return f"{r[measured] / gib:.1f} GiB measured, {r[planned] / gib:.1f} GiB planned{above}"

    where = f"{r.get('gpu') or r['device']} ({r['dtype']})"
    full = r.get("finetune") == "full"  # the full part: the same figures, every weight trained, no decode benchmark
    shape = "h100-rlvr-full shape (every weight trained)" if full else "h100-rlvr shape"
    lines = [] if full else [f"decode {r['decode_ms_per_step']:.2f} ms/step at 64 x 256 on {where} (target <= 3 ms)"
                             if "decode_ms_per_step" in r else f"decode at 64 x 256 on {where}: not finished"]
    if "sample_s" in r:
        lines.append(f"one step of the {shape}: sample {r['sample_s']:.1f} s (prefill {r['prefill_s']:.1f} s, "
                     f"{r['decode_steps']} decode steps), peak {peak('sampling_peak_bytes', 'planned_sampling_peak')}")
    else:
        lines.append(f"one step of the {shape}: sampling not finished")
    if "mfu" in r:
        lines.append(f"training: forward_backward {r['forward_backward_s']:.1f} s in {r['micro_batches']} "
                     f"micro-batches, optim {r['optim_s']:.2f} s, peak "
                     f"{peak('training_peak_bytes', 'planned_training_peak')}; {r['tokens_per_s']:.0f} tokens/s, "
                     f"MFU {100 * r['mfu']:.1f}% of 989 TFLOP/s")
    else:
        lines.append("training: not finished")
    return [*lines, *(f"plan: {line}" for line in r.get("plan", []))]


# The speed targets: (step of the speed part, what, comparison, target, unit). The step writes speed-STEP.json with
# "value" (None when not measured), "size" (gpu: the target's shape), "shape", and the device as it reports itself.
SPEED_TARGETS = (
    ("decode-smollm2", "decode, SmolLM2-135M", "<=", 2.0, "ms/step"),
    ("decode-1.5b", "decode, Qwen2.5-Math-1.5B shape", "<=", 3.0, "ms/step"),
    ("mfu", "forward_backward MFU, 1.5B shape", ">=", 35.0, "%"),
    ("rlvr", "one whole h100-rlvr step", "<=", 45.0, "s"),
    ("debate", "mini debate", "<=", 3.0, "s/step"),
    ("peer", "rlrunbook step / TRL GRPOTrainer step, 1.5B shape", "<=", 0.25, "x"),
    ("clients", "4 serve clients sampling at once / one client, tokens/s", ">=", 3.0, "x"),
)


def _speed_row(work: Path, step: str, what: str, op: str, target: float, unit: str) -> tuple[str, bool]:
    """One row of the speed table and whether its target was met (never for a figure not measured at its shape)."""
    path = work / f"speed-{step}.json"
    r = json.loads(path.read_text()) if path.exists() else {}
    value, at_least = r.get("value"), r.get("at_least")
    met = value is not None and (value <= target if op == "<=" else value >= target)
    if value is not None:
        measured, verdict = f"{value:.3g} {unit}", "pass" if met else "FAIL"
    elif at_least is not None:  # stopped by the budget while running
        measured = f"> {at_least:.0f} {unit} (stopped by the budget)"
        verdict = "FAIL" if op == "<=" and at_least > target else "not finished"
    elif r.get("missing"):
        measured, verdict = f"not measured: {r['missing']}", "FAIL"
    else:
        measured, verdict = "not measured" + ("" if r else f" (no {path.name})"), "FAIL"
    if r and r.get("size") != "gpu":
        verdict, met = f"n/a ({r.get('size')} size, not the target's shape)", False
    return f"| {what} | {r.get('shape', '')} | {measured} | {op} {target:g} {unit} | {verdict} |", met


def _speed(work: Path) -> list[str]:
    rows = [_speed_row(work, *target) for target in SPEED_TARGETS]
    found = [json.loads(p.read_text()) for p in sorted(work.glob("speed-*.json"))]
    card = next((r for r in found if r.get("gpu")), None)
    lines = [f"card (as the device reports it): {card['gpu']}, {card['gpu_memory_gib']} GiB" if card else
             f"device: {found[0].get('device', 'unknown') if found else 'unknown'} (no CUDA card reported)",
             f"targets met: {sum(met for _, met in rows)} of {len(rows)}", "",
             "| target | shape | measured | target | verdict |", "|---|---|---|---|---|", *(row for row, _ in rows), ""]
    mfu = work / "speed-mfu.json"
    if mfu.exists():
        r = json.loads(mfu.read_text())
        lines.append(f"- MFU: {r['formula']} = 4 x {r['product_params']:,} x {r['tokens']:,} / "
                     f"{r['forward_backward_s']:.3g} s / {r['peak_flops'] / 1e12:g} TFLOP/s ({r['peak_of']}); "
                     "adapter and attention-score products and recomputation not counted")
    peer = work / "speed-peer.json"
    if peer.exists() and json.loads(peer.read_text()).get("value") is not None:
        r = json.loads(peer.read_text())
        lines.append(f"- peer: rlrunbook {r['rlrunbook_s_per_step']} s/step (sampling {r['rlrunbook_sample_s']} s), "
                     f"TRL GRPOTrainer {r['trl_s_per_step']} s/step (generate {r['trl_generate_s']} s)")
    if (work / "scale.json").exists():
        lines += [f"- h100-rlvr step: {line}" for line in _scale(work)[1:]]
    return lines


def _invariance(work: Path) -> list[str]:
    path = work / "invariance.json"
    if not path.exists():
        return ["invariance: no invariance.json (scripts/invariance_check.py did not finish)"]
    r = json.loads(path.read_text())
    lines = [f"{name}: {'bitwise equal' if same else 'DIFFERENT'} to one batch" for name, same in r["equal"].items()]
    lines += [f"sampler vs trainer {label}: max |d| {p['max']:.3g}, mean {p['mean']:.3g} over {p['tokens']} tokens"
              for label, p in r.get("parity", {}).items()]
    for what, f in r.get("seconds", {}).items():
        other = next(name for name in f if name not in ("invariant", "ratio"))
        lines.append(f"{what}: default {statistics.median(f['invariant']):.4g} s, {other} "
                     f"{statistics.median(f[other]):.4g} s (x{f['ratio']:.2f})")
    return [f"- {line}" for line in lines]


RENDERERS: dict[str, Callable[[Path], list[str]]] = {"tier": _tier, "parity": _checks, "bench": _bench,
                                                     "debate": _debate, "scale": _scale, "full": _scale,
                                                     "invariance": _invariance,
                                                     "speed": _speed}


def _card_memory(work: Path) -> tuple[int, int, int] | None:
    """(most MiB in use, the card's MiB, readings) from ``card-memory.csv``, the ``nvidia-smi`` readings gpu-check.sh
    takes every second while a part runs (``used, total`` per line, MiB); ``None`` without any."""
    path = work / "card-memory.csv"
    readings = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and all(f.isdigit() for f in fields):
            readings.append((int(fields[0]), int(fields[1])))
    if not readings:
        return None
    return max(used for used, _ in readings), readings[-1][1], len(readings)


def _steps_found(work: Path) -> str:
    path = work / "steps.tsv"
    lines = path.read_text().splitlines() if path.exists() else []
    outcomes = [_OUTCOMES.get(line.split("\t")[1], "exit " + line.split("\t")[1]) for line in lines if line.strip()]
    return ", ".join(f"{outcomes.count(o)} {o}" for o in dict.fromkeys(outcomes)) or "no steps recorded"


def _found(part: str, work: Path) -> str:
    """What the part found, in a few words, from its own files: the summary table's cell."""
    found = f"steps: {_steps_found(work)}"
    if part in ("tier", "bench"):
        found += "; " + (_tier if part == "tier" else _bench)(work)[0]
    elif part == "parity":
        verdicts = [row.rsplit("|", 2)[-2].strip() for row in _checks(work)[2:]]
        found += f"; check-logprobs: {verdicts.count('ok')} ok, {verdicts.count('FAIL')} FAIL"
    elif part == "debate":
        found += "; mini debate: " + ", ".join(_debate_ending(work))
    elif part in ("scale", "full") and (work / "scale.json").exists():
        r = json.loads((work / "scale.json").read_text())
        if r.get("plan_failures"):
            found += "; peak above the plan: " + ", ".join(f.split(" peak")[0] for f in r["plan_failures"])
        elif r.get("plan_judged"):
            found += f"; the plan held ({', '.join(r['plan_judged'])})"
        else:
            found += "; the plan not judged"
    return found


SUMMARY = re.compile(r"^<!-- gpu-check summary (?P<json>\{.*\}) -->$", re.MULTILINE)


def section(part: str, work: Path, status: int, planned: float, seconds: float, dry_run: bool,
            now: datetime.datetime | None = None, alongside: str = "",
            environ: dict[str, str] | None = None) -> str:
    """The markdown section of one part's run (see the module docstring).

    ``alongside``: the parts that ran on the same card at the same time (comma-separated; ``gpu-check.sh
    --together``). The ``TINKER_LOCAL_*`` variables of ``environ`` (default: this process's) are listed: they
    change what a part measures (``TINKER_LOCAL_NUMERICS=exact``, say). A summary line (an HTML comment under the
    marker: the verdict, what the part found, the card's memory) is what ``merge`` builds the run's table from.
    """
    now = now or datetime.datetime.now(datetime.timezone.utc)
    verdict = "dry run, nothing measured" if dry_run else (
        "all gated checks passed" if status == 0 else "SOME GATED CHECKS FAILED")
    card = None if dry_run else _card_memory(work)
    summary = {"part": part, "verdict": verdict, "found": "nothing run" if dry_run else _found(part, work),
               "card_mib": list(card[:2]) if card else None}
    lines = [f"<!-- gpu-check part={part} ran={now:%Y-%m-%dT%H:%MZ} -->",
             f"<!-- gpu-check summary {json.dumps(summary)} -->",
             f"### Part `{part}`, {now:%Y-%m-%d %H:%M} UTC: {verdict}", "",
             f"- {seconds / 60:.1f} of {planned:g} planned minutes"]
    lines += [f"- host: {socket.gethostname()} (dry run: no GPU used)"] if dry_run else _machine()
    if not dry_run:
        lines.append(f"- card memory in use (nvidia-smi, every process on the card): at most {card[0]:,} of "
                     f"{card[1]:,} MiB over {card[2]} readings" if card else
                     "- card memory in use: not recorded (no nvidia-smi readings)")
    if alongside:
        lines.append(f"- ran alongside {alongside.replace(',', ', ')} on the same card: its times are upper bounds")
    settings = sorted((k, v) for k, v in (os.environ if environ is None else environ).items()
                      if k.startswith("TINKER_LOCAL_"))
    if settings:
        lines.append("- settings: " + ", ".join(f"{k}={v}" for k, v in settings))
    renderer = RENDERERS.get(part)
    lines += ["", *_steps(work), ""]
    if renderer is not None and not dry_run:
        lines += [*renderer(work), ""]
    return "\n".join(lines)


def summary_table(sections: list[tuple[str, str, str]]) -> list[str]:
    """The run's table, one row per section, from the summary lines the sections carry (never typed)."""
    rows = ["| part | ran (UTC) | verdict | what it found | card memory in use (nvidia-smi, every process) |",
            "|---|---|---|---|---|"]
    for part, ran, text in sections:
        found = SUMMARY.search(text)
        if found is None:
            rows.append(f"| {part} | {ran} | (no summary line) | | |")
            continue
        s = json.loads(found["json"])
        card = f"at most {s['card_mib'][0]:,} of {s['card_mib'][1]:,} MiB" if s.get("card_mib") else "not recorded"
        rows.append(f"| {part} | {ran} | {s['verdict']} | {s['found'].replace('|', '/')} | {card} |")
    return rows


def _sections(folder: Path) -> list[tuple[str, str, str]]:
    """(part, ran, text) of every section in ``folder``'s markdown files."""
    found = []
    for path in sorted(folder.glob("*.md")):
        text = path.read_text()
        match = MARKER.search(text)
        if match is not None:
            found.append((match["part"], match["ran"], text.strip() + "\n"))
    return found


def merge(doc: Path, folders: list[Path]) -> list[str]:
    """Append the new sections of ``folders`` to ``doc``; returns the parts added (see the module docstring)."""
    record = doc.read_text() if doc.exists() else ""
    present = {(m["part"], m["ran"]) for m in MARKER.finditer(record)}
    new = []
    for folder in folders:
        sections = _sections(folder)
        if not sections:
            raise SystemExit(f"{folder}: no gpu-check section (*.md with a marker line); pass the folders the "
                             "parts' files came back in")
        new += [s for s in sections if (s[0], s[1]) not in present]
    if not new:
        return []
    order = {name: i for i, name in enumerate(PART_ORDER)}
    new = sorted(dict.fromkeys(new), key=lambda s: (s[1][:10], order.get(s[0], len(order)), s[0], s[1]))
    blocks = []
    for day in dict.fromkeys(s[1][:10] for s in new):
        parts = [s for s in new if s[1][:10] == day]
        heading = f"## Run of {day} (`scripts/gpu-check.sh --part`: {', '.join(s[0] for s in parts)})"
        table = "\n".join(summary_table(parts))
        blocks.append(heading + "\n\n" + table + "\n\n" + "\n".join(s[2] for s in parts))
    doc.write_text(record.rstrip("\n") + "\n\n" + "\n".join(blocks))
    return [s[0] for s in new]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("section", help="print one part's section")
    one.add_argument("part")
    one.add_argument("work", type=Path)
    one.add_argument("--status", type=int, default=0)
    one.add_argument("--planned", type=float, required=True)
    one.add_argument("--seconds", type=float, required=True)
    one.add_argument("--dry-run", action="store_true")
    one.add_argument("--alongside", default="", help="parts that shared the card (comma-separated)")
    fold = commands.add_parser("merge", help="fold returned sections into the record")
    fold.add_argument("doc", type=Path)
    fold.add_argument("folders", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "section":
        print(section(args.part, args.work, args.status, args.planned, args.seconds, args.dry_run,
                      alongside=args.alongside))
        return 0
    added = merge(args.doc, args.folders)
    print(f"{args.doc}: added {', '.join(added)}" if added else f"{args.doc}: nothing new (sections already there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
