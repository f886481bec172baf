"""A debate step shows what it learns: the verdict win rate apart from the task reward of the trained side.

In a debate ``reward`` is the verdict (1 won, 0 lost), so with one winner per debate its mean is 0.5 at every step;
what rejection and rs_grpo train on is the task reward of the winners.
"""

from __future__ import annotations

import pytest

from rlrunbook.rl.rollout.rollouts import Rollout
from rlrunbook.rl.training.step import _reward_line, verdict_stats
from rlrunbook.run.report import plot_report


def _rollout(task_reward: float, won: bool | None) -> Rollout:
    reward = task_reward if won is None else float(won)
    return Rollout([1], [2], [-0.5], [1], "p", 0, "a", reward, task_reward, won)


def test_the_verdict_and_the_winners_task_reward_are_apart():
    # two debates: winners' task rewards 0.9 and 0.4, losers' 0.1 and 0.4 (a tie broken by the coin)
    rollouts = [_rollout(0.9, True), _rollout(0.1, False), _rollout(0.4, False), _rollout(0.4, True)]
    stats = verdict_stats(rollouts)
    assert stats == {"verdict/win_rate": 0.5, "task_reward/winners_mean": pytest.approx(0.65),
                     "task_reward/losers_mean": pytest.approx(0.25)}
    line = _reward_line(3, rollouts, {"mean": 0.5}, {"mean": 0.45})
    assert line == ("Step 3: verdict win rate 0.5000 (one winner per debate), task reward of the winners "
                    "(trained) 0.6500, of all debaters 0.4500")


def test_single_turn_steps_log_as_before():
    rollouts = [_rollout(1.0, None), _rollout(0.0, None)]
    assert verdict_stats(rollouts) == {}
    assert _reward_line(0, rollouts, {"mean": 0.5}, {"mean": 0.5}) == "Step 0: reward 0.5000 (task 0.5000)"


def test_the_report_plots_the_debate_curves_labelled(tmp_path, monkeypatch):
    plotted: list[str] = []
    from matplotlib.axes import Axes

    original = Axes.plot

    def spy(self, *args, label=None, **kwargs):
        plotted.append(label)
        return original(self, *args, label=label, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    rows = [{"step": s, "reward/mean": 0.5, "task_reward/mean": 0.3 + 0.1 * s, "verdict/win_rate": 0.5,
             "task_reward/winners_mean": 0.4 + 0.1 * s, "task_reward/losers_mean": 0.2, "loss/sum": 1.0,
             "completion_length/mean": 20.0} for s in range(3)]
    out = plot_report(rows, tmp_path / "report.png")
    assert out.read_bytes().startswith(b"\x89PNG")
    assert {"verdict win rate (0.5 by construction)", "task reward, winners (trained)",
            "task reward, all debaters"} <= set(plotted)
