"""scripts/gpu-check.sh in parts: selection, exactly two files per part under $OUT, time budgets, and the merge.

The GPU machine allows 10 minutes per command and brings back at most 8 files; each part must fit one command
(planned <= 8 minutes, enforced by a budget) and leave its section and one archive. Parts run here with
``--dry-run`` (steps listed, not run) or, sourced, with a fake part whose steps are ordinary commands.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
SCRIPT = REPO_ROOT / "scripts" / "gpu-check.sh"
DOC = REPO_ROOT / "docs" / "gpu-validation.md"
PARTS = ("tier", "parity", "bench", "debate", "scale", "full", "invariance", "speed")
STAGING_MINUTES = 2


def _report():
    spec = importlib.util.spec_from_file_location("gpu_report", REPO_ROOT / "scripts" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bash(*args: str, out: Path | None = None, script: str | None = None, **env: str):
    environment = {**os.environ, "PYTHON": sys.executable, **env}
    if out is not None:
        environment["OUT"] = str(out)
    command = ["bash", "-c", script] if script is not None else ["bash", str(SCRIPT), *args]
    return subprocess.run(command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=120,
                          check=False)


def _listed() -> dict[str, int]:
    result = _bash("--list")
    assert result.returncode == 0, result.stderr
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\S+)\s+(\d+) min", result.stdout, re.MULTILINE)}


def test_the_parts_each_fit_one_command_and_the_numerics_fit_a_short_lease():
    listed = _listed()
    assert tuple(listed) == PARTS
    assert all(minutes <= 8 for minutes in listed.values())
    # a 15-minute lease runs the gpu tier and the numerics' own check side by side (--together), after staging
    assert STAGING_MINUTES + max(listed["tier"], listed["invariance"]) + 1 <= 15


def test_each_part_may_run_its_planned_minutes_inside_one_ten_minute_command(tmp_path):
    for part, minutes in _listed().items():
        result = _bash("--part", part, "--dry-run", out=tmp_path / part)
        budget = int(re.search(r"budget (\d+) s", result.stdout)[1])
        assert minutes * 60 < budget <= 540, (part, minutes, budget)


def test_the_record_documents_the_parts_as_the_script_plans_them():
    documented = {m[1]: int(m[2]) for m in re.finditer(r"^\| `(\w+)` \| (\d+) \|", DOC.read_text(), re.MULTILINE)}
    assert documented == _listed()


@pytest.mark.parametrize("part", PARTS)
def test_a_part_leaves_exactly_its_section_and_its_archive(tmp_path, part):
    result = _bash("--part", part, "--dry-run", out=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{part}.md", f"{part}.tar.gz"]
    section = (tmp_path / f"{part}.md").read_text()
    assert section.startswith(f"<!-- gpu-check part={part} ran=") and "dry run, nothing measured" in section
    assert "| dry run (not run) |" in section
    with tarfile.open(tmp_path / f"{part}.tar.gz") as archive:
        assert "./steps.tsv" in archive.getnames()


def test_an_unknown_part_or_a_missing_name_is_a_usage_error(tmp_path):
    result = _bash("--part", "sclae", out=tmp_path)
    assert result.returncode == 2 and "unknown part 'sclae'" in result.stderr and "parity" in result.stderr
    assert _bash("--part", out=tmp_path).returncode == 2
    assert _bash("--part", "tier", "--bogus", out=tmp_path).returncode == 2
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_a_part_added_by_sourcing_runs_within_its_budget(tmp_path):
    """A fake part: a step that outlasts the budget is interrupted and reported, later steps are not run, an
    ungated failure does not fail the part, and an archive over the limit drops the step records."""
    script = f"""
        source {SCRIPT}
        PARTS+=("fake|1|a part made of ordinary commands")
        ARCHIVE_LIMIT_BYTES=4096
        part_fake() {{
          step quick gated true
          step expected-failure ungated false
          step records gated bash -c "head -c 100000 /dev/urandom > $work/training_step_1.json"
          step slow gated sleep 30
          step after gated true
        }}
        cd {REPO_ROOT}
        run_part fake
    """
    result = _bash(script=script, out=tmp_path, GPU_CHECK_BUDGET_S="8")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.md", "fake.tar.gz"]
    section = (tmp_path / "fake.md").read_text()
    assert "SOME GATED CHECKS FAILED" in section
    assert "| quick | ok |" in section and "| expected-failure | exit 1 (expected, not gated) |" in section
    assert "| slow | TIMED OUT |" in section and "| after | not run: out of time | 0 |" in section
    assert "per-step records left out" in section
    with tarfile.open(tmp_path / "fake.tar.gz") as archive:
        names = archive.getnames()
    assert "./slow.log" in names and "./training_step_1.json" not in names


def test_merge_folds_sections_in_part_order_once(tmp_path):
    doc = tmp_path / "record.md"
    doc.write_text("# GPU validation record\n\n## Runs\n")
    folders = []
    for part in ("debate", "tier"):
        folder = tmp_path / part
        assert _bash("--part", part, "--dry-run", out=folder).returncode == 0
        folders.append(str(folder))
    result = _bash("--merge", "--doc", str(doc), *folders)
    assert result.returncode == 0 and "added tier, debate" in result.stdout, result.stdout + result.stderr
    merged = doc.read_text()
    assert merged.startswith("# GPU validation record\n\n## Runs\n")
    heading = r"^## Run of \d{4}-\d\d-\d\d \(`scripts/gpu-check.sh --part`: tier, debate\)$"
    assert re.search(heading, merged, re.MULTILINE)
    assert merged.index("part=tier") < merged.index("part=debate")
    again = _bash("--merge", "--doc", str(doc), *folders)
    assert again.returncode == 0 and "nothing new" in again.stdout and doc.read_text() == merged
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = _bash("--merge", "--doc", str(doc), str(empty))
    assert refused.returncode != 0 and "no gpu-check section" in refused.stderr


def test_a_section_reports_what_the_part_left_and_what_it_did_not(tmp_path):
    (tmp_path / "steps.tsv").write_text("gpu-tier\t1\t312\tgated\n")
    (tmp_path / "gpu-tier.xml").write_text(
        '<testsuites><testsuite><testcase name="test_bf16_parity[tiny-T1-exact]"><properties>'
        '<property name="max_abs_diff" value="0.0"/><property name="mean_abs_diff" value="0.0"/>'
        '<property name="num_tokens" value="2048"/></properties></testcase>'
        '<testcase name="test_bf16_parity[tiny-T1-invariant]"><failure message="mean"/></testcase>'
        "</testsuite></testsuites>")
    now = datetime.datetime(2026, 11, 25, 9, 30, tzinfo=datetime.timezone.utc)
    report = _report()
    section = report.section("tier", tmp_path, status=1, planned=6, seconds=312, dry_run=False, now=now)
    assert section.startswith("<!-- gpu-check part=tier ran=2026-11-25T09:30Z -->")
    assert "SOME GATED CHECKS FAILED" in section and "5.2 of 6 planned minutes" in section
    assert "| gpu-tier | exit 1 | 312 |" in section
    assert "| test_bf16_parity[tiny-T1-exact] | passed | 0 | 0 | 2048 |" in section
    assert "| test_bf16_parity[tiny-T1-invariant] | failed |" in section
    assert "benchmarks" not in section  # only the tier's own figures
    debate = report.section("debate", tmp_path, status=1, planned=3, seconds=10, dry_run=False, now=now)
    assert "mini debate: no run directory" in debate
    run = tmp_path / "logs" / "20261125_rs_grpo_summary_mini"
    run.mkdir(parents=True)
    rows = [{"step": 0, "time/step_s": 2.0, "time/sample_s": 1.0, "mismatch/abs_logprob_diff": 0.002,
             "engine/graph_captures": 40.0, "engine/cache_rebuilds": 1.0},
            {"step": 1, "time/step_s": 4.0, "time/sample_s": 3.0, "skipped": True}]
    (run / "train_log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    debate = report.section("debate", tmp_path, status=0, planned=3, seconds=10, dry_run=False, now=now)
    assert ("2 steps, median 3.00 s/step (sample 2.00 s), mismatch/abs_logprob_diff max 0.002, graph captures 40.0, "
            "cache rebuilds 1.0, rubric not run (the run ended before it)") in debate  # no rubric output: not "0"


def test_the_scale_section_reports_the_phases_a_stopped_run_finished(tmp_path):
    report = _report()
    gib = 1 << 30
    figures = {"device": "cuda", "gpu": "NVIDIA H100", "dtype": "bfloat16", "planned_sampling_peak": 30 * gib,
               "planned_training_peak": 70 * gib, "plan": ["fits: peak 70.00 GiB of 72.00 GiB usable"],
               "decode_ms_per_step": 2.5}
    (tmp_path / "scale.json").write_text(json.dumps(figures))
    lines = report._scale(tmp_path)
    assert lines[0] == "decode 2.50 ms/step at 64 x 256 on NVIDIA H100 (bfloat16) (target <= 3 ms)"
    assert lines[1:3] == ["one step of the h100-rlvr shape: sampling not finished", "training: not finished"]
    figures.update(sample_s=100.0, prefill_s=4.0, decode_steps=1536, sampling_peak_bytes=29 * gib)
    (tmp_path / "scale.json").write_text(json.dumps(figures))
    assert report._scale(tmp_path)[1] == ("one step of the h100-rlvr shape: sample 100.0 s (prefill 4.0 s, 1536 decode "
                                          "steps), peak 29.0 GiB measured, 30.0 GiB planned")


def test_the_invariance_section_reports_each_equality_the_parity_and_the_times(tmp_path):
    report = _report()
    assert report._invariance(tmp_path) == ["invariance: no invariance.json (scripts/invariance_check.py did not "
                                            "finish)"]
    figures = {"equal": {"one batch": True, "one by one": False},
               "parity": {"T=1.0": {"tokens": 2048, "max": 0.0, "mean": 0.0}},
               "seconds": {"forward_backward (12 sequences)": {"invariant": [1.0, 2.0, 3.0], "native": [2.0, 2.0, 2.0],
                                                               "ratio": 1.0}}}
    (tmp_path / "invariance.json").write_text(json.dumps(figures))
    assert report._invariance(tmp_path) == [
        "- one batch: bitwise equal to one batch", "- one by one: DIFFERENT to one batch",
        "- sampler vs trainer T=1.0: max |d| 0, mean 0 over 2048 tokens",
        "- forward_backward (12 sequences): default 2 s, native 2 s (x1.00)"]


def test_parts_run_together_each_leave_their_files_and_name_the_parts_beside_them(tmp_path):
    result = _bash("--together", "tier", "debate", "scale", "--dry-run", out=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{part}.{ext}" for part in ("tier", "debate", "scale") for ext in ("md", "tar.gz"))
    assert "- ran alongside debate, scale on the same card" in (tmp_path / "tier.md").read_text()
    assert "- ran alongside tier, debate on the same card" in (tmp_path / "scale.md").read_text()
    assert result.stdout.index("######## tier") < result.stdout.index("######## debate")


def test_together_refuses_an_unknown_part_before_running_any(tmp_path):
    result = _bash("--together", "tier", "nonsense", "--dry-run", out=tmp_path)
    assert result.returncode == 2 and "unknown part 'nonsense'" in result.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_section_names_the_backend_settings_its_run_had(tmp_path):
    (tmp_path / "steps.tsv").write_text("")
    text = _report().section("debate", tmp_path, 0, 3, 60, True,
                             environ={"TINKER_LOCAL_NUMERICS": "exact", "HOME": "/root"})
    assert "- settings: TINKER_LOCAL_NUMERICS=exact" in text and "HOME" not in text
    assert "settings" not in _report().section("debate", tmp_path, 0, 3, 60, True, environ={})
