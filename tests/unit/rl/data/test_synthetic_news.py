"""The embedded summarization set: generated articles with known key facts, and when ``cnn_dailymail`` falls
back to it (only the kind's name, only when neither the local copy nor the hub serves; with a notice)."""

from __future__ import annotations

import re

import pytest

from rlrunbook.errors import InputError
from rlrunbook.rl.data import DATA_DIR_ENV, default_local_path
from rlrunbook.rl.data.synthetic_news import synthetic_news
from rlrunbook.rl.rewards.summary import compression_reward, words
from rlrunbook.rl.rollout.tasks import SummaryTask
from rlrunbook.rl.setup.config import DataSettings
from rlrunbook.rl.setup.dataset_cache import load_problems
from rlrunbook.testing.data import write_data_root


def _cut(text: str, limit: int = 150) -> str:
    return " ".join(text.split()[:limit])


def test_deterministic_prefix_stable_and_distinct():
    records = synthetic_news(60, seed=0)
    assert records == synthetic_news(60, seed=0) and records[:20] == synthetic_news(20, seed=0)
    assert synthetic_news(5, seed=1) != records[:5]
    assert len({r.document for r in records}) == 60 and len({r.id for r in records}) == 60
    assert all(150 < len(r.document.split()) < 300 for r in records)  # the prompt keeps 150 words, as of real ones


def test_every_number_in_the_highlights_is_a_key_fact_of_the_article():
    for record in synthetic_news(100, seed=0):
        for number in re.findall(r"\d[\d,]*", record.highlights):
            assert number in record.document, (record.id, number)


def test_rewards_behave_as_on_real_articles():
    records = synthetic_news(200, seed=0)
    highlights = [compression_reward(_cut(r.document), r.highlights).reward for r in records]
    # measured on the project's 80 real CNN/DailyMail articles: highlights 0.00-0.78, mean 0.41; here 0.42-0.66
    assert 0.3 < min(highlights) and max(highlights) < 0.8 and 0.4 < sum(highlights) / len(highlights) < 0.65
    for record in records[:20]:
        document = _cut(record.document)
        assert compression_reward(document, document).reward == 0.0  # a copy does not compress
        lead = " ".join(document.split()[:20])
        assert compression_reward(document, lead).reward > 0.7  # a grounded 20-word extract scores high
        made_up = " ".join(f"zq{w}" for w in words(lead))
        assert compression_reward(document, made_up).reward == 0.0  # words not in the article: no grounding


def _task(dataset=None, **options):
    return SummaryTask(dataset, "compression", 0, {"summary_max_words": 150, **options})


@pytest.fixture
def no_local_copy(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "empty-data-root"))
    assert default_local_path("cnn_dailymail") is None


def test_the_kind_name_falls_back_with_one_notice(no_local_copy, monkeypatch):
    monkeypatch.setattr("rlrunbook.rl.rollout.tasks.hub_unreachable", lambda: "no connection to huggingface.co:443 (test)")
    task = _task()
    problems = task.load()
    assert len(problems) == 200 and problems[0].id == "synth-news-0-0"
    (notice,) = task.notices
    assert "\n" not in notice and "embedded synthetic news set" in notice and "(test)" in notice
    assert task.dataset_info(problems)["source"] == "embedded:synthetic_news-v1 (generated, 200 articles)"


@pytest.fixture
def hub_fails(monkeypatch):
    """The hub looks reachable, but load_dataset fails (as it does offline with nothing cached)."""
    import datasets

    def refuse(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'abisee/cnn_dailymail' on the Hub (test)")

    monkeypatch.setattr("rlrunbook.rl.rollout.tasks.hub_unreachable", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", refuse)


def test_the_hub_is_asked_then_the_fallback_serves(no_local_copy, hub_fails):
    task = _task()
    assert len(task.load()) == 200
    assert "load_dataset failed (ConnectionError: Couldn't reach" in task.notices[0] and "(test)" in task.notices[0]


def test_a_path_or_hub_id_the_user_names_never_falls_back(no_local_copy, tmp_path, hub_fails):
    with pytest.raises(InputError, match="no such file"):
        _task(str(tmp_path / "articles.jsonl")).load()
    with pytest.raises(InputError, match=r"abisee/cnn_dailymail .*load_dataset failed"):
        _task("abisee/cnn_dailymail").load()


def test_the_local_copy_wins_when_there_is_one(tmp_path, monkeypatch):
    copy = write_data_root(tmp_path / "data", rows=6)["cnn_dailymail"]
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "data"))
    monkeypatch.setattr("rlrunbook.rl.rollout.tasks.hub_unreachable", lambda: pytest.fail("the hub was asked"))
    task = _task()
    problems = task.load()
    assert len(problems) == 6 and problems[0].id == "0" and task.notices == []
    assert task.dataset_info(problems)["source"] == f"file:{copy}"


def test_the_fallback_is_never_pinned_by_the_dataset_cache(no_local_copy, tmp_path, monkeypatch):
    monkeypatch.setattr("rlrunbook.rl.rollout.tasks.hub_unreachable", lambda: "test")
    task = _task()
    problems = load_problems(task, DataSettings(cache=True, cache_dir=str(tmp_path / "cache")))
    assert len(problems) == 200 and task.cache_info is None and not (tmp_path / "cache").exists()
    assert "not caching embedded:synthetic_news-v1" in task.notices[-1]
