"""The loop's data-parallel pieces: group shards keep global seeds and ids, merges rebuild the union batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlrunbook import distributed
from rlrunbook.errors import ConfigError
from rlrunbook.rl.rollout.judges import MockJudge
from rlrunbook.rl.rollout.paradigms import RolloutBatch, RolloutContext, get_paradigm
from rlrunbook.rl.rollout.rollouts import Rollout
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.prepare import prepare
from rlrunbook.rl.training import data_parallel as dp
from rlrunbook.rl.training.loop import run_training


class SeedEchoSampler:
    """Samples whose tokens are a function of the request's seed only: a group sampled in another
    process (another batch) gets the same tokens exactly when it gets the same seed."""

    def __init__(self):
        self.seeds: list[int] = []

    def sample(self, model_input, num_samples, params):
        self.seeds.append(params.seed)
        sequences = [SimpleNamespace(tokens=[4 + (params.seed >> (4 * i + k)) % 50 for k in range(3)],
                                     logprobs=[-1.0] * 3, stop_reason="length") for i in range(num_samples)]
        return SimpleNamespace(result=lambda: SimpleNamespace(sequences=sequences))


@pytest.fixture(scope="module")
def qa(tiny_host):
    config, _, task, problems = prepare(TrainConfig(env="qa", dataset="test", num_rollouts=8, num_groups=4,
                                                           model="tiny"))
    return config, task, problems, tiny_host.tokenizer


def _rollout(mode, qa, group_ids, step=3, **config_changes):
    config, task, problems, tokenizer = qa
    config = config.replace(mode=mode, **config_changes)
    sampler = SeedEchoSampler()
    ids = list(range(config.num_groups)) if group_ids is None else group_ids
    ctx = RolloutContext(sampler, tokenizer, task, config.rollout_settings(), [tokenizer.eos_token_id], MockJudge(),
                         lambda _: None,
                         group_ids=group_ids)
    batch = get_paradigm(mode).rollout(ctx, [problems[g] for g in ids], step)
    return batch, sampler.seeds


@pytest.mark.parametrize("mode", ["single_turn", "debate"])
def test_shards_sample_as_the_single_process_does(qa, mode):
    whole, whole_seeds = _rollout(mode, qa, None)
    parts = [_rollout(mode, qa, distributed.shard(range(4), r, 2)) for r in range(2)]
    merged = dp.merge_batches([batch for batch, _ in parts])
    assert sorted(s for _, seeds in parts for s in seeds) == sorted(whole_seeds)
    key = [(r.group, r.role, r.completion_tokens, r.reward) for r in whole.rollouts]
    assert [(r.group, r.role, r.completion_tokens, r.reward) for r in merged.rollouts] == key
    assert merged.payload == whole.payload  # records (and debate ids) carry the global group index
    assert merged.sampled_tokens == whole.sampled_tokens
    assert {r.group for r in parts[1][0].rollouts} == {2, 3}


def test_group_index_defaults_to_position():
    ctx = RolloutContext(None, None, None, None, [])
    assert [ctx.group_index(g) for g in range(3)] == [0, 1, 2]
    assert RolloutContext(None, None, None, None, [], group_ids=[4, 5]).group_index(1) == 5


def _batch(rewards, groups, metrics):
    rollouts = [Rollout([1], [2], [-0.5], [1], f"p{g}", g, "single", r, r) for r, g in zip(rewards, groups, strict=True)]
    payload = {"step": 0, "env": "qa", "records": [{"group": g} for g in groups]}
    return RolloutBatch(rollouts, "baseline", payload, len(rollouts), metrics)


def test_merge_batches_concatenates_in_rank_order_and_keeps_own_timings():
    a = _batch([1.0, 0.0], [0, 0], {"debate/a_win_fraction": 1.0, "time/score_s": 0.5})
    b = _batch([0.5, 0.5], [1, 1], {"debate/a_win_fraction": 0.0, "time/score_s": 2.0})
    merged = dp.merge_batches([a, b], own_rank=1)
    assert [r.group for r in merged.rollouts] == [0, 0, 1, 1]
    assert merged.payload == {"step": 0, "env": "qa", "records": [{"group": g} for g in (0, 0, 1, 1)]}
    assert merged.sampled_tokens == 4
    # equal shards, so the mean of the ranks' fractions is the union's fraction: (1 + 0) / 2
    assert merged.metrics == {"debate/a_win_fraction": 0.5, "time/score_s": 2.0}


def test_own_share_keeps_the_rank_groups_only():
    batch = _batch([1.0, 0.0, 0.5, 0.0], [0, 0, 1, 1], {})
    chosen = [(r, float(i)) for i, r in enumerate(batch.rollouts)]
    assert [a for _, a in dp.own_share(chosen, [1])] == [2.0, 3.0]
    assert dp.own_share(chosen, [7]) == []


def test_merge_metrics_by_reduction():
    # rank 0 trained 30 tokens with ratio mean 1.0; rank 1 trained 10 with 2.0: union mean (30 + 20) / 40
    parts = [{"loss:sum": -1.5, "num_trained_tokens:sum": 30.0, "ratio:mean": 1.0, "ratio:max": 1.2},
             {"loss:sum": 0.5, "num_trained_tokens:sum": 10.0, "ratio:mean": 2.0, "ratio:max": 3.0},
             {}]  # a rank without data
    assert dp.merge_metrics(parts) == {"loss:sum": -1.0, "num_trained_tokens:sum": 40.0, "ratio:mean": 1.25,
                                       "ratio:max": 3.0}
    assert dp.union_metrics({"loss:sum": 2.0}) == {"loss:sum": 2.0}  # one process: unchanged


def test_indivisible_groups_fail_before_any_model_loads(monkeypatch, tmp_path):
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)

    def no_model():
        raise AssertionError("a model was requested before the configuration was checked")

    config = TrainConfig(env="qa", dataset="test", num_rollouts=6, num_groups=3, model="tiny",
                         log_root=str(tmp_path / "logs"))
    with pytest.raises(ConfigError, match=r"--num-groups 3 is not divisible by the 2 torchrun processes.*"
                                          r"Use --num-groups 2 or 4"):
        run_training(config, service_factory=no_model)
    assert not (tmp_path / "logs").exists()
    assert not distributed.is_initialized()


def test_single_process_shared_run_dir_and_null_writer(tmp_path):
    made = dp.shared_run_dir(lambda: tmp_path / "run")
    assert made == tmp_path / "run"
    writer = dp.NullWriter()
    for call in ("write_metadata", "write_rollouts", "write_step", "log_step", "write_report", "finish"):
        assert getattr(writer, call)("anything", step=0) is None
    assert list(tmp_path.iterdir()) == []
