"""Run guards: the blocklist, the prompt length limit, and the refusal of NaN/inf steps.

The pure parts (Blocklist, StepTally, PromptLimit on the tiny model's tokenizer) are checked
against hand-made cases; the NaN/inf guard and the blocklist are also checked end to end on short
runs of the built-in ``tiny`` model with a toy task, through the run directory they leave.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlrunbook.errors import ConfigError, InputError
from rlrunbook.models import resolve_model
from rlrunbook.models.loading import load_tokenizer
from rlrunbook.rl.rewards.base import RewardResult
from rlrunbook.rl.rollout import rollouts, tasks
from rlrunbook.rl.rollout.guards import (
    Blocklist,
    PromptLimit,
    StepTally,
    check_prompts,
    checked_reward,
)
from rlrunbook.rl.rollout.paradigms import Debate
from rlrunbook.rl.rollout.prompts import render_prompt
from rlrunbook.rl.rollout.tasks import Problem, Task, register_task
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.config_checks import validate
from rlrunbook.rl.training.loop import run_training
from rlrunbook.rl.training.step_guards import NonFiniteStepError

# ---- blocklist ---------------------------------------------------------------------------------------


def test_blocklist_matches_substrings_case_insensitively():
    blocklist = Blocklist(("Mallory", "ok"))
    assert blocklist.hits("hello MALLORY") == ["Mallory"]
    assert blocklist.hits("Token") == ["ok"]  # a substring, not a word
    assert blocklist.hits("fine") == []


def test_blocklist_counts_and_rejects():
    result = RewardResult(0.75, {"has_number": 1.0})
    counted, hit = Blocklist(("bad",)).apply(result, "a BAD answer")
    assert hit and counted.reward == 0.75 and counted.metrics == {"has_number": 1.0, "blocked": 1.0}
    rejected, hit = Blocklist(("bad",), reject=True).apply(result, "a BAD answer")
    assert hit and rejected.reward == 0.0
    assert rejected.metrics == {"has_number": 1.0, "blocked": 1.0, "reward_before_block": 0.75}
    clean, hit = Blocklist(("bad",), reject=True).apply(result, "a good answer")
    assert not hit and clean.reward == 0.75 and clean.metrics["blocked"] == 0.0
    assert Blocklist().apply(result, "bad") == (result, False)  # no blocklist: nothing added


def test_step_tally_metrics():
    tally = StepTally()
    tally.scored(RewardResult(1.5, {"verify": 1.0, "format": 1.0, "reflect": 0.0}), blocked=True)
    tally.scored(RewardResult(0.0, {"verify": 0.0, "format": 0.0, "reflect": 0.0}), blocked=False)
    tally.truncated += 3
    assert tally.metrics() == {"blocklist/hits": 1.0, "prompts/truncated": 3.0, "reward_signal/verify": 0.5,
                               "reward_signal/format": 0.5, "reward_signal/reflect": 0.0}
    assert StepTally().metrics() == {"blocklist/hits": 0.0, "prompts/truncated": 0.0}


def test_bad_blocklist_options_are_refused():
    with pytest.raises(ConfigError, match="empty blocklist"):
        validate(TrainConfig(reward={"reject_blocklisted": True}))
    with pytest.raises(ConfigError, match="empty entry"):
        validate(TrainConfig(reward={"blocklist": ["ok", " "]}))


def test_non_finite_rewards_are_refused_naming_the_task():
    assert checked_reward(RewardResult(0.5), "qa", "p1").reward == 0.5
    with pytest.raises(InputError, match="task 'qa' gave reward nan for problem p1"):
        checked_reward(math.nan, "qa", "p1")


# ---- prompt length -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("tiny"))


def _generation_tail(tokenizer) -> list[int]:
    """The template's tokens after the user content: closing the user turn and opening the reply."""
    marker = "\u2063END\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text.split(marker)[1], add_special_tokens=False)


LONG = " ".join(f"word{i}" for i in range(200))


def test_prompt_within_the_limit_is_unchanged(tokenizer):
    full = render_prompt(tokenizer, LONG, "sys")
    assert PromptLimit(len(full)).fit(tokenizer, "p", LONG, "sys") == (full, False)
    assert PromptLimit(None).fit(tokenizer, "p", LONG, "sys") == (full, False)


def test_over_long_prompt_is_refused_with_its_length_and_the_fix(tokenizer):
    length = len(render_prompt(tokenizer, LONG, "sys"))
    with pytest.raises(InputError) as caught:
        PromptLimit(40).fit(tokenizer, "prob-7", LONG, "sys")
    message = str(caught.value)
    assert f"problem prob-7 is {length} tokens, over --max-prompt-tokens 40" in message
    assert "Raise the limit" in message and "--truncate-prompts" in message


@pytest.mark.parametrize("limit", [40, 57, 100])
def test_truncation_cuts_the_problem_text_and_keeps_the_template(tokenizer, limit):
    suffix = "\n\nYou are debater A."
    tokens, cut = PromptLimit(limit, truncate=True).fit(tokenizer, "p", LONG, "sys", suffix)
    assert cut and len(tokens) <= limit
    tail = _generation_tail(tokenizer)
    assert tokens[-len(tail):] == tail  # the generation prompt is intact
    text = tokenizer.decode(tokens)
    assert "sys" in text and suffix in text and "word0 word1" in text and "word199" not in text
    # As long as it fits: one more token of problem text would cross the limit.
    kept = text.split("word0", 1)[1].split(suffix)[0]
    assert len(tokens) > limit - 3, f"cut too much: {len(tokens)} tokens of {limit} ({kept!r})"


def test_truncation_cannot_fit_a_template_longer_than_the_limit(tokenizer):
    with pytest.raises(InputError, match="alone take .* tokens, over --max-prompt-tokens 5"):
        PromptLimit(5, truncate=True).fit(tokenizer, "p", LONG, "sys")


class _ToyTask:
    def __init__(self, questions):
        self.questions = questions

    def system_message(self):
        return None

    def user_message(self, problem):
        return problem.record


def test_check_prompts_measures_every_problem_with_the_paradigm_suffixes(tokenizer):
    problems = [Problem("short", "What is 2+2?"), Problem("long", LONG)]
    task = _ToyTask(problems)
    short = len(render_prompt(tokenizer, "What is 2+2?"))
    assert check_prompts(tokenizer, task, problems, PromptLimit(None)) == 0
    with pytest.raises(InputError, match="problem long is"):
        check_prompts(tokenizer, task, problems, PromptLimit(short + 5), log=lambda _: None)
    assert check_prompts(tokenizer, task, problems, PromptLimit(short + 5, True), log=lambda _: None) == 1
    # The debate instructions count: a question that fits alone does not fit as a debate prompt.
    with pytest.raises(InputError, match="problem short is"):
        check_prompts(tokenizer, task, problems[:1], PromptLimit(short), Debate.prompt_suffixes, log=lambda _: None)


# ---- runs of the tiny model ----------------------------------------------------------------------------


@pytest.fixture
def letters_task(monkeypatch):
    """A toy task whose reward is the share of ASCII letters: it differs between tiny's samples."""
    monkeypatch.setattr(tasks, "TASKS", dict(tasks.TASKS))

    @register_task
    class LettersTask(Task):
        name = "toy_letters"
        reward_fns = ("letter_share",)
        default_dataset = "builtin"

        def load(self) -> list[Problem]:
            return [Problem(f"toy-{i}", {"question": f"Say {i} words."}) for i in range(4)]

        def user_message(self, problem: Problem) -> str:
            return problem.record["question"]

        def reward(self, problem: Problem, completion_text: str) -> RewardResult:
            share = sum(c.isascii() and c.isalpha() for c in completion_text) / max(1, len(completion_text))
            return RewardResult(share, {"letter_share": share})

        def dataset_info(self, problems):
            return {"name": "toy", "rows": len(problems)}

    return LettersTask


def _config(tmp_path, **changes) -> TrainConfig:
    return TrainConfig(**{"env": "toy_letters", "model": "tiny", "num_rollouts": 8, "steps": 1, "max_tokens": 8,
                          "log_root": str(tmp_path), "name": "guard", **changes})


def _spy_service(captured: dict):
    """The local service, keeping the training client and a copy of its adapter weights at creation."""
    from rlrunbook.backend import create_service_client
    from rlrunbook.backend.lora import adapter_parameters

    service = create_service_client()
    create = service.create_lora_training_client

    def create_and_keep(*args, **kwargs):
        client = create(*args, **kwargs)
        captured["client"] = client
        captured["before"] = {k: v.detach().clone() for k, v in adapter_parameters(client._trainer.model).items()}
        return client

    service.create_lora_training_client = create_and_keep
    return service


def _assert_weights_untouched(captured: dict) -> None:
    from rlrunbook.backend.lora import adapter_parameters

    trainer = captured["client"]._trainer
    after = adapter_parameters(trainer.model)
    assert trainer.weights_version == 0, "an optimizer step was applied"
    assert all(torch.equal(after[k], v) for k, v in captured["before"].items())


def _metadata(tmp_path) -> dict:
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return json.loads((run_dir / "run_metadata.json").read_text())


def test_nan_loss_is_refused_before_optim_step(letters_task, tmp_path, monkeypatch):
    """NaN advantages make loss:sum NaN: the loop stops before submitting optim_step."""
    from rlrunbook.backend.trainer import Trainer

    monkeypatch.setitem(rollouts.ADVANTAGE_MODES, "grpo", lambda batch: [math.nan] * len(batch))
    optim_calls = []
    original = Trainer.optim_step
    monkeypatch.setattr(Trainer, "optim_step", lambda self, p: optim_calls.append(p) or original(self, p))
    captured: dict = {}
    with pytest.raises(NonFiniteStepError, match=r"step 0 refused: loss:sum is nan .*weights are unchanged"):
        run_training(_config(tmp_path), service_factory=lambda: _spy_service(captured), log=lambda _: None)
    assert optim_calls == []
    _assert_weights_untouched(captured)
    metadata = _metadata(tmp_path)
    assert metadata["status"] == "failed" and "NonFiniteStepError" in metadata["error"]
    assert metadata["refused_step"] == {"step": 0, "quantity": "loss:sum", "value": "nan",
                                        "cause": "forward_backward returned a non-finite loss",
                                        "weights_changed": False}
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert not (run_dir / "training_step_0.json").exists()


def test_non_finite_gradient_norm_is_refused_by_the_trainer(letters_task, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: torch.tensor(math.inf))
    captured: dict = {}
    with pytest.raises(NonFiniteStepError, match="step 0 refused: grad_norm is non-finite"):
        run_training(_config(tmp_path), service_factory=lambda: _spy_service(captured), log=lambda _: None)
    _assert_weights_untouched(captured)
    metadata = _metadata(tmp_path)
    assert metadata["status"] == "failed"
    refused = metadata["refused_step"]
    assert (refused["step"], refused["quantity"], refused["value"]) == (0, "grad_norm", None)
    assert "gradient norm is inf" in refused["cause"]


def test_nan_reward_is_refused_at_scoring_naming_the_task(letters_task, tmp_path, monkeypatch):
    """Earlier than any loss: the reward itself, with the task and problem in the message."""
    monkeypatch.setattr(letters_task, "reward", lambda self, problem, text: RewardResult(math.nan))
    with pytest.raises(InputError, match=r"task 'toy_letters', problem toy-\d: reward=nan must be a finite"):
        run_training(_config(tmp_path), log=lambda _: None)
    metadata = _metadata(tmp_path)
    assert metadata["status"] == "failed" and "toy_letters" in metadata["error"]
    assert "refused_step" not in metadata  # no step reached the trainer


def test_tiny_run_counts_and_rejects_blocklisted_completions(letters_task, tmp_path):
    config = _config(tmp_path, num_rollouts=16, num_groups=2, steps=2, max_tokens=16,
                     reward={"blocklist": ["Mallory", "ée"], "reject_blocklisted": True})
    run_dir = run_training(config, log=lambda _: None)
    rows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    records = [r for step in (0, 1) for r in json.loads((run_dir / f"baseline_{step}.json").read_text())["records"]]
    blocked = [r for r in records if r["reward_metrics"]["blocked"]]
    assert sum(row["blocklist/hits"] for row in rows) == len(blocked) > 0
    assert len(blocked) < len(records), "every completion blocked: pick rarer blocklist strings"
    for record in blocked:
        assert record["reward"] == 0.0 and record["reward_metrics"]["reward_before_block"] > 0
        assert any(w.casefold() in record["completion_text"].casefold() for w in ("Mallory", "ée"))
    assert all(row["prompts/truncated"] == 0 for row in rows)


def test_debate_blocklisted_winner_is_rejected_before_training(tmp_path):
    """A debater is checked on all its own turns; a rejected one scores 0 and never trains as a winner."""
    config = TrainConfig(mode="debate", env="qa", dataset="test", model="tiny", num_rollouts=8, num_groups=2, steps=1,
                         max_tokens=8, mock_judge=True, log_root=str(tmp_path), name="dbg",
                         reward={"blocklist": ["ée"], "reject_blocklisted": True})
    run_dir = run_training(config, log=lambda _: None)
    debates = json.loads((run_dir / "debate_0.json").read_text())["debates"]
    datums = json.loads((run_dir / "training_step_0.json").read_text())["training_data"]
    (row,) = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    blocked = {(d["debate_id"], side) for d in debates for side in "ab" if d["blocked"][side]}
    assert row["blocklist/hits"] == len(blocked) > 0
    for debate in debates:
        for side in "ab":
            own = "\n".join(r[side]["text"] for r in debate["rounds"])
            assert debate["blocked"][side] == ("ée" in own.casefold())
            if debate["blocked"][side]:
                assert debate["task_rewards"][side] == 0.0
    trained = {(d["metadata"]["debate_id"], d["metadata"]["role"][-1]) for d in datums}
    assert trained and not trained & blocked
    assert len(trained) == sum((d["debate_id"], d["verdict"]["winner"]) not in blocked for d in debates)


def test_run_refuses_an_over_long_prompt_before_the_first_step(letters_task, tmp_path, tokenizer):
    length = len(render_prompt(tokenizer, "Say 0 words."))
    with pytest.raises(InputError, match=rf"problem toy-0 is {length} tokens, over --max-prompt-tokens {length - 2}"):
        run_training(_config(tmp_path, data={"max_prompt_tokens": length - 2}), log=lambda _: None)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert _metadata(tmp_path)["status"] == "failed" and not list(run_dir.glob("baseline_*.json"))


def test_run_truncates_prompts_and_counts_them(letters_task, tmp_path, tokenizer):
    limit = len(render_prompt(tokenizer, "Say 0 words.")) - 2
    config = _config(tmp_path, num_groups=2, data={"max_prompt_tokens": limit, "truncate_prompts": True})
    run_dir = run_training(config, log=lambda _: None)
    (row,) = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert row["prompts/truncated"] == 2  # one prompt per question group
    tail = _generation_tail(tokenizer)
    for datum in json.loads((run_dir / "training_step_0.json").read_text())["training_data"]:
        assert len(datum["prompt_tokens"]) <= limit and datum["prompt_tokens"][-len(tail):] == tail


# ---- sampler-trainer mismatch --------------------------------------------------------------------------


class _Writer:
    def __init__(self):
        self.refused = None

    def record_refused_step(self, record):
        self.refused = dict(record)


@pytest.mark.parametrize("value, temperature, outcome", [
    (0.005, 1.0, "quiet"),  # below warn 0.01
    (0.02, 1.0, "warn"),  # between warn 0.01 and max 0.03
    (0.04, 1.0, "stop"),  # above max 0.03
    (0.04, 0.5, "warn"),  # at T = 0.5 the gates are 0.02 and 0.06
    (0.07, 0.5, "stop"),
    (math.nan, 1.0, "stop"),
])
def test_mismatch_gate_by_hand(value, temperature, outcome):
    from rlrunbook.errors import LogprobMismatchError
    from rlrunbook.rl.setup.config import MismatchSettings
    from rlrunbook.rl.training.step_guards import check_mismatch

    lines, writer = [], _Writer()
    metrics = {"mismatch/abs_logprob_diff:mean": value}
    if outcome == "stop":
        with pytest.raises(LogprobMismatchError, match="step 3 refused.*weights are unchanged.*NUMERICS=invariant"):
            check_mismatch(3, metrics, MismatchSettings(), temperature, writer, lines.append)
        assert writer.refused["quantity"] == "mismatch/abs_logprob_diff" and not writer.refused["weights_changed"]
    else:
        check_mismatch(3, metrics, MismatchSettings(), temperature, writer, lines.append)
        assert writer.refused is None
        assert (len(lines) == 1 and "[warn] step 3" in lines[0]) == (outcome == "warn")
    check_mismatch(3, {}, MismatchSettings(), temperature, writer, lines.append)  # not reported: not gated


def test_a_run_above_the_mismatch_gate_stops_before_the_optimizer(letters_task, tmp_path, monkeypatch):
    """transformers' numerics in bf16 on tiny disagree by ~0.005-0.01 nats: above a gate of 1e-3."""
    from rlrunbook.errors import LogprobMismatchError

    monkeypatch.setenv("TINKER_LOCAL_NUMERICS", "native")
    monkeypatch.setenv("TINKER_LOCAL_DTYPE", "bfloat16")
    config = _config(tmp_path).model_copy(update={"mismatch": _config(tmp_path).mismatch.model_copy(
        update={"max": 1e-3})})
    captured: dict = {}
    with pytest.raises(LogprobMismatchError, match="step 0 refused"):
        run_training(config, service_factory=lambda: _spy_service(captured), log=lambda _: None)
    _assert_weights_untouched(captured)
    metadata = _metadata(tmp_path)
    assert metadata["status"] == "failed" and metadata["refused_step"]["quantity"] == "mismatch/abs_logprob_diff"
    assert float(metadata["refused_step"]["value"]) > 1e-3
