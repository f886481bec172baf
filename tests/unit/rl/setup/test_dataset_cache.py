"""--cache-dataset: the normalised copy round-trips, is used instead of the source, and is refused when damaged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlrunbook.rl.data import DatasetError, fingerprint_records
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.prepare import prepare

ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "What is 1,000 + 1?", "answer": "#### 1,001"},
    {"question": "Half of 10?", "answer": "10 / 2 = 5 #### 5"},
]


def _source(tmp_path: Path) -> Path:
    path = tmp_path / "data" / "gsm.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _config(dataset, cache_dir, **changes) -> TrainConfig:
    return TrainConfig(env="qa", dataset=str(dataset), num_rollouts=4,
                       data={"cache": True, "cache_dir": str(cache_dir)}, **changes)


def test_round_trip_then_the_source_is_not_needed(tmp_path):
    source, cache = _source(tmp_path), tmp_path / "cache"
    _, _, uncached_task, uncached = prepare(TrainConfig(env="qa", dataset=str(source), num_rollouts=4))
    _, _, first_task, first = prepare(_config(source, cache))
    info = first_task.dataset_info(first)
    [path] = cache.glob("*.jsonl")
    assert info["cache"]["status"] == "written" and info["cache"]["path"] == str(path)
    assert path.name.endswith(f"-{info['fingerprint']}.jsonl")
    assert info["cache"]["source_fingerprint"] == info["cache"]["cached_fingerprint"] == info["fingerprint"]
    assert first == uncached and info["fingerprint"] == uncached_task.dataset_info(uncached)["fingerprint"]
    assert first[1].record.answers == ("1001",), "normalised records are cached, not raw rows"

    source.unlink()
    with pytest.raises(DatasetError, match="no such file"):
        prepare(TrainConfig(env="qa", dataset=str(source), num_rollouts=4))
    _, _, second_task, second = prepare(_config(source, cache))
    assert second == first
    assert second_task.dataset_info(second) == {**info, "cache": {**info["cache"], "status": "loaded"}}


def test_other_options_use_another_cache_file(tmp_path):
    cache = tmp_path / "cache"
    _, _, _, seed0 = prepare(_config("test", cache, extra={"test_size": 4}, seed=0))
    _, _, _, seed1 = prepare(_config("test", cache, extra={"test_size": 4}, seed=1))
    _, _, _, again = prepare(_config("test", cache, extra={"test_size": 4}, seed=0))
    assert seed0 != seed1 and again == seed0
    assert len(list(cache.glob("*.jsonl"))) == 2


def _cached_file(tmp_path) -> Path:
    source, cache = _source(tmp_path), tmp_path / "cache"
    prepare(_config(source, cache))
    [path] = cache.glob("*.jsonl")
    return path


def _edit_line(path: Path, number: int, change) -> None:
    lines = path.read_text().splitlines()
    row = json.loads(lines[number - 1])
    change(row)
    lines[number - 1] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")


def test_an_edited_record_is_refused(tmp_path):
    path = _cached_file(tmp_path)
    _edit_line(path, 3, lambda row: row.__setitem__("answers", ["1002"]))  # line 1 is the header
    with pytest.raises(DatasetError, match="edited or damaged") as caught:
        prepare(_config(tmp_path / "data" / "gsm.jsonl", tmp_path / "cache"))
    assert str(path) in str(caught.value) and "Delete it" in str(caught.value)


def test_a_dropped_record_is_refused(tmp_path):
    path = _cached_file(tmp_path)
    path.write_text("\n".join(path.read_text().splitlines()[:-1]) + "\n")
    with pytest.raises(DatasetError, match="2 records have fingerprint"):
        prepare(_config(tmp_path / "data" / "gsm.jsonl", tmp_path / "cache"))


@pytest.mark.parametrize(("change", "message"), [
    (lambda row: row.pop("question"), "line 2: missing field 'question'"),
    (lambda row: row.__setitem__("answers", "7"), "line 2: field 'answers' is a string"),
    (lambda row: row.__setitem__("kind", "Other"), "line 2: field 'kind' is 'Other'"),
])
def test_cache_rows_are_schema_checked_with_their_line(tmp_path, change, message):
    path = _cached_file(tmp_path)
    _edit_line(path, 2, change)
    with pytest.raises(DatasetError, match=message):
        prepare(_config(tmp_path / "data" / "gsm.jsonl", tmp_path / "cache"))


def test_default_cache_dir_is_under_the_model_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRUNBOOK_CACHE_DIR", str(tmp_path / "models"))
    _, _, task, problems = prepare(TrainConfig(env="qa", dataset="test", num_rollouts=4, extra={"test_size": 3},
                                               data={"cache": True}))
    path = Path(task.dataset_info(problems)["cache"]["path"])
    assert path.parent == tmp_path / "models" / "datasets"
    assert path.stem.endswith(fingerprint_records([p.record for p in problems]))


def test_summary_records_round_trip(tmp_path, generated_data):
    _, _, _, plain = prepare(TrainConfig(env="summary", num_rollouts=4))
    cache = tmp_path / "cache"
    _, _, _, written = prepare(TrainConfig(env="summary", num_rollouts=4, data={"cache": True, "cache_dir": str(cache)}))
    _, _, task, loaded = prepare(TrainConfig(env="summary", num_rollouts=4, data={"cache": True, "cache_dir": str(cache)}))
    assert plain == written == loaded and task.cache_info["status"] == "loaded"
