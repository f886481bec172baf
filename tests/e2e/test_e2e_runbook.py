"""The seed GPU runbook's runs (sections 3-5) as tests, each checked by the rubric checker.

On ``tiny`` for speed, and the mini debate RS→GRPO experiment also on ``smollm2-135m``. The run
shapes are the runbook's, scaled to a 2-core CPU (fewer rollouts and steps, shorter turns).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlrunbook import cli
from rlrunbook.run import check_run, format_results, rubric_passed

pytestmark = pytest.mark.e2e


def train(tmp_path: Path, capsys, *args: str) -> tuple[Path, str]:
    code = cli.main(["train", "--no-proxy", "--log-root", str(tmp_path), *args])
    out = capsys.readouterr().out
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert code == 0, out
    assert len(runs) == 1, runs
    results = check_run(runs[0])
    assert rubric_passed(results), format_results(results)
    return runs[0], out


def test_single_turn_qa_smoke(tmp_path, capsys):
    run, out = train(tmp_path, capsys, "--mode", "single_turn", "--env", "qa", "--dataset", "test",
                     "-n", "16", "-s", "1", "--name", "smoke_normal_qa", "--model", "tiny")
    assert "_grpo_qa_smoke_normal_qa" in run.name
    assert list(run.glob("baseline_*.json")) and "Training data: " in out


def test_single_turn_summary_smoke(tmp_path, capsys):
    run, out = train(tmp_path, capsys, "--mode", "single_turn", "--env", "summary", "--dataset", "cnn_dailymail",
                     "--reward-fn", "compression", "-n", "16", "-s", "1", "--name", "smoke_normal_summary",
                     "--model", "tiny")
    assert list(run.glob("summary_*.json"))


def test_debate_rejection_smoke(tmp_path, capsys):
    run, out = train(tmp_path, capsys, "--mode", "debate", "--env", "qa", "--dataset", "test", "-n", "32",
                     "--num-groups", "2", "-s", "1", "--mock-judge", "--debate-train", "rejection",
                     "--name", "smoke_debate_rejection", "--model", "tiny")
    for round_index in (1, 2, 3):
        assert f"[debate] Round {round_index}/3" in out
    assert "Loss: " in out and "Tokens: " in out
    assert "16 turns in one batched call" not in out and "32 turns in one batched call" in out


@pytest.mark.parametrize("model, shape", [
    ("tiny", ["-n", "32", "--num-groups", "4", "-s", "3", "--max-tokens", "32"]),
    pytest.param("smollm2-135m", ["-n", "8", "--num-groups", "2", "-s", "2", "--max-tokens", "24", "--learning-rate",
                                  "1e-4"], marks=pytest.mark.slow),
])
def test_mini_debate_rs_grpo_summary(tmp_path, capsys, model, shape):
    run, out = train(tmp_path, capsys, "--mode", "debate", "--env", "summary", "--dataset", "cnn_dailymail",
                     "--reward-fn", "compression", *shape, "--mock-judge", "--debate-train", "rs_grpo",
                     "--debate-grpo-reward", "task", "--model", model, "--name", "mini_debate_rs_grpo_summary")
    assert "Advantage stats (nonzero)" in out


def _bad_dataset(tmp_path: Path, capsys, content: str) -> str:
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    logs = tmp_path / "logs"
    code = cli.main(["train", "--env", "qa", "--dataset", str(data), "-n", "4", "--log-root", str(logs)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(data) in err
    assert not logs.exists() or not any(logs.iterdir()), "no run directory for a data set that failed to load"
    return err


def test_malformed_row_is_named(tmp_path, capsys):
    err = _bad_dataset(tmp_path, capsys, '{"question": "a", "answer": "#### 1"}\n{"question": "b", "answer"\n')
    assert "line 2" in err


def test_missing_field_is_named(tmp_path, capsys):
    err = _bad_dataset(tmp_path, capsys, '{"question": "a", "answer": "#### 1"}\n{"question": "b"}\n')
    assert "answer" in err and "line 2" in err


def test_empty_file_is_named(tmp_path, capsys):
    err = _bad_dataset(tmp_path, capsys, "")
    assert "no rows" in err


def test_prompt_longer_than_context_fails_the_run(tmp_path, capsys):
    code = cli.main(["train", "--env", "summary", "-n", "4", "--summary-max-words", "5000", "--max-tokens", "1500",
                     "--model", "tiny",
                     "--log-root", str(tmp_path), "--name", "too_long"])
    err = capsys.readouterr().err
    assert code == 2
    assert "exceeds the model's context" in err
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    results = check_run(run)
    assert not rubric_passed(results)
    assert not next(r for r in results if r.name == "metadata.completed").passed


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i:i + len(needle)] == needle:
            return i
    return -1


def test_debate_injects_opponent_tokens_verbatim_and_trains_own_tokens_only(tmp_path, capsys):
    """Round r >= 2 context holds the opponent's round r-1 tokens as ids (mask 0); own turns carry mask 1."""
    import json

    run, _ = train(tmp_path, capsys, "--mode", "debate", "--env", "qa", "--dataset", "test", "-n", "8",
                   "--num-groups", "2", "-s", "1", "--mock-judge", "--model", "tiny", "--name", "inject")
    debates = {d["debate_id"]: d for d in json.loads((run / "debate_0.json").read_text())["debates"]}
    step = json.loads((run / "training_step_0.json").read_text())
    eos = 2  # tiny's <|im_end|>
    assert step["training_data"], "rejection trains the winners"
    for datum in step["training_data"]:
        meta = datum["metadata"]
        me, them = meta["role"][-1], "b" if meta["role"][-1] == "a" else "a"
        rounds = debates[meta["debate_id"]]["rounds"]
        tokens, mask = datum["completion_tokens"], datum["completion_mask"]
        cursor = 0
        for r in range(3):
            own = rounds[r][me]["tokens"]
            at = _find(tokens[cursor:], own) + cursor
            assert at >= cursor and all(m == 1 for m in mask[at:at + len(own)]), f"own round {r + 1}"
            cursor = at + len(own)
            if r < 2:
                theirs = rounds[r][them]["tokens"]
                theirs = theirs[:-1] if theirs and theirs[-1] == eos else theirs
                at = _find(tokens[cursor:], theirs) + cursor
                assert at >= cursor and all(m == 0 for m in mask[at:at + len(theirs)]), f"opponent round {r + 1}"
                cursor = at + len(theirs)
        assert sum(mask) == sum(len(rounds[r][me]["tokens"]) for r in range(3))


def test_debate_with_the_model_judge(tmp_path, capsys):
    run, _ = train(tmp_path, capsys, "--mode", "debate", "--env", "qa", "--dataset", "test", "-n", "8",
                   "--num-groups", "2", "-s", "1", "--model", "tiny", "--name", "model_judge")
    import json

    verdicts = [d["verdict"] for d in json.loads((run / "debate_0.json").read_text())["debates"]]
    assert {v["judge"] for v in verdicts} == {"model"}
    for v in verdicts:  # the winner is the letter the judge model gave the higher logprob
        assert v["winner"] == ("a" if v["scores"]["a"] >= v["scores"]["b"] else "b")
        assert v["scores"]["a"] < 0 and v["scores"]["b"] < 0
