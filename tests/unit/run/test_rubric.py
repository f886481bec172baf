"""Tests of rlrunbook.run.rubric: the seed runbooks' rubrics over a run directory.

Two synthetic runs are written through ``RunWriter`` exactly as the training loop writes them (a
2-step single-turn summary run, a 2-step debate run with injected opponent tokens under mask 0);
every check passes on both. Then each mutation breaks one rule, and exactly that check must fail,
with a detail naming the file or step, and without the checker raising.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from rlrunbook.run import RunWriter, check_run, format_results, rubric_passed
from rlrunbook.run.__main__ import main as rubric_main

STEPS = 2


def _log_row(step: int) -> dict:
    return {
        "step": step,
        "reward/mean": 0.5,
        "reward/std": 0.1,
        "reward/min": 0.25,
        "reward/max": 0.75,
        "advantage/nonzero_count": 12,
        "advantage/min": -0.25,
        "advantage/max": 0.25,
        "loss/sum": 0.3 - step,
        "num_datums": 4,
        "num_trained_tokens": 12,
        "completion_length/mean": 3.0,
        "time/sample_s": 0.1,
        "time/score_s": 0.01,
        "time/forward_backward_s": 0.2,
        "time/optim_s": 0.05,
        "time/step_s": 0.4,
        "throughput/sampled_tokens_per_s": 30.0,
        "throughput/trained_tokens_per_s": 60.0,
        "memory/rss_mb": 512.0,
    }


def _datum(step: int, i: int, mask: list[int]) -> dict:
    """A datum whose advantages are the centred reward on mask-1 tokens and exactly 0 on mask-0 tokens."""
    centred = 0.25 if i % 2 == 0 else -0.25
    n = len(mask)
    return {
        "prompt_tokens": [1, 2, 3 + step],
        "completion_tokens": [10 + j for j in range(n)],
        "completion_logprobs": [-0.5] * n,
        "completion_advantages": [centred * m for m in mask],
        "completion_mask": mask,
        "metadata": {
            "reward": 0.5 + centred,
            "centered_reward": centred,
            "role": "a" if i % 2 == 0 else "b",
            "group": i // 2,
            "problem_id": f"p{i // 2}",
        },
    }


def _step_payload(step: int, mask: list[int]) -> dict:
    return {
        "loss_fn": "importance_sampling",
        "training_data": [_datum(step, i, mask) for i in range(4)],
        "results": {"metrics": {"loss:sum": 0.3 - step}},
        "num_trained_tokens": 4 * sum(mask),
    }


def _summary_records(step: int) -> dict:
    records = [
        {
            "problem_id": f"p{i // 2}",
            "group": i // 2,
            "completion_text": "a short summary",
            "completion_tokens": [10, 11, 12],
            "reward": 0.5 + 0.1 * i,
            "reward_metrics": {"compression": 0.3, "rouge1": 0.2 * i},
            "stop_reason": "stop",
        }
        for i in range(4)
    ]
    return {"env": "summary", "records": records}


def _debates(step: int) -> dict:
    def turn(text: str, first: int) -> dict:
        return {"text": text, "tokens": [first, first + 1]}

    debates = [
        {
            "debate_id": f"s{step}-d{g}",
            "problem_id": f"p{g}",
            "group": g,
            "rounds": [
                {"round": r, "a": turn(f"a{r}", 10 * r), "b": turn(f"b{r}", 10 * r + 5)} for r in (1, 2, 3)
            ],
            "verdict": {"winner": "a", "judge": "mock", "scores": {"a": 0.7, "b": 0.3}},
            "task_rewards": {"a": 1.0, "b": 0.0},
        }
        for g in range(2)
    ]
    return {"env": "qa", "debates": debates}


def write_fake_run(run_dir: Path, mode: str) -> Path:
    """A complete, rubric-passing 2-step run written by RunWriter ("single_turn" summary or "debate" qa)."""
    run_dir.mkdir(parents=True)
    env = "summary" if mode == "single_turn" else "qa"
    writer = RunWriter(run_dir, environ={})
    writer.write_metadata(
        {"mode": mode, "env": env, "steps": STEPS, "seed": 0},
        {"steps": "cli"},
        ["rlrunbook", "train"],
        {"name": "fake", "fingerprint": "0" * 16},
    )
    # Debate: the trained debater's tokens (1) around an injected opponent turn (0).
    mask = [1, 1, 1] if mode == "single_turn" else [1, 1, 0, 0, 1]
    for step in range(STEPS):
        writer.log_step(_log_row(step))
        writer.write_step(step, _step_payload(step, mask))
        if mode == "single_turn":
            writer.write_rollouts("summary", step, _summary_records(step))
        else:
            writer.write_rollouts("debate", step, _debates(step))
    writer.write_report()
    writer.finish("completed")
    return run_dir


def edit_json(path: Path, change: Callable[[dict], None]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def failing(results) -> dict[str, str]:
    return {r.name: r.detail for r in results if not r.passed}


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict[str, Path]:
    """One fake run per mode, written once (drawing report.png is the slow part) and copied per test."""
    root = tmp_path_factory.mktemp("templates")
    return {mode: write_fake_run(root / mode, mode) for mode in ("single_turn", "debate")}


@pytest.fixture
def fresh_run(templates, tmp_path) -> Callable[[str], Path]:
    return lambda mode, name="run": Path(shutil.copytree(templates[mode], tmp_path / name))


@pytest.fixture(params=["single_turn", "debate"])
def fake_run(request, fresh_run) -> Path:
    return fresh_run(request.param, f"run_{request.param}")


def test_fake_runs_pass_every_check(fake_run):
    results = check_run(fake_run)
    assert failing(results) == {}, format_results(results)
    assert rubric_passed(results)
    names = [r.name for r in results]
    mode_checks = (
        {"rollouts.records"} if "single_turn" in fake_run.name else {"debate.rounds", "debate.verdicts"}
    )
    assert mode_checks <= set(names)
    assert len(names) == len(set(names)) == 13 + len(mode_checks)


def _set_datum(step_file: str, field: str, value) -> Callable[[Path], None]:
    return lambda d: edit_json(d / step_file, lambda doc: doc["training_data"][0].__setitem__(field, value))


def _zero_advantages(run_dir: Path) -> None:
    def change(doc):
        for datum in doc["training_data"]:
            datum["completion_advantages"] = [0.0] * len(datum["completion_advantages"])

    edit_json(run_dir / "training_step_1.json", change)


def _zero_losses(run_dir: Path) -> None:
    for step in range(STEPS):
        edit_json(
            run_dir / f"training_step_{step}.json",
            lambda doc: doc["results"]["metrics"].update({"loss:sum": 0.0}),
        )


def _drop_round_3(run_dir: Path) -> None:
    edit_json(run_dir / "debate_1.json", lambda doc: doc["debates"][1]["rounds"].pop())


def _leak_masked_advantage(run_dir: Path) -> None:
    # Token 2 is the opponent's (mask 0): giving it an advantage would train on the opponent's words.
    edit_json(
        run_dir / "training_step_0.json",
        lambda doc: doc["training_data"][3]["completion_advantages"].__setitem__(2, 0.25),
    )


def _truncate(name: str, keep: int | None = None) -> Callable[[Path], None]:
    def cut(run_dir: Path) -> None:
        data = (run_dir / name).read_bytes()
        (run_dir / name).write_bytes(data[: keep if keep is not None else len(data) // 2])

    return cut


def _train_log_lines(change: Callable[[list[str]], list[str]]) -> Callable[[Path], None]:
    def edit(run_dir: Path) -> None:
        path = run_dir / "train_log.jsonl"
        path.write_text("".join(line + "\n" for line in change(path.read_text().splitlines())))

    return edit


# (mode, mutation id, mutate, the one check that must fail, text its detail must contain)
MUTATIONS = [
    (
        "single_turn",
        "delete training step",
        lambda d: (d / "training_step_1.json").unlink(),
        "training_steps.present",
        "training_step_1.json: missing",
    ),
    (
        "single_turn",
        "delete summary records",
        lambda d: (d / "summary_0.json").unlink(),
        "rollouts.present",
        "summary_0.json: missing",
    ),
    (
        "debate",
        "delete debate records",
        lambda d: (d / "debate_1.json").unlink(),
        "rollouts.present",
        "debate_1.json",
    ),
    ("debate", "delete report", lambda d: (d / "report.png").unlink(), "report.png", "report.png: missing"),
    (
        "single_turn",
        "delete train log",
        lambda d: (d / "train_log.jsonl").unlink(),
        "train_log",
        "train_log.jsonl",
    ),
    (
        "single_turn",
        "unequal array lengths",
        _set_datum("training_step_1.json", "completion_logprobs", [-0.5, -0.5]),
        "datums.shapes",
        "training_step_1.json datum 0: unequal lengths",
    ),
    (
        "debate",
        "empty prompt",
        _set_datum("training_step_0.json", "prompt_tokens", []),
        "datums.shapes",
        "training_step_0.json datum 0: prompt_tokens",
    ),
    (
        "single_turn",
        "all-zero advantages",
        _zero_advantages,
        "datums.nonzero_advantages",
        "training_step_1.json",
    ),
    ("debate", "all-zero advantages", _zero_advantages, "datums.nonzero_advantages", "training_step_1.json"),
    ("debate", "loss all zero", _zero_losses, "loss.nonzero", "loss:sum is 0 in every step [0, 1]"),
    (
        "single_turn",
        "loss missing",
        lambda d: edit_json(
            d / "training_step_1.json", lambda doc: doc["results"]["metrics"].pop("loss:sum")
        ),
        "loss.present",
        "training_step_1.json",
    ),
    (
        "single_turn",
        "no trained tokens",
        lambda d: edit_json(d / "training_step_0.json", lambda doc: doc.update(num_trained_tokens=0)),
        "trained_tokens.positive",
        "training_step_0.json",
    ),
    (
        "debate",
        "missing round 3",
        _drop_round_3,
        "debate.rounds",
        "debate_1.json debate s1-d1: rounds [1, 2]",
    ),
    (
        "debate",
        "empty side",
        lambda d: edit_json(
            d / "debate_0.json", lambda doc: doc["debates"][0]["rounds"][1]["b"].update(tokens=[])
        ),
        "debate.rounds",
        "debate_0.json debate s0-d0: round 2 side b",
    ),
    (
        "debate",
        "no verdict",
        lambda d: edit_json(d / "debate_0.json", lambda doc: doc["debates"][1].pop("verdict")),
        "debate.verdicts",
        "debate_0.json debate 1",
    ),
    (
        "single_turn",
        "half-written run (status running)",
        lambda d: edit_json(d / "run_metadata.json", lambda doc: doc.update(status="running")),
        "metadata.completed",
        "status is 'running'",
    ),
    (
        "debate",
        "failed run",
        lambda d: edit_json(d / "run_metadata.json", lambda doc: doc.update(status="failed", error="OOM")),
        "metadata.completed",
        "error: OOM",
    ),
    (
        "single_turn",
        "no versions",
        lambda d: edit_json(d / "run_metadata.json", lambda doc: doc.pop("versions")),
        "metadata.fields",
        "versions",
    ),
    (
        "debate",
        "advantage on a mask-0 token",
        _leak_masked_advantage,
        "datums.mask_advantages",
        "training_step_0.json datum 3: 1 mask-0 tokens",
    ),
    (
        "single_turn",
        "corrupt training step JSON",
        _truncate("training_step_0.json"),
        "training_steps.present",
        "training_step_0.json: invalid JSON",
    ),
    (
        "debate",
        "corrupt debate JSON",
        _truncate("debate_1.json"),
        "rollouts.present",
        "debate_1.json: invalid JSON",
    ),
    (
        "single_turn",
        "summary record without reward metrics",
        lambda d: edit_json(d / "summary_1.json", lambda doc: doc["records"][2].update(reward_metrics={})),
        "rollouts.records",
        "summary_1.json record 2",
    ),
    ("single_turn", "truncated PNG", _truncate("report.png"), "report.png", "truncated"),
    ("debate", "PNG header only", _truncate("report.png", keep=4), "report.png", "not a PNG"),
    (
        "single_turn",
        "train log missing a step",
        _train_log_lines(lambda lines: lines[:1]),
        "train_log",
        "missing [1]",
    ),
    (
        "debate",
        "train log cut mid-line",
        _train_log_lines(lambda lines: [lines[0], lines[1][:30]]),
        "train_log",
        "train_log.jsonl line 2: invalid JSON",
    ),
    (
        "single_turn",
        "train log row without a key",
        _train_log_lines(lambda lines: [lines[0], json.dumps({**json.loads(lines[1]), "loss/sum": None})]),
        "train_log",
        "step 1",
    ),
]


@pytest.mark.parametrize(
    ("mode", "mutate", "check", "expected_detail"),
    [pytest.param(m, f, c, e, id=f"{m}: {i}") for m, i, f, c, e in MUTATIONS],
)
def test_each_mutation_fails_exactly_its_check(fresh_run, mode, mutate, check, expected_detail):
    run_dir = fresh_run(mode)
    mutate(run_dir)
    results = check_run(run_dir)
    assert set(failing(results)) == {check}, format_results(results)
    assert expected_detail in failing(results)[check]
    assert not rubric_passed(results)


@pytest.mark.parametrize(("grad_norm", "passes"), [(16.6, True), (0.0, False), (None, False)])
def test_a_zero_loss_with_a_gradient_norm_is_an_update(fresh_run, grad_norm, passes):
    """GRPO on fresh samples sums to 0 (ratio 1, centred advantages); in bfloat16 exactly 0. A run trained with
    TINKER_LOCAL_DTYPE=bf16 failed here as "no update happened" although its optimizer step saw a gradient."""
    run_dir = fresh_run("single_turn")
    _zero_losses(run_dir)
    if grad_norm is not None:
        for step in range(STEPS):
            edit_json(run_dir / f"training_step_{step}.json", lambda doc: doc["results"].update(
                optim_metrics={"grad_norm:mean": grad_norm, "learning_rate:mean": 1e-4}))
    (result,) = [r for r in check_run(run_dir) if r.name == "loss.nonzero"]
    assert result.passed is passes, result.detail
    if passes:
        assert "grad_norm:mean > 0 in steps [0, 1]: updated" in result.detail
    else:
        assert "no step records results.optim_metrics['grad_norm:mean'] > 0: no update happened" in result.detail


def test_corrupt_metadata_fails_without_raising(fresh_run):
    run_dir = fresh_run("debate")
    (run_dir / "run_metadata.json").write_text('{"status": "compl')
    details = failing(check_run(run_dir))
    assert "run_metadata.json: invalid JSON" in details["metadata.readable"]
    # Without the config the step count and mode are unknown: those checks say so instead of passing.
    assert {"metadata.completed", "metadata.fields", "train_log", "rollouts.present"} <= set(details)


def test_missing_directory_fails_every_check_without_raising(tmp_path):
    results = check_run(tmp_path / "nowhere")
    assert results and not any(r.passed for r in results)
    assert str(tmp_path / "nowhere" / "run_metadata.json") in results[0].detail


def test_format_results_one_line_per_check(fresh_run):
    run_dir = fresh_run("single_turn")
    (run_dir / "report.png").unlink()
    results = check_run(run_dir)
    lines = format_results(results).splitlines()
    assert len(lines) == len(results)
    assert lines[0].startswith("PASS metadata.readable: ")
    assert f"FAIL report.png: report.png: missing ({run_dir / 'report.png'})" in lines
    assert not rubric_passed([])


def test_command_exit_status(fresh_run, capsys):
    good, bad = fresh_run("debate", "good"), fresh_run("single_turn", "bad")
    _zero_advantages(bad)
    assert rubric_main([str(good)]) == 0
    assert rubric_main([str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"== {bad}: FAIL" in out and "FAIL datums.nonzero_advantages: training_step_1.json" in out


# --- a config that claims more steps than the directory holds -----------------------------------------------

_HUGE = 1_000_000_000
# Runs check_run on argv[1] under a 3 GiB address-space cap (so a check that enumerates the claimed steps
# fails fast with MemoryError instead of eating the machine) and prints the time check_run took, then its results.
_PROBE = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
from rlrunbook.run import check_run
start = time.perf_counter()
results = check_run(sys.argv[1])
print(json.dumps({"seconds": time.perf_counter() - start, "results": {r.name: [r.passed, r.detail] for r in results}}))
"""


def _claim_steps(run_dir: Path, steps: int, **config) -> Path:
    edit_json(run_dir / "run_metadata.json", lambda doc: doc["config"].update(steps=steps, **config))
    return run_dir


def _probe(run_dir: Path) -> tuple[float, dict[str, list]]:
    import os
    import subprocess
    import sys

    import rlrunbook

    src = str(Path(rlrunbook.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _PROBE, str(run_dir)], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    return out["seconds"], out["results"]


@pytest.mark.parametrize("mode", ["single_turn", "debate"])
def test_a_claimed_billion_steps_costs_what_is_on_disk(fresh_run, mode):
    """run_metadata.json claims 10**9 steps, the directory holds 2: the rubric fails it, naming the claimed
    count, what it found and the missing range, in the time the 2 steps take (nothing enumerates the claim)."""
    run_dir = _claim_steps(fresh_run(mode), _HUGE, validation={"every": 1, "num_problems": 2, "samples": 2})
    seconds, results = _probe(run_dir)
    assert seconds < 2.0, results
    kind = "summary" if mode == "single_turn" else "debate"
    failed = {name: detail for name, (passed, detail) in results.items() if not passed}
    assert set(failed) == {"train_log", "training_steps.present", "rollouts.present", "validation"}, failed
    assert ("expected steps 0..999,999,999 once each in order, found 2 rows, got [0, 1]; missing 2..999,999,999"
            in failed["train_log"])
    for check, prefix in (("training_steps.present", "training_step"), ("rollouts.present", kind)):
        assert failed[check] == (f"{prefix}_<k>.json: missing for steps 2..999,999,999 (999,999,998 files; "
                                 "config.steps is 1,000,000,000, 2 such files found)")
    assert "expected rows at steps [0, 1, 2, 3, 4, ..., 1,000,000,000] (1,000,000,001 rows)" in failed["validation"]


def test_a_forged_step_number_costs_nothing_either(fresh_run):
    """A train-log row and a file whose step number is near the claim are evidence of one step each, not of a
    billion: the gaps before them are ranges, never enumerated."""
    run_dir = _claim_steps(fresh_run("single_turn"), _HUGE)
    row = json.loads((run_dir / "train_log.jsonl").read_text().splitlines()[1])
    with (run_dir / "train_log.jsonl").open("a") as log:
        log.write(json.dumps({**row, "step": _HUGE - 1}) + "\n")
    shutil.copy(run_dir / "training_step_1.json", run_dir / f"training_step_{_HUGE - 1}.json")
    seconds, results = _probe(run_dir)
    assert seconds < 2.0
    assert results["train_log"][1].endswith("got [0, 1, 999999999]; missing 2..999,999,998")
    assert results["training_steps.present"][1].startswith(
        "training_step_<k>.json: missing for steps 2..999,999,998 (999,999,997 files; config.steps is 1,000,000,000, "
        "3 such files found)")


def test_short_runs_of_missing_files_are_named_file_by_file(fresh_run):
    """Up to five missing files in a row are named one by one, as before; a longer run of them as one range."""
    short = _claim_steps(fresh_run("single_turn", "short"), 7)
    long = _claim_steps(fresh_run("single_turn", "long"), 8)
    detail = failing(check_run(short))["training_steps.present"]
    assert detail.startswith(f"training_step_2.json: missing ({short / 'training_step_2.json'}); ")
    assert detail.endswith(f"training_step_6.json: missing ({short / 'training_step_6.json'})")
    details = failing(check_run(long))
    assert details["training_steps.present"] == ("training_step_<k>.json: missing for steps 2..7 (6 files; "
                                                 "config.steps is 8, 2 such files found)")
    assert "missing [2, 3, 4, 5, 6, 7]" in details["train_log"]


def test_odd_train_log_steps_fail_without_raising(fresh_run):
    """A step that is a list, an object or repeated is reported (once each), not a TypeError."""
    run_dir = fresh_run("single_turn")
    row = json.loads((run_dir / "train_log.jsonl").read_text().splitlines()[1])
    with (run_dir / "train_log.jsonl").open("a") as log:
        for step in ([1], {"k": 1}, 1, -3):
            log.write(json.dumps({**row, "step": step}) + "\n")
    detail = failing(check_run(run_dir))["train_log"]
    assert "found 6 rows" in detail and "extra or repeated [-3, 1, [1], {'k': 1}]" in detail


def test_missing_ranges_and_their_text():
    from rlrunbook.run.load import format_steps, missing_ranges

    assert missing_ranges([5, 0, 1, 1, -2, 99], 8) == [range(2, 5), range(6, 8)]
    assert missing_ranges([], 3) == [range(3)] and missing_ranges([0, 1, 2], 3) == []
    assert format_steps([range(2, 5), range(6, 8)]) == "[2, 3, 4, 6, 7]"
    assert format_steps([range(2, _HUGE)]) == "2..999,999,999"
    many = [range(k, k + 1) for k in range(0, 40, 2)] + [range(50, 60)]
    assert format_steps(many) == "0, 2, 4, 6, 8 (+16 more ranges)"
