"""Checkpoint folders (rlrunbook.run.checkpoint_format): round trip, atomic save, listing, corruption, no pickle."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlrunbook.errors import InputError
from rlrunbook.run import checkpoint_format as ckpt
from rlrunbook.run.checkpoint_format import (
    Checkpoint,
    capture_rng,
    checkpoint_dirs,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
    verify_checkpoint,
)


def adam_state() -> tuple[dict[str, torch.Tensor], dict]:
    """A real AdamW state after two steps on a small layer, and that layer's weights."""
    layer = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    for _ in range(2):
        layer(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in layer.named_parameters()}, optimizer.state_dict()


def make_checkpoint(step: int) -> Checkpoint:
    adapter, optimizer = adam_state()
    return Checkpoint(step=step, config={"steps": 8, "seed": 3}, adapter=adapter, optimizer=optimizer,
                      rng=capture_rng(), weights_version=step)


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "run").mkdir()
    return tmp_path / "run"


def test_round_trip_is_exact(run_dir):
    original = make_checkpoint(2)
    folder = save_checkpoint(run_dir, original)
    assert folder == run_dir / "checkpoints" / "step_000002"
    loaded = load_checkpoint(folder)
    assert loaded.step == 2 and loaded.config == original.config and loaded.weights_version == 2
    assert loaded.adapter.keys() == original.adapter.keys()
    assert all(torch.equal(loaded.adapter[k], original.adapter[k]) for k in original.adapter)
    for index, state in original.optimizer["state"].items():
        assert all(torch.equal(loaded.optimizer["state"][index][k], v) for k, v in state.items())
    assert loaded.optimizer["param_groups"] == original.optimizer["param_groups"]
    manifest = json.loads((folder / "checkpoint.json").read_text())
    assert manifest["format_version"] == 2 and manifest["data_cursor"] == {"next_step": 2}
    assert manifest["manifest_sha256"] == ckpt.manifest_sha256(manifest)
    assert set(manifest["files"]) == {"adapter.safetensors", "optimizer.pt", "rng.json", "rng.safetensors"}


def test_optimizer_state_continues_exactly(run_dir):
    """AdamW restored from the file takes the same next step as the live one."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    x = torch.randn(5, 4)
    layer(x).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    adapter = {n: p.detach().clone() for n, p in layer.named_parameters()}
    folder = save_checkpoint(run_dir, Checkpoint(1, {}, adapter, optimizer.state_dict(), capture_rng()))
    loaded = load_checkpoint(folder)
    twin = torch.nn.Linear(4, 3)
    twin.load_state_dict(loaded.adapter)
    twin_optimizer = torch.optim.AdamW(twin.parameters())
    twin_optimizer.load_state_dict(loaded.optimizer)
    for model, opt in ((layer, optimizer), (twin, twin_optimizer)):
        model(x).square().sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(layer.parameters(), twin.parameters(), strict=True))


def test_rng_states_round_trip(run_dir):
    folder = save_checkpoint(run_dir, make_checkpoint(1))
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    restore_rng(load_checkpoint(folder).rng)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])


def test_files_need_no_unpickling(run_dir):
    folder = save_checkpoint(run_dir, make_checkpoint(3))
    load_file(str(folder / "adapter.safetensors"))
    load_file(str(folder / "rng.safetensors"))
    json.loads((folder / "rng.json").read_text())
    json.loads((folder / "checkpoint.json").read_text())
    state = torch.load(folder / "optimizer.pt", weights_only=True)
    assert set(state) == {"state", "param_groups"}
    assert sorted(p.name for p in folder.iterdir()) == ["adapter.safetensors", "checkpoint.json", "optimizer.pt",
                                                        "rng.json", "rng.safetensors"]


def test_crash_before_rename_keeps_previous_checkpoint(run_dir, monkeypatch):
    save_checkpoint(run_dir, make_checkpoint(2))

    def crash(src, dst):
        raise OSError("simulated crash between write and rename")

    monkeypatch.setattr(ckpt.os, "rename", crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(run_dir, make_checkpoint(4))
    monkeypatch.undo()
    temps = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert len(temps) == 1 and (temps[0] / "adapter.safetensors").is_file(), "the crash left a temp folder"
    assert [step for step, _ in checkpoint_dirs(run_dir)] == [2], "the temp folder is not a checkpoint"
    assert load_checkpoint(run_dir / "checkpoints" / "step_000002").step == 2
    save_checkpoint(run_dir, make_checkpoint(4))  # the next save cleans up
    assert not temps[0].exists()
    assert [step for step, _ in checkpoint_dirs(run_dir)] == [2, 4]


def test_a_step_is_never_overwritten(run_dir):
    save_checkpoint(run_dir, make_checkpoint(2))
    with pytest.raises(InputError, match="exists already"):
        save_checkpoint(run_dir, make_checkpoint(2))


def test_listing_orders_by_step_and_skips_non_checkpoints(run_dir):
    for step in (10, 2, 4):
        save_checkpoint(run_dir, make_checkpoint(step))
    root = run_dir / "checkpoints"
    (root / "step_000006").mkdir()  # no manifest
    (root / ".tmp-step_000008-abc").mkdir()
    (root / "notes").mkdir()
    assert [(s, p.name) for s, p in checkpoint_dirs(run_dir)] == [
        (2, "step_000002"), (4, "step_000004"), (10, "step_000010")]
    assert checkpoint_dirs(run_dir / "missing") == []


@pytest.fixture
def saved(run_dir):
    return save_checkpoint(run_dir, make_checkpoint(2))


def rewrite_manifest(folder, manifest: dict) -> None:
    """Write ``manifest`` with its own checksum recomputed: an edit made on purpose, past the manifest check."""
    manifest = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    (folder / "checkpoint.json").write_text(json.dumps({**manifest, "manifest_sha256": ckpt.manifest_sha256(manifest)}))


def test_flipped_byte_is_refused(saved):
    path = saved / "adapter.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"adapter.safetensors does not match its sha256.*Resume from another"):
        load_checkpoint(saved)


def test_truncated_file_is_refused(saved):
    path = saved / "optimizer.pt"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(InputError, match="optimizer.pt does not match its sha256"):
        load_checkpoint(saved)


def test_truncated_safetensors_with_matching_manifest_is_refused(saved):
    """Even a manifest rewritten to fit a cut file does not get the file past the reader."""
    path = saved / "adapter.safetensors"
    path.write_bytes(path.read_bytes()[:-40])
    manifest = json.loads((saved / "checkpoint.json").read_text())
    manifest["files"]["adapter.safetensors"] = {"sha256": ckpt._sha256(path), "bytes": path.stat().st_size}
    rewrite_manifest(saved, manifest)
    with pytest.raises(InputError, match="adapter.safetensors cannot be read"):
        load_checkpoint(saved)


def test_missing_file_is_refused(saved):
    (saved / "rng.safetensors").unlink()
    with pytest.raises(InputError, match="rng.safetensors is missing"):
        load_checkpoint(saved)


def test_missing_manifest_is_refused(saved):
    (saved / "checkpoint.json").unlink()
    with pytest.raises(InputError, match="no checkpoint.json"):
        verify_checkpoint(saved)


def test_unknown_format_version_is_refused(saved):
    manifest = json.loads((saved / "checkpoint.json").read_text())
    manifest["format_version"] = 99
    rewrite_manifest(saved, manifest)
    with pytest.raises(InputError, match="format version 99; this rlrunbook reads versions 1, 2"):
        load_checkpoint(saved)


def test_manifest_step_must_match_the_folder(saved):
    moved = saved.parent / "step_000008"
    shutil.move(saved, moved)
    with pytest.raises(InputError, match="folder name says step 8, the manifest 2"):
        load_checkpoint(moved)


# --- the manifest's own checksum and fields (issue 24) ------------------------------------------------------

def test_a_flipped_digit_in_the_manifest_config_is_refused(run_dir):
    """The learning rate 0.0001 edited to 0.0009 in checkpoint.json: resumed with before its checksum existed."""
    checkpoint = Checkpoint(step=2, config={"learning_rate": 0.0001, "seed": 3}, adapter=adam_state()[0],
                            optimizer=None, rng=capture_rng())
    folder = save_checkpoint(run_dir, checkpoint)
    path = folder / "checkpoint.json"
    text = path.read_text()
    assert text.count("0.0001") == 1
    path.write_text(text.replace("0.0001", "0.0009"))
    with pytest.raises(InputError, match=r"checkpoint.json does not match its own sha256 \(manifest_sha256\).*"
                                         r"config and step cannot be trusted.*Resume from another"):
        load_checkpoint(folder)


def test_the_manifest_checksum_ignores_key_order_and_spacing(saved):
    manifest = json.loads((saved / "checkpoint.json").read_text())
    (saved / "checkpoint.json").write_text(json.dumps(dict(reversed(list(manifest.items()))), indent=4))
    assert load_checkpoint(saved).step == 2  # the same content, written otherwise: still the same checksum


def test_a_format_1_checkpoint_without_a_manifest_checksum_is_still_read(saved):
    manifest = json.loads((saved / "checkpoint.json").read_text())
    del manifest["manifest_sha256"]
    manifest["format_version"] = 1
    (saved / "checkpoint.json").write_text(json.dumps(manifest, indent=1))
    assert load_checkpoint(saved).step == 2


def test_a_format_2_manifest_without_its_checksum_is_refused(saved):
    manifest = json.loads((saved / "checkpoint.json").read_text())
    del manifest["manifest_sha256"]
    (saved / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match="does not match its own sha256"):
        load_checkpoint(saved)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m.pop("has_optimizer"), r"does not say whether it holds the optimizer"),
    (lambda m: m.update(step="2"), r"has no step count .*'2'"),
    (lambda m: m.update(config=[1]), r"holds no config"),
    (lambda m: m["files"].update({"../../escape": {"sha256": "0" * 64, "bytes": 1}}), r"not a file name inside"),
    (lambda m: m["files"].update({"rng.json": "abc"}), r"no sha256 and size for rng.json"),
])
def test_manifest_fields_are_checked_before_any_file_is_trusted(saved, edit, message):
    """Found as ``KeyError: 'has_optimizer'`` and the like: a manifest edited with its checksum recomputed."""
    manifest = json.loads((saved / "checkpoint.json").read_text())
    edit(manifest)
    rewrite_manifest(saved, manifest)
    with pytest.raises(InputError, match=rf"checkpoint .* is corrupted or incomplete: .*{message}"):
        load_checkpoint(saved)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda rng: rng.pop("python"), r"rng.json cannot be read \(KeyError: 'python'\)"),
    (lambda rng: rng["numpy"].update(key=[1, 2, 3]), r"rng.json cannot be read \((IndexError|ValueError)"),
    (lambda rng: rng["python"].update(state=[2**70] * 625), r"rng.json cannot be read \((OverflowError|ValueError)"),
])
def test_an_rng_state_the_generators_refuse_is_refused_on_reading(saved, edit, message):
    """rng.json edited and its sha256 recomputed in the manifest: refused while reading, not at restore."""
    path = saved / "rng.json"
    rng = json.loads(path.read_text())
    edit(rng)
    path.write_text(json.dumps(rng))
    manifest = json.loads((saved / "checkpoint.json").read_text())
    manifest["files"]["rng.json"] = {"sha256": ckpt._sha256(path), "bytes": path.stat().st_size}
    rewrite_manifest(saved, manifest)
    state = random.getstate()
    with pytest.raises(InputError, match=message):
        load_checkpoint(saved)
    assert random.getstate() == state  # checked on fresh generators: the global ones untouched


def _full_state() -> tuple[dict[str, torch.Tensor], dict]:
    """Whole weights and an AdamW-like state keyed by name, as ``sharding.full_state`` gives them."""
    torch.manual_seed(0)
    weights = {"embed.weight": torch.randn(5, 3), "norm.weight": torch.randn(3), "tiny.bias": torch.randn(1)}
    state = {name: {"step": torch.tensor(2.0), "exp_avg": torch.randn_like(w), "exp_avg_sq": torch.rand_like(w)}
             for name, w in weights.items()}
    groups = [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "foreach": None,
               "params": list(weights)}]
    return weights, {"state": state, "param_groups": groups}


def _rank_shards(weights: dict, optimizer: dict, rank: int, world: int) -> tuple[dict, dict]:
    """Rank ``rank``'s shards as FSDP2 cuts them: ``torch.chunk`` along the first dimension, empty past the last
    chunk; step counts whole."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t.clone()
        pieces = torch.chunk(t, world, dim=0)
        return pieces[rank].clone() if rank < len(pieces) else t[:0].clone()

    state = {n: {k: cut(v) for k, v in entry.items()} for n, entry in optimizer["state"].items()}
    return {n: cut(w) for n, w in weights.items()}, {"state": state, "param_groups": optimizer["param_groups"]}


def _save_sharded(run_dir, step: int, world: int) -> tuple[dict, dict]:
    """A checkpoint of ``step`` written as ``world`` ranks would: stage, ranks 1.. write, rank 0 finishes."""
    weights, optimizer = _full_state()
    staging = ckpt.stage_sharded(run_dir, step)
    for rank in range(1, world):
        ckpt.write_shard(staging, rank, world, *_rank_shards(weights, optimizer, rank, world))
    mine, my_optimizer = _rank_shards(weights, optimizer, 0, world)
    save_checkpoint(run_dir, Checkpoint(step=step, config={"steps": 8}, adapter=mine, optimizer=my_optimizer,
                                        rng=capture_rng(), weights_version=step, shard=(0, world)))
    return weights, optimizer


@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_checkpoint_reads_as_each_ranks_shards_or_joined_whole(run_dir, world):
    weights, optimizer = _save_sharded(run_dir, 3, world)
    folder = run_dir / "checkpoints" / "step_000003"
    manifest = verify_checkpoint(folder)
    assert manifest["shards"] == world and "adapter.safetensors" not in manifest["files"]
    assert {ckpt.shard_file_name(r, world) for r in range(world)} <= manifest["files"].keys()
    assert not list((run_dir / "checkpoints").glob(".tmp-*")), "the staging folder became the checkpoint"
    for rank in range(world):  # at the same world size each rank reads its own shards only
        loaded = load_checkpoint(folder, shard=(rank, world))
        mine, my_optimizer = _rank_shards(weights, optimizer, rank, world)
        assert loaded.shard == (rank, world)
        assert all(torch.equal(loaded.adapter[n], mine[n]) for n in weights)
        assert all(torch.equal(loaded.optimizer["state"][n][k], v)
                   for n, entry in my_optimizer["state"].items() for k, v in entry.items())
    for shard in (None, (0, 1), (0, world + 1)):  # anywhere else: whole tensors
        joined = load_checkpoint(folder, shard=shard)
        assert joined.shard is None and joined.step == 3
        assert all(torch.equal(joined.adapter[n], w) for n, w in weights.items())
        assert all(torch.equal(joined.optimizer["state"][n][k], v)
                   for n, entry in optimizer["state"].items() for k, v in entry.items())
        assert joined.optimizer["param_groups"] == optimizer["param_groups"]


def test_a_sharded_checkpoint_missing_a_ranks_file_is_refused(run_dir):
    weights, optimizer = _full_state()
    staging = ckpt.stage_sharded(run_dir, 1)  # rank 1 never wrote
    with pytest.raises(InputError, match="lacks the shard files"):
        save_checkpoint(run_dir, Checkpoint(step=1, config={}, adapter=weights, optimizer=optimizer,
                                            rng=capture_rng(), shard=(0, 2)))
    assert not (run_dir / "checkpoints" / "step_000001").exists() and staging.is_dir()
    _save_sharded(run_dir, 2, 2)  # the next save removes what the failed one left
    assert not staging.exists()
    folder = run_dir / "checkpoints" / "step_000002"
    (folder / ckpt.shard_file_name(1, 2)).unlink()
    with pytest.raises(InputError, match="shard_00001_of_00002.safetensors is missing"):
        load_checkpoint(folder)


def test_a_sharded_step_is_never_overwritten(run_dir):
    _save_sharded(run_dir, 2, 2)
    with pytest.raises(InputError, match="exists already"):
        ckpt.stage_sharded(run_dir, 2)
