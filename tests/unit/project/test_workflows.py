"""Every GitHub Actions workflow in .github/workflows/ is well formed and runs only what the project has.

A workflow is copied by users and runs where nobody watches it being written, so a renamed script,
marker, subcommand or environment variable must fail here, not in someone's CI. Checked for each
``run:`` step: ``scripts/X.sh`` exists; the marker expression after ``-m`` of ``pytest`` or
``scripts/test.sh`` names only markers registered in pyproject.toml; ``rlrunbook SUB`` names a
subcommand of ``rlrunbook.cli.build_parser()``; every ``RLRUNBOOK_*`` variable the workflow sets
(``env:`` or ``NAME=`` in a script) is read somewhere in src/, tests/ or scripts/.
"""

from __future__ import annotations

import argparse
import itertools
import re
from pathlib import Path

import pytest
import yaml
from shell_words import simple_commands

from rlrunbook.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
_SETS_ENV = re.compile(r"\b(RLRUNBOOK_[A-Z0-9_]+)=")
_MARK_WORDS = re.compile(r"[A-Za-z_][\w]*")


def _subcommands() -> set[str]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(action.choices)


def _markers(pytestconfig: pytest.Config) -> set[str]:
    return {line.split(":", 1)[0].strip() for line in pytestconfig.getini("markers")}


def _read_names() -> str:
    """The text of src/, tests/ and scripts/ (but this file): a variable the workflow sets is read there."""
    here = Path(__file__).resolve()
    files = [p for folder in ("src", "tests", "scripts") for p in (ROOT / folder).rglob("*")
             if p.suffix in (".py", ".sh") and p.resolve() != here]
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def workflow_problems(path: Path, markers: set[str], subcommands: set[str], read_text: str) -> list[str]:
    """Everything wrong with one workflow file, as messages naming the job, the step and the value."""
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        return [f"{path.name}: not valid YAML: {error}"]
    if not isinstance(document, dict):
        return [f"{path.name}: the top level is not a mapping"]
    problems = []
    # YAML 1.1 (PyYAML) reads the bare key `on` as the boolean True.
    if "on" not in document and True not in document:
        problems.append(f"{path.name}: no `on:` (the events that trigger it)")
    jobs = document.get("jobs")
    if not isinstance(jobs, dict) or not jobs:
        return [*problems, f"{path.name}: no `jobs:`"]
    env_names = dict.fromkeys(document.get("env") or {}, path.name)  # name -> where it is set
    for job_id, job in jobs.items():
        where = f"{path.name}: job {job_id}"
        if not isinstance(job, dict):
            problems.append(f"{where}: not a mapping")
            continue
        if "runs-on" not in job:
            problems.append(f"{where}: no `runs-on`")
        steps = job.get("steps")
        if not isinstance(steps, list) or not steps:
            problems.append(f"{where}: no `steps`")
            continue
        env_names |= dict.fromkeys(job.get("env") or {}, where)
        for index, step in enumerate(steps):
            step_where = f"{where}, step {step.get('name', index) if isinstance(step, dict) else index}"
            if not isinstance(step, dict) or not ("run" in step or "uses" in step):
                problems.append(f"{step_where}: neither `run` nor `uses`")
                continue
            env_names |= dict.fromkeys(step.get("env") or {}, step_where)
            if "run" in step:
                script = str(step["run"])
                env_names |= dict.fromkeys(_SETS_ENV.findall(script), step_where)
                problems += _command_problems(script, step_where, markers, subcommands)
    for name, where in sorted(env_names.items()):
        if str(name).startswith("RLRUNBOOK_") and name not in read_text:
            problems.append(f"{where}: sets {name}, which nothing in src/, tests/ or scripts/ reads")
    return problems


def _command_problems(script: str, where: str, markers: set[str], subcommands: set[str]) -> list[str]:
    problems = []
    for words in simple_commands(script):
        for word in words:
            if re.fullmatch(r"(\./)?scripts/[\w./-]+\.(sh|py)", word) and not (ROOT / word).is_file():
                problems.append(f"{where}: runs {word}, which does not exist")
        starts = [i for i, w in enumerate(words) if Path(w).name in ("pytest", "test.sh")]
        if starts:  # pytest's own options follow it (`python -m pytest -m gpu`: the first -m is python's)
            pytest_words = words[starts[0] + 1:]
            for flag, value in itertools.pairwise(pytest_words):
                if flag == "-m":
                    unknown = set(_MARK_WORDS.findall(value)) - {"and", "or", "not"} - markers
                    problems += [f"{where}: -m {value!r} names marker {m!r}, not registered in pyproject.toml"
                                 for m in sorted(unknown)]
        for position, word in enumerate(words[:-1]):
            if Path(word).name == "rlrunbook" and words[position + 1] not in subcommands:
                problems.append(f"{where}: `rlrunbook {words[position + 1]}` is not an rlrunbook subcommand")
    return problems


@pytest.fixture(scope="module")
def context(pytestconfig):
    return _markers(pytestconfig), _subcommands(), _read_names()


def test_the_ci_workflow_is_there():
    assert ROOT / ".github" / "workflows" / "ci.yml" in WORKFLOWS


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.name for p in WORKFLOWS])
def test_workflow_runs_only_what_the_project_has(path, context):
    assert workflow_problems(path, *context) == []


def test_ci_runs_every_tier_on_its_runner():
    document = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    jobs = document["jobs"]
    scripts = {job_id: "\n".join(str(s.get("run", "")) for s in job["steps"]) for job_id, job in jobs.items()}
    assert jobs["cpu"]["runs-on"] == "ubuntu-latest" and "bash scripts/test.sh" in scripts["cpu"]
    assert "RLRUNBOOK_REQUIRE_VLLM=1 bash scripts/test.sh -m vllm" in scripts["vllm"]
    assert jobs["gpu"]["runs-on"] == ["self-hosted", "gpu"]
    assert "RLRUNBOOK_REQUIRE_GPU=1 bash scripts/test.sh -m gpu" in scripts["gpu"]
    assert "--benchmark-autosave" in scripts["gpu"] and "rlrunbook bench-history" in scripts["gpu"]
    uploads = [s for s in jobs["gpu"]["steps"] if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert len(uploads) == 1 and "bench.json" in uploads[0]["with"]["path"]
    triggers = document[True]  # PyYAML reads the key `on` as True
    assert {"push", "pull_request", "workflow_dispatch"} <= set(triggers)
    assert "refs/heads/main" in jobs["gpu"]["if"] and "workflow_dispatch" in jobs["gpu"]["if"]


_GOOD_STEP = "bash scripts/test.sh -m 'gpu and not slow'"


@pytest.mark.parametrize(("run", "expected"), [
    ("bash scripts/no-such-script.sh", "scripts/no-such-script.sh, which does not exist"),
    ("bash scripts/test.sh -m gpus", "marker 'gpus'"),
    ("pytest -m 'not benchmark and nightly'", "marker 'nightly'"),
    (".venv/bin/rlrunbook bench-histroy --png x.png", "`rlrunbook bench-histroy` is not an rlrunbook"),
    ("RLRUNBOOK_NO_SUCH_KNOB=1 bash scripts/test.sh", "sets RLRUNBOOK_NO_SUCH_KNOB"),
])
def test_a_bad_command_is_named(run, expected, tmp_path, context):
    workflow = {"on": {"push": None}, "jobs": {"t": {"runs-on": "ubuntu-latest", "steps": [
        {"run": _GOOD_STEP}, {"name": "bad", "run": run}]}}}
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump(workflow))
    problems = workflow_problems(path, *context)
    assert len(problems) == 1 and expected in problems[0] and "step bad" in problems[0], problems
    good = {"t": {"runs-on": "x", "steps": [{"run": _GOOD_STEP}]}}
    path.write_text(yaml.safe_dump({**workflow, "jobs": good}))
    assert workflow_problems(path, *context) == []


def test_a_workflow_without_triggers_runs_on_or_steps_is_named(tmp_path, context):
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump({"jobs": {"a": {"steps": [{"run": "true"}]}, "b": {"runs-on": "x"}}}))
    problems = workflow_problems(path, *context)
    assert problems == ["bad.yml: no `on:` (the events that trigger it)", "bad.yml: job a: no `runs-on`",
                        "bad.yml: job b: no `steps`"]
    path.write_text("on: [push]\njobs: {a: {runs-on: x, steps: [{run: true}]}\n")  # an unclosed brace
    assert "not valid YAML" in workflow_problems(path, *context)[0]
    env_set = {"on": ["push"], "env": {"RLRUNBOOK_REQUIRE_GPU": "1", "RLRUNBOOK_BOGUS": "1"},
               "jobs": {"a": {"runs-on": "x", "steps": [{"run": "true"}]}}}
    path.write_text(yaml.safe_dump(env_set))
    assert workflow_problems(path, *context) == [
        "bad.yml: sets RLRUNBOOK_BOGUS, which nothing in src/, tests/ or scripts/ reads"]
