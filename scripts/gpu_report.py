"""Append a dated section with the figures of one `scripts/gpu-check.sh` run to docs/gpu-validation.md.

    python scripts/gpu_report.py OUT_DIR docs/gpu-validation.md --status 0

Reads what the check left in OUT_DIR: the gpu tier's JUnit XML (outcomes and the properties the
parity tests record), the check-logprobs outputs, the benchmark JSON and the mini debate's run
directory. Anything missing is reported as missing, never invented.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path


def _machine() -> list[str]:
    import torch
    import transformers

    lines = [f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"- device: {props.name}, {props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} GPU(s)")
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except OSError:
        driver = "nvidia-smi not found"
    lines += [f"- driver: {driver or 'unknown'}", f"- torch {torch.__version__} (CUDA {torch.version.cuda}), "
              f"transformers {transformers.__version__}"]
    return lines


def _tier(out: Path) -> list[str]:
    path = out / "gpu-tier.xml"
    if not path.exists():
        return ["gpu tier: no JUnit XML (the tier did not run)"]
    rows = ["| test | outcome | max abs | mean abs | tokens |", "|---|---|---|---|---|"]
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        fmt = lambda key: f"{float(props[key]):.3g}" if key in props else ""  # noqa: E731
        rows.append(f"| {case.get('name')} | {outcome} | {fmt('max_abs_diff')} | {fmt('mean_abs_diff')} | "
                    f"{props.get('num_tokens', '')} |")
    return rows


def _checks(out: Path) -> list[str]:
    rows = ["| check-logprobs (smollm2, 16 x 128) | max abs | mean abs | verdict |", "|---|---|---|---|"]
    for path in sorted(out.glob("check-*.txt")):
        text = path.read_text(errors="replace")
        found = {k: re.search(rf"^{k}: (\S+)", text, re.M) for k in ("max_abs_diff", "mean_abs_diff")}
        verdict = "ok" if text.rstrip().endswith("ok") else "FAIL"
        rows.append(f"| {path.stem.removeprefix('check-')} | {found['max_abs_diff'].group(1) if found['max_abs_diff'] else '-'}"
                    f" | {found['mean_abs_diff'].group(1) if found['mean_abs_diff'] else '-'} | {verdict} |")
    return rows


def _bench(out: Path) -> list[str]:
    path = out / "bench-gpu.json"
    if not path.exists():
        return ["benchmarks: no JSON (they did not run)"]
    rows = ["| benchmark | median | extra |", "|---|---|---|"]
    for bench in json.loads(path.read_text())["benchmarks"]:
        extra = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in bench.get("extra_info", {}).items())
        rows.append(f"| {bench['name']} | {bench['stats']['median']:.4g} s | {extra} |")
    return rows


def _debate(out: Path) -> list[str]:
    logs = sorted((out / "logs").glob("*/train_log.jsonl")) if (out / "logs").exists() else []
    if not logs:
        return ["mini debate: no run directory"]
    steps = [json.loads(line) for line in logs[-1].read_text().splitlines() if line.strip()]
    step_s = [s["time/step_s"] for s in steps]
    mismatch = [s.get("mismatch/abs_logprob_diff", float("nan")) for s in steps]
    tail = (out / "mini-debate.txt").read_text(errors="replace") if (out / "mini-debate.txt").exists() else ""
    failed = tail.count("FAIL ")
    return [f"mini debate RS->GRPO (-n 64 --num-groups 4 -s 10): {len(steps)} steps, median "
            f"{statistics.median(step_s):.2f} s/step (sample {statistics.median(s['time/sample_s'] for s in steps):.2f} s), "
            f"mismatch/abs_logprob_diff max {max(mismatch):.3g}, rubric failures {failed}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("doc", type=Path)
    parser.add_argument("--status", type=int, default=0)
    args = parser.parse_args()
    section = ["", f"## Run of {datetime.date.today().isoformat()} (`bash scripts/gpu-check.sh`, "
               f"{'all gated checks passed' if args.status == 0 else 'SOME GATED CHECKS FAILED'})", "",
               *_machine(), "", *_tier(args.out), "", *_checks(args.out), "", *_bench(args.out), "",
               *_debate(args.out), ""]
    with args.doc.open("a") as handle:
        handle.write("\n".join(section))
    print("\n".join(section))


if __name__ == "__main__":
    main()
