"""Data lines and nesting are bounded (issue 24, point 2), and a data set whose references are all empty is
refused (point 3): each hostile line is refused naming the file, the line and the limit, with no
``RecursionError``, ``ValueError`` of int conversion or ``MemoryError`` from the libraries underneath.
"""

from __future__ import annotations

import time

import pytest

from rlrunbook.rl.data import load_nq_open
from rlrunbook.rl.data.errors import DatasetError
from rlrunbook.rl.data.jsonl import parse_row, read_jsonl
from rlrunbook.rl.data.limits import MAX_LINE_BYTES
from rlrunbook.rl.data.quality import data_warnings
from rlrunbook.rl.rollout.tasks import Problem, QATask, SummaryTask
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.prepare import prepare

SCHEMA = {"question": str, "answer": list[str]}
GOOD = '{"question": "1 + 1?", "answer": ["2"]}'


def _file(tmp_path, *lines: str, name: str = "d.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_an_integer_of_5001_digits_is_refused_by_line(tmp_path):
    """Python refuses to convert more than 4,300 digits (a ValueError from inside json.loads)."""
    path = _file(tmp_path, GOOD, '{"question": "q", "answer": ["a"], "id": ' + "7" * 5001 + "}")
    with pytest.raises(DatasetError, match=r"d.jsonl: line 2: holds an integer of 5,001 digits, above the limit "
                                           r"of 19 \(64 bits\)"):
        read_jsonl(path, SCHEMA)


def test_an_integer_of_19_digits_is_read():
    """The boundary: 19 digits hold every int64."""
    assert parse_row('{"id": 9223372036854775807}', "here") == {"id": 2**63 - 1}
    with pytest.raises(DatasetError, match="20 digits"):
        parse_row('{"id": 92233720368547758070}', "here")


@pytest.mark.parametrize("depth, refused", [(64, False), (65, True), (100_000, True)])
def test_nesting_is_bounded_without_a_recursion_error(tmp_path, depth, refused):
    row = '{"question": "q", "answer": ["a"], "x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
    path = _file(tmp_path, row)
    if refused:
        with pytest.raises(DatasetError, match="d.jsonl: line 1: nested more than 64 levels deep"):
            read_jsonl(path, SCHEMA)
    else:
        assert read_jsonl(path, SCHEMA)[0]["question"] == "q"


def test_a_line_longer_than_the_limit_is_refused_before_it_is_read_whole(tmp_path):
    path = tmp_path / "huge.jsonl"
    with path.open("w") as file:
        file.write(GOOD + "\n")
        file.write('{"question": "' + "x" * MAX_LINE_BYTES + '", "answer": ["a"]}\n')
    started = time.monotonic()
    with pytest.raises(DatasetError, match=r"huge.jsonl: line 2: longer than 8,388,608 bytes, the limit of one row"):
        read_jsonl(path, SCHEMA)
    assert time.monotonic() - started < 10


def test_a_line_just_under_the_limit_is_read(tmp_path):
    text = "y" * (MAX_LINE_BYTES - 100)
    path = _file(tmp_path, '{"question": "' + text + '", "answer": ["a"]}')
    assert read_jsonl(path, SCHEMA)[0]["question"] == text


@pytest.mark.parametrize("separator", ["\u2028", "\u0085", "\u2029"])
def test_unicode_line_separators_inside_a_string_are_text(tmp_path, separator):
    """``str.splitlines`` breaks at them, which cut a valid JSON line in two ("not valid JSON")."""
    path = _file(tmp_path, '{"question": "a' + separator + 'b", "answer": ["c"]}', GOOD)
    rows = read_jsonl(path, SCHEMA)
    assert [row["question"] for row in rows] == [f"a{separator}b", "1 + 1?"]


def test_bytes_that_are_not_utf8_are_refused_by_line(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(GOOD.encode() + b'\n{"question": "caf\xe9", "answer": ["a"]}\n')
    with pytest.raises(DatasetError, match=r"latin.jsonl: line 2: not UTF-8 text \(byte 0xe9 at column 18\)"):
        read_jsonl(path, SCHEMA)


# --- references -----------------------------------------------------------------------------------------

def test_a_data_set_whose_references_are_all_empty_is_refused(tmp_path):
    path = _file(tmp_path, '{"question": "1 + 1?", "answer": [""]}', '{"question": "2 + 2?", "answer": [" ", ""]}')
    with pytest.raises(DatasetError, match="the reference of every one of its 2 row"):
        prepare(TrainConfig(model="tiny", env="qa", dataset=str(path), reward_fn="text", num_rollouts=4))


def test_some_empty_references_are_warned_about_by_id(tmp_path):
    path = _file(tmp_path, '{"question": "1 + 1?", "answer": [""]}', GOOD)
    records = load_nq_open(path)
    task = QATask(str(path), "text", 0)
    problems = [Problem(record.id, record) for record in records]
    warnings = data_warnings("d", problems, lambda p: p.record.question, reference_of=task.reference)
    assert warnings == [f"data set 'd': 1 row(s) with an empty reference ({records[0].id}); every completion of "
                        "their groups gets the same reward, so they teach nothing. Fill in or drop those rows."]


def test_a_reference_free_reward_needs_no_references():
    """Summary's compression reward reads no highlights; rouge compares against them."""
    assert not SummaryTask(None, "compression", 0).uses_references()
    assert SummaryTask(None, "rouge", 0).uses_references()


def test_a_reference_is_the_first_non_blank_answer(tmp_path):
    records = load_nq_open(_file(tmp_path, '{"question": "q", "answer": ["", " ", "4", "four"]}',
                                 '{"question": "r", "answer": [""]}'))
    task = QATask(None, "text", 0)
    assert [task.reference(Problem(r.id, r)) for r in records] == ["4", ""]


def test_a_pipe_is_refused_instead_of_read_until_something_writes(tmp_path):
    import os

    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DatasetError, match="is not a regular file"):
        read_jsonl(fifo, {})
