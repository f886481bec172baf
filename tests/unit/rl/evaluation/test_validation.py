"""In-training validation: schedule, held-out split, rows in validation.jsonl, determinism, rubric, W&B mirror.

One tiny summary run (3 steps, --val-every 2, 4 held-out problems x 2 samples, --cache-dataset,
WANDB_PROJECT set with a fake ``wandb``) is shared by the tests that read its directory; a second
run without validation (and without WANDB_PROJECT) is the reference for "validation does not
change training". Both summarise 80 generated articles from a JSONL file in the CNN/DailyMail copy's
format: a file, so --cache-dataset caches it, and the same data with or without real data beside the
checkout.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from fake_wandb import FakeWandb

from rlrunbook.errors import ConfigError
from rlrunbook.rl.evaluation.validation import Validator, measure, validation_seed
from rlrunbook.rl.rollout.tasks import Problem
from rlrunbook.rl.setup.config import TrainConfig, ValidationSettings
from rlrunbook.rl.setup.data_order import problem_order, split_held_out
from rlrunbook.rl.setup.prepare import prepare
from rlrunbook.rl.training.loop import run_training
from rlrunbook.run import check_run, format_results, rubric_passed
from rlrunbook.run.schema import validation_schedule
from rlrunbook.testing.data import cnn_dailymail_rows, write_jsonl

VOLATILE = ("time/", "throughput/", "memory/")


@pytest.mark.parametrize(("steps", "every", "expected"), [
    (3, 2, [0, 2, 3]),  # after steps 2 and 3 (the last), plus the initial weights
    (4, 2, [0, 2, 4]),  # the last step is a multiple: validated once
    (1, 5, [0, 1]),
    (3, 1, [0, 1, 2, 3]),
    (3, 0, []),
])
def test_schedule(steps, every, expected):
    assert validation_schedule(steps, every) == expected


def _problems(n: int) -> list[Problem]:
    return [Problem(f"p{i}", None) for i in range(n)]


def test_split_holds_out_the_last_of_the_seeded_order():
    problems = _problems(10)
    order = problem_order(problems, seed=3)
    training, train_order, held_out = split_held_out(problems, order, ValidationSettings(every=1, num_problems=3))
    assert [p.id for p in held_out] == [f"p{i}" for i in order[-3:]]
    assert not {p.id for p in training} & {p.id for p in held_out}
    assert sorted(p.id for p in training + held_out) == sorted(p.id for p in problems)
    # The loop draws problems[order[i % len(problems)]]: the first 7 draws are the unvalidated run's.
    drawn = [training[train_order[i % len(training)]].id for i in range(14)]
    unvalidated = [problems[order[i % 10]].id for i in range(14)]
    assert drawn[:7] == unvalidated[:7]
    assert drawn[7:] == drawn[:7], "training cycles over its own problems, never reaching the held-out ones"


def test_split_is_a_no_op_with_validation_off():
    problems = _problems(5)
    order = problem_order(problems, seed=0)
    assert split_held_out(problems, order, ValidationSettings(every=0, num_problems=3)) == (problems, order, [])


def test_a_held_out_set_leaving_nothing_to_train_is_refused_before_the_model():
    config = TrainConfig(model="tiny", env="qa", dataset="test", num_rollouts=4, extra={"test_size": 8},
                         validation=ValidationSettings(every=1, num_problems=8))
    with pytest.raises(ConfigError, match="validation.num_problems 8 .* none of the data set's 8"):
        prepare(config)
    prepare(config.replace(validation=ValidationSettings(every=1, num_problems=7)))




@pytest.fixture(scope="module")
def articles(tmp_path_factory):
    """The runs' data: 80 generated articles (``rlrunbook.testing.data.cnn_dailymail_rows``) in one JSONL file."""
    return write_jsonl(tmp_path_factory.mktemp("data") / "articles.jsonl", cnn_dailymail_rows(80))


def _config(root, articles, **changes) -> TrainConfig:
    # 4 rollouts per group and 16 tokens: tiny's compression rewards tie (all 0) too often in smaller shapes,
    # and dynamic sampling would skip steps there (no step of this shape is skipped).
    values = dict(model="tiny", env="summary", dataset=str(articles), num_rollouts=8, num_groups=2, steps=3,
                  max_tokens=16, seed=0, log_root=str(root), name="val")
    return TrainConfig(**{**values, **changes})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, articles):
    """(validated run, its fake wandb, unvalidated run, the fake wandb present then, the validated run's log)."""
    root = tmp_path_factory.mktemp("runs")
    validated_config = _config(root / "a", articles,
                               validation=ValidationSettings(every=2, samples=2, num_problems=4),
                               data={"cache": True, "cache_dir": str(root / "cache")})
    with pytest.MonkeyPatch.context() as patch:
        fake = FakeWandb()
        patch.setitem(sys.modules, "wandb", fake)
        patch.setenv("WANDB_PROJECT", "rlrunbook-tests")
        lines: list[str] = []
        validated = run_training(validated_config, log=lines.append)
    with pytest.MonkeyPatch.context() as patch:
        silent = FakeWandb()
        patch.setitem(sys.modules, "wandb", silent)
        patch.delenv("WANDB_PROJECT", raising=False)
        plain = run_training(_config(root / "b", articles), log=lambda *_: None)
    return validated, fake, plain, silent, lines


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _trained_ids(run_dir) -> set[str]:
    """Problems trained on (those of the datums); dynamic sampling also samples groups it then drops."""
    return {d["metadata"]["problem_id"] for f in run_dir.glob("training_step_*.json")
            for d in json.loads(f.read_text())["training_data"]}


def test_rows_at_the_scheduled_steps_on_disjoint_problems(runs, articles):
    run_dir = runs[0]
    rows = _rows(run_dir / "validation.jsonl")
    assert [row["step"] for row in rows] == [0, 2, 3]
    _, _, _, problems = prepare(_config(run_dir, articles, validation=ValidationSettings(every=2, num_problems=4)))
    expected = [problems[i].id for i in problem_order(problems, 0)[-4:]]
    for row in rows:
        assert row["problem_ids"] == expected
        assert (row["num_problems"], row["samples_per_problem"]) == (4, 2)
        assert {"pass@1", "pass@2", "pass@1_ci", "pass@2_ci", "mean_reward", "mean_ci"} <= row.keys()
        assert row["pass@1"] <= row["pass@2"], "pass@k never falls as k grows"
        assert row["seed"] == validation_seed(0)
    trained = _trained_ids(run_dir)
    assert len(trained) == 6 and not trained & set(expected)
    results = check_run(run_dir)
    assert rubric_passed(results), format_results(results)
    assert "validation" in {r.name for r in results}
    val_lines = [line for line in runs[4] if line.startswith("[val]")]
    assert [line.split(":")[0] for line in val_lines] == ["[val] step 0", "[val] step 2", "[val] step 3"]
    cache = json.loads((run_dir / "run_metadata.json").read_text())["dataset"]["cache"]
    assert cache["status"] == "written" and cache["source_fingerprint"] == cache["cached_fingerprint"]
    (announced,) = [line for line in runs[4] if line.startswith(f"[data] summary data '{articles}': ")]
    assert f"written cache {cache['path']} of file:{articles}, 80 rows" in announced
    assert announced.endswith(f"fingerprint {cache['cached_fingerprint']}")


def test_validation_leaves_training_unchanged(runs):
    validated, _, plain, _, _ = runs
    strip = [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in _rows(validated / "train_log.jsonl")]
    reference = [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in _rows(plain / "train_log.jsonl")]
    assert strip == reference
    assert not (plain / "validation.jsonl").exists()
    assert "validation" not in {r.name for r in check_run(plain)}


def test_wandb_mirrors_train_and_validation_rows(runs):
    run_dir, fake, _, silent, _ = runs
    names = [name for name, _, _ in fake.calls]
    assert names[0] == "init" and names[-1] == "finish" and names.count("init") == names.count("finish") == 1
    _, _, init = fake.calls[0]
    assert init["project"] == "rlrunbook-tests" and init["name"] == run_dir.name
    assert init["config"] == json.loads((run_dir / "run_metadata.json").read_text())["config"]
    logged = [(kwargs["step"], args[0]) for name, args, kwargs in fake.calls if name == "log"]
    train = [(step, row) for step, row in logged if "loss/sum" in row]
    val = [(step, row) for step, row in logged if "val/pass@1" in row]
    assert [step for step, _ in train] == [0, 1, 2] and [step for step, _ in val] == [0, 2, 3]
    first_val = _rows(run_dir / "validation.jsonl")[0]
    assert val[0][1]["val/pass@2_ci_low"] == first_val["pass@2_ci"][0]
    assert [step for step, _ in logged] == sorted(step for step, _ in logged), "W&B steps never go back"
    assert fake.calls[-1][2] == {"exit_code": 0}
    assert silent.calls == [], "nothing goes to W&B without WANDB_PROJECT"


def test_same_weights_same_numbers(runs, articles):
    """Validating one set of weights twice gives the same row; another seed gives other samples."""
    from rlrunbook.backend import create_service_client
    from rlrunbook.rl.rollout.paradigms import RolloutContext

    config = _config(runs[0], articles, validation=ValidationSettings(every=1, samples=2, num_problems=3))
    config, _, task, problems = prepare(config)
    training = create_service_client().create_lora_training_client("tiny", rank=4, seed=0)
    tokenizer = training.get_tokenizer()

    class Rows:
        def __init__(self):
            self.rows = []

        def log_validation(self, row):
            self.rows.append({k: v for k, v in row.items() if k != "time/validation_s"})

    sink = Rows()
    validator = Validator(task, problems[:3], config.validation, config.rollout_settings(), config.seed, config.steps)
    quiet = lambda *_: None
    assert validator(0, training, tokenizer, sink, quiet) is not None
    assert validator(0, training, tokenizer, sink, quiet) is not None
    assert sink.rows[0] == sink.rows[1]
    ctx = RolloutContext(training.save_weights_and_get_sampling_client(), tokenizer, task, config.rollout_settings(),
                         [tokenizer.eos_token_id])
    _, same = measure(ctx, problems[:3], config.validation, validator.seed)
    _, other = measure(ctx, problems[:3], config.validation, validator.seed + 1)
    assert same != other, "the seed must reach the sampler, or the equality above proves nothing"
    assert sink.rows[0]["mean_reward"] == pytest.approx(sum(map(sum, same)) / 6)


def test_rubric_catches_missing_rows_and_trained_held_out_problems(runs, tmp_path):
    def mutated(change):
        run_dir = shutil.copytree(runs[0], tmp_path / f"run{len(list(tmp_path.iterdir()))}")
        rows = _rows(run_dir / "validation.jsonl")
        change(rows)
        (run_dir / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {r.name: r for r in check_run(run_dir)}["validation"]

    dropped = mutated(lambda rows: rows.pop())
    assert not dropped.passed and "expected rows at steps [0, 2, 3]" in dropped.detail
    trained = sorted(_trained_ids(runs[0]))[0]
    leaked = mutated(lambda rows: rows[1]["problem_ids"].__setitem__(0, trained))
    assert not leaked.passed and "trained on" in leaked.detail and trained in leaked.detail
    bad_pass = mutated(lambda rows: rows[0].__setitem__("pass@2", 1.5))
    assert not bad_pass.passed and "pass@2" in bad_pass.detail


def test_report_has_a_validation_panel(runs, tmp_path):
    from rlrunbook.run.report import plot_report

    def width(path):
        return int.from_bytes(path.read_bytes()[16:20], "big")

    train = _rows(runs[0] / "train_log.jsonl")
    plain = plot_report(train, tmp_path / "plain.png")
    with_val = plot_report(train, tmp_path / "val.png", validation_rows=_rows(runs[0] / "validation.jsonl"))
    assert width(with_val) > width(plain)
    assert width(runs[0] / "report.png") == width(with_val)
