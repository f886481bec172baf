"""``rlrunbook.distributed``: the torchrun layout, contiguous sharding, and the single-process no-ops."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlrunbook import distributed
from rlrunbook.errors import ConfigError

TORCHRUN_ENV = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500"}


@given(count=st.integers(0, 200), world=st.integers(1, 16))
def test_every_item_lands_on_exactly_one_rank_in_order(count, world):
    items = list(range(count))
    shards = [distributed.shard(items, r, world) for r in range(world)]
    assert [i for s in shards for i in s] == items  # the union, in rank order, is the 1-process order
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_shards_are_contiguous_blocks():
    # 6 groups over 3 ranks: [0, 1], [2, 3], [4, 5] (a strided split would give [0, 3], ...)
    assert [distributed.shard(range(6), r, 3) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    # 5 over 2: the first rank takes the extra one
    assert [distributed.shard("abcde", r, 2) for r in range(2)] == [list("abc"), list("de")]


def test_shard_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank 2 outside"):
        distributed.shard(range(4), 2, 2)


@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "1"}, {"WORLD_SIZE": ""}])
def test_no_torchrun_is_one_process(env):
    assert distributed.launch_layout(env) == distributed.Layout(rank=0, world_size=1, local_rank=0)


def test_torchrun_layout_is_read():
    assert distributed.launch_layout(TORCHRUN_ENV) == distributed.Layout(rank=1, world_size=2, local_rank=1)


@pytest.mark.parametrize("drop", ["RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_incomplete_torchrun_env_names_what_is_missing(drop):
    env = {k: v for k, v in TORCHRUN_ENV.items() if k != drop}
    with pytest.raises(ConfigError, match=rf"WORLD_SIZE=2 but \['{drop}'\] unset.*torchrun --nproc_per_node=2"):
        distributed.launch_layout(env)


@pytest.mark.parametrize("change, match", [
    ({"RANK": "2"}, r"RANK=2 is outside \[0, WORLD_SIZE=2\)"),
    ({"RANK": "one"}, "RANK='one' is not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
])
def test_inconsistent_torchrun_env_is_a_config_error(change, match):
    with pytest.raises(ConfigError, match=match):
        distributed.launch_layout({**TORCHRUN_ENV, **change})


def test_backend_is_gloo_on_cpu_and_nccl_for_cuda_tensors():
    assert distributed.backend_for("cpu") == "gloo"
    assert distributed.backend_for("cuda") == "cpu:gloo,cuda:nccl"


def test_without_torchrun_every_helper_is_a_no_op(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.init() == distributed.Layout()
    assert not torch.distributed.is_initialized(), "one process must not start a process group"
    assert (distributed.rank(), distributed.world_size(), distributed.is_main()) == (0, 1, True)
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    distributed.all_reduce_sum(grads)
    assert [g.tolist() for g in grads] == [[1.0, 2.0], [[3.0]]]
    assert distributed.gather_objects({"a": 1}) == [{"a": 1}]
    assert distributed.broadcast_object("x") == "x"
    distributed.barrier()
    distributed.shutdown()
    assert distributed.shard([3, 4, 5]) == [3, 4, 5]
    assert not torch.distributed.is_initialized()
