"""Dynamic sampling (DAPO): tied groups are dropped and replaced, a step without enough spread is skipped,
the data cursor moves by the groups drawn, ranks agree on one refill, and the run stops after K skips.

The sampling tests use a scripted ``rollout`` whose rewards are a function of the problem, so every count
below is derived by hand; the run-level tests train ``tiny`` on a plug-in task whose even problems always
tie (a few seconds each).
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from rlrunbook import cli, distributed
from rlrunbook.errors import NoLearningSignalError
from rlrunbook.rl.data import QARecord
from rlrunbook.rl.rewards.base import RewardResult
from rlrunbook.rl.rollout.paradigms import RolloutBatch
from rlrunbook.rl.rollout.rollouts import Rollout, centered_by_group, grpo_advantages, rs_grpo_advantages
from rlrunbook.rl.rollout.task_options import TaskOption
from rlrunbook.rl.rollout.tasks import Problem, Task, register_task
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.data_order import DataCursor
from rlrunbook.rl.training.dynamic_sampling import count_skip, merge_rounds, sample_step


def _rollout(group: int, reward: float, task_reward: float | None = None, won: bool | None = None) -> Rollout:
    return Rollout([1], [2], [-0.5], [1], f"p{group}", group, "single", reward,
                   reward if task_reward is None else task_reward, won=won)


def scripted(rewards_of: dict[str, list[float]], calls: list):
    """A rollout function: problem ``name`` gives its listed rewards, one rollout each (tied if all equal)."""
    def rollout(chosen, group_ids):
        calls.append((list(group_ids), [p for p in chosen]))
        rollouts = [_rollout(g, r) for p, g in zip(chosen, group_ids, strict=True) for r in rewards_of[p]]
        records = [{"problem": p, "group": g} for p, g in zip(chosen, group_ids, strict=True)]
        return RolloutBatch(rollouts, "baseline", {"step": 0, "records": records}, sampled_tokens=len(rollouts),
                            metrics={"time/score_s": 0.5, "blocklist/hits": 1.0, "reward_signal/format": 1.0})
    return rollout


TIED, SPREAD = [0.1, 0.1, 0.1, 0.1], [0.0, 1.0, 0.1, 0.1]
ORDER_NAMES = ["t0", "s1", "t2", "t3", "s4", "t5", "s6", "t7"]  # the seeded order, by hand
REWARDS = {name: (SPREAD if name.startswith("s") else TIED) for name in ORDER_NAMES}


def config(groups=2, rounds=4, skips=3, **changes) -> TrainConfig:
    return TrainConfig(num_rollouts=4 * groups, num_groups=groups, dynamic_sampling={
        "max_rounds": rounds, "max_skipped_steps": skips}, **changes)


def test_tied_groups_are_replaced_until_the_batch_has_spread():
    calls = []
    cursor = DataCursor(next_problem=0)
    sampled = sample_step(config(), 0, cursor, ORDER_NAMES, range(8), scripted(REWARDS, calls), grpo_advantages,
                          lambda line: None)
    # round 1 draws t0, s1 (keeps s1); round 2 draws the 1 missing: t2 (tied); round 3: t3; round 4: s4
    assert calls == [([0, 1], ["t0", "s1"]), ([2], ["t2"]), ([3], ["t3"]), ([4], ["s4"])]
    assert sampled.kept_groups == [1, 4] and not sampled.skipped
    assert (sampled.groups_drawn, sampled.rounds, cursor.next_problem) == (5, 4, 5)
    assert [r.group for r in sampled.kept] == [1] * 4 + [4] * 4 and len(sampled.drawn.rollouts) == 20
    # SPREAD = (0, 1, 0.1, 0.1) has mean 0.3: advantages -0.3, 0.7, -0.2, -0.2 (exact in binary? close enough)
    assert sampled.advantages[:4] == pytest.approx([-0.3, 0.7, -0.2, -0.2])
    assert sampled.drawn.payload["dynamic_sampling"] == {
        "dynamic_sampling/groups_drawn": 5, "dynamic_sampling/groups_kept": 2, "dynamic_sampling/rounds": 4,
        "kept_groups": [1, 4], "skipped": False}
    # times and counts add over the 4 rounds; per-sample means are weighted by rollouts (all 1.0 here)
    assert sampled.drawn.metrics == {"time/score_s": 2.0, "blocklist/hits": 4.0, "reward_signal/format": 1.0}


def test_a_step_with_spread_everywhere_samples_exactly_what_it_did_before():
    calls = []
    cursor = DataCursor(next_problem=6)  # step 3 of a run that never refilled: 3 * 2 problems drawn
    sampled = sample_step(config(), 3, cursor, ORDER_NAMES, [1, 4, 6, 6, 1, 4, 6, 1], scripted(REWARDS, calls),
                          grpo_advantages, lambda line: None)
    # order[6], order[7] -> names "s6", "s1": group ids 0 and 1, one round, as `order[step * G + g]` gave
    assert calls == [([0, 1], ["s6", "s1"])]
    assert (sampled.groups_drawn, sampled.rounds, cursor.next_problem, sampled.skipped) == (2, 1, 8, False)


def test_at_the_cap_the_step_is_skipped_and_the_cursor_still_moves():
    calls = []
    cursor = DataCursor(next_problem=2)  # t2, t3, s4 ...: round 1 draws t2, t3 (both tied), round 2: s4, t5
    sampled = sample_step(config(rounds=2), 1, cursor, ORDER_NAMES, range(8), scripted(REWARDS, calls),
                          grpo_advantages, lambda line: None)
    assert calls == [([0, 1], ["t2", "t3"]), ([2, 3], ["s4", "t5"])]
    assert sampled.skipped and sampled.kept_groups == [2] and cursor.next_problem == 6


def test_the_run_stops_after_k_skipped_steps_in_a_row():
    settings = config(skips=2)
    cursor = DataCursor()
    skipped = SimpleNamespace(kept_groups=[], groups_drawn=8, rounds=4)
    count_skip(settings, 0, cursor, skipped, [_rollout(0, 0.1)])
    assert cursor.skipped_in_a_row == 1
    with pytest.raises(NoLearningSignalError, match=r"step 1: All token advantages are 0\.0 in 2 steps in a row"):
        count_skip(settings, 1, cursor, skipped, [_rollout(0, 0.1)])


def test_rs_grpo_spread_is_the_spread_of_the_winners_task_rewards():
    # group 0: winners' task rewards 0.5, 0.5 (tied, although a loser scored 0.9); group 1: winners 0.2, 0.7
    rollouts = [_rollout(0, 1.0, 0.5, True), _rollout(0, 0.0, 0.9, False), _rollout(0, 1.0, 0.5, True),
                _rollout(0, 0.0, 0.1, False), _rollout(1, 1.0, 0.2, True), _rollout(1, 0.0, 0.2, False),
                _rollout(1, 1.0, 0.7, True), _rollout(1, 0.0, 0.7, False)]
    advantages = rs_grpo_advantages(rollouts)
    assert advantages == pytest.approx([0.0] * 4 + [-0.25, 0.0, 0.25, 0.0])
    assert advantages[:4] == [0.0] * 4  # exactly: the tied winners give no signal
    assert {r.group for r, a in zip(rollouts, advantages, strict=True) if a != 0} == {1}


def test_a_tied_group_gets_exactly_zero():
    # 8 x 0.1 sums to 0.7999999999999999, whose mean misses 0.1 by 1.4e-17: not a learning signal
    assert centered_by_group([0.1] * 8, [0] * 8) == [0.0] * 8
    assert sum([0.1] * 8) / 8 != 0.1  # the float fact the exact zero guards against


def test_merge_rounds_weights_means_by_rollouts():
    one = RolloutBatch([_rollout(0, 1.0)] * 4, "debate", {"debates": [1, 2]}, 10, {"debate/a_win_fraction": 0.5})
    two = RolloutBatch([_rollout(1, 1.0)] * 2, "debate", {"debates": [3]}, 5, {"debate/a_win_fraction": 1.0})
    merged = merge_rounds([one, two])
    # 4 rollouts at 0.5 and 2 at 1.0: (2 + 2) / 6 = 2/3; tokens add
    assert merged.metrics["debate/a_win_fraction"] == pytest.approx(2 / 3)
    assert merged.payload == {"debates": [1, 2, 3]} and merged.sampled_tokens == 15


def test_two_ranks_agree_on_one_refill(monkeypatch):
    """Two ranks (threads, with an exchange standing in for the gloo gather) drop the same groups, draw the
    same refill, each samples its contiguous share, and end with the one-process cursor and kept groups."""
    world, barrier, slots = 2, threading.Barrier(2), {}
    local = threading.local()
    monkeypatch.setattr(distributed, "world_size", lambda: world)
    monkeypatch.setattr(distributed, "rank", lambda: local.rank)

    def gather_objects(obj):
        slots[local.rank] = obj
        barrier.wait()
        gathered = [slots[r] for r in range(world)]
        barrier.wait()
        return gathered

    monkeypatch.setattr(distributed, "gather_objects", gather_objects)
    results, calls = {}, {0: [], 1: []}

    def run(rank):
        local.rank = rank
        cursor = DataCursor()
        sampled = sample_step(config(groups=4), 0, cursor, ORDER_NAMES, range(8), scripted(REWARDS, calls[rank]),
                              grpo_advantages, lambda line: None)
        results[rank] = (sampled.kept_groups, sampled.own_groups, cursor.next_problem, sampled.groups_drawn)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    # round 1 (4 groups): t0 s1 | t2 t3 -> keeps 1; round 2 draws 3: s4 t5 | s6 (3 split 2 + 1) -> keeps 4, 6;
    # round 3 draws 1: t7 | -; round 4 draws 1: t0 (the order wraps) | -. 3 < 4 kept: skipped, cursor at 9
    cursor = DataCursor()
    monkeypatch.setattr(distributed, "world_size", lambda: 1)
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    one = sample_step(config(groups=4), 0, cursor, ORDER_NAMES, range(8), scripted(REWARDS, []), grpo_advantages,
                      lambda line: None)
    single = (one.kept_groups, cursor.next_problem, one.groups_drawn)
    assert results[0][0] == results[1][0] == single[0] == [1, 4, 6]
    assert results[0][2] == results[1][2] == single[1] == 9
    assert [ids for ids, _ in calls[0]] == [[0, 1], [4, 5], [7], [8]]
    assert [ids for ids, _ in calls[1]] == [[2, 3], [6], [], []]
    assert sorted(results[0][1] + results[1][1]) == list(range(9))


# --- the loop, on tiny ------------------------------------------------------------------------------------

@register_task
class HalfTiedTask(Task):
    """Test task: problems ``tie-*`` always score 0.5 (a tied group), ``free-*`` score by completion length."""

    name = "half_tied_test"
    reward_fns = ("length",)
    default_dataset = "built-in"
    declared_options = {"kinds": TaskOption(str, "tf", "one problem per letter: t a tied one, f a free one")}

    def load(self):
        kinds = self.option("kinds")
        ids = [f"{'tie' if kind == 't' else 'free'}-{i}" for i, kind in enumerate(kinds)]
        return [Problem(id_, QARecord(id_, f"Count to {i}.", ("0",))) for i, id_ in enumerate(ids)]

    def user_message(self, problem):
        return problem.record.question

    def reward(self, problem, completion_text):
        if problem.id.startswith("tie"):
            return RewardResult(0.5)
        return RewardResult(len(completion_text) / 100.0)


def _train(tmp_path, *args: str) -> tuple[int, dict]:
    code = cli.main(["train", "--model", "tiny", "--env", "half_tied_test", "-n", "8", "--num-groups", "1",
                     "--max-tokens", "12", "--seed", "0", "--log-root", str(tmp_path), *args])
    (run,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    return code, {"run": run, "rows": rows, "metadata": json.loads((run / "run_metadata.json").read_text())}


def test_a_skipped_step_is_logged_marked_and_accepted_by_check_run(tmp_path, capsys):
    from rlrunbook.run import check_run, format_results, rubric_passed

    # One group per step, no refill (max_rounds 1): a step on the tie problem is skipped, one on the free
    # problem trains; the 2 problems alternate in the seeded order, so 3 steps hold both kinds.
    code, run = _train(tmp_path, "-s", "3", "extra.kinds=tf", "dynamic_sampling.max_rounds=1",
                       "dynamic_sampling.max_skipped_steps=3")
    assert code == 0, capsys.readouterr().err
    skipped = [row for row in run["rows"] if row.get("skipped")]
    trained = [row for row in run["rows"] if not row.get("skipped")]
    assert skipped and trained
    for row in skipped:
        assert "only" in row["skip_reason"] and row["num_trained_tokens"] == 0
        doc = json.loads((run["run"] / f"training_step_{row['step']}.json").read_text())
        assert doc["skipped"] is True and doc["training_data"] == []
    results = check_run(run["run"])
    assert rubric_passed(results), format_results(results)
    assert "warning: step" in capsys.readouterr().out
    # the two marks must agree: a step file that forgets it was skipped is an empty trained step, and fails
    path = run["run"] / f"training_step_{skipped[0]['step']}.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in doc.items() if k != "skipped"}))
    failed = {r.name for r in check_run(run["run"]) if not r.passed}
    assert failed == {"training_steps.present", "loss.present", "trained_tokens.positive"}


def test_k_skipped_steps_in_a_row_stop_the_run(tmp_path, capsys):
    code, run = _train(tmp_path, "-s", "4", "extra.kinds=tt", "dynamic_sampling.max_skipped_steps=2")
    assert code == 2
    assert "in 2 steps in a row" in capsys.readouterr().err
    assert run["metadata"]["status"] == "failed"
    assert [row["step"] for row in run["rows"]] == [0]  # the first skip is logged; the second stops the run
