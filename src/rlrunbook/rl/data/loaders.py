"""Loaders of the real data sets: GSM8K, NQ-open and CNN/DailyMail, from a local file or the hub.

Each loader takes a ``source`` (see ``sources``: a JSONL file, a folder holding one, or a hub
name) and returns frozen records in file order. Local rows and hub rows go through the same
schema check and normalisation, so both forms give equal records for the same split. Record ids
are ``<kind>-<index>`` (0-based position) where the data set has no ids of its own; a split other
than the default adds its name (``gsm8k-train-0``), so ids never collide across splits.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from rlrunbook.errors import ConfigError
from rlrunbook.rl.data.errors import DatasetError
from rlrunbook.rl.data.jsonl import Schema, check_row, describe_schema, read_jsonl_lines
from rlrunbook.rl.data.records import QARecord, SummaryRecord
from rlrunbook.rl.data.sources import hub_spec_for, load_hub_rows, resolve_local

Source = str | os.PathLike

GSM8K_SCHEMA: Schema = {"question": str, "answer": str}
NQ_OPEN_SCHEMA: Schema = {"question": str, "answer": list[str]}
# The local CNN/DailyMail copy has integer ids, the hub has hex strings: both become str.
CNN_DAILYMAIL_SCHEMA: Schema = {"id": (str, int), "article": str, "highlights": str}

# A located row: (where it came from, for error messages; the row itself).
_Located = tuple[str, Mapping]


def load_gsm8k(source: Source, *, split: str | None = None) -> list[QARecord]:
    """GSM8K problems; ``answers`` is the number after ``#### `` with thousands commas removed.

    ``solution`` keeps the whole worked answer (calculator annotations and ``#### `` line
    included). ``split`` picks a hub split (default ``test``) and is refused for a local file.
    """
    rows, prefix = _rows("gsm8k", source, GSM8K_SCHEMA, split)
    return [QARecord(id=f"{prefix}-{i}", question=row["question"],
                     answers=(_gsm8k_final_answer(row["answer"], where),), solution=row["answer"])
            for i, (where, row) in enumerate(rows)]


def load_nq_open(source: Source, *, split: str | None = None) -> list[QARecord]:
    """NQ-open questions; ``answers`` holds every accepted alias (the row's ``answer`` list)."""
    rows, prefix = _rows("nq_open", source, NQ_OPEN_SCHEMA, split)
    records = []
    for i, (where, row) in enumerate(rows):
        if not row["answer"]:
            raise DatasetError(f"{where}: field 'answer' is an empty list; NQ-open rows need at least "
                               "one accepted answer. Drop the row or add its answers.")
        records.append(QARecord(id=f"{prefix}-{i}", question=row["question"], answers=tuple(row["answer"])))
    return records


def load_cnn_dailymail(source: Source, *, split: str | None = None) -> list[SummaryRecord]:
    """CNN/DailyMail articles (``document``) with their reference ``highlights``; ids kept, as str."""
    rows, _ = _rows("cnn_dailymail", source, CNN_DAILYMAIL_SCHEMA, split)
    records = []
    for where, row in rows:
        if not row["article"].strip():
            # An empty document makes every summary reward 0 and the group's spread 0: refuse it here.
            raise DatasetError(f"{where}: field 'article' is empty; every row needs a document to "
                               "summarise. Drop the row.")
        records.append(SummaryRecord(id=str(row["id"]), document=row["article"],
                                     highlights=row["highlights"]))
    return records


LOADERS: Mapping[str, Callable[..., list]] = {
    "gsm8k": load_gsm8k,
    "nq_open": load_nq_open,
    "cnn_dailymail": load_cnn_dailymail,
}


def _rows(kind: str, source: Source, schema: Schema, split: str | None) -> tuple[list[_Located], str]:
    """Checked rows of ``source`` with where each came from, and the id prefix for this split."""
    local = resolve_local(source)
    if local is not None:
        if split is not None:
            raise ConfigError(f"split={split!r} applies to hub data sets only, but {local} is a local "
                              "file; pass the file of the split you want instead.")
        return [(f"{local}: line {n}", row) for n, row in read_jsonl_lines(local, schema)], kind
    spec = hub_spec_for(kind, os.fspath(source))
    chosen = split or spec.split
    raw = load_hub_rows(spec, chosen)
    if not raw:
        raise DatasetError(f"{spec.name} (split {chosen}): contains no rows. Expected fields "
                           f"{describe_schema(schema)}; pick another split.")
    rows = []
    for n, row in enumerate(raw, start=1):
        where = f"{spec.name} (split {chosen}): row {n}"
        check_row(row, schema, where=where)
        rows.append((where, row))
    prefix = kind if chosen == spec.split else f"{kind}-{chosen}"
    return rows, prefix


def _gsm8k_final_answer(solution: str, where: str) -> str:
    """The final answer of a GSM8K solution: the text after the last ``####``, without commas."""
    if "####" not in solution:
        raise DatasetError(f"{where}: field 'answer' has no '#### <final answer>' line; GSM8K solutions "
                           "end with one. Fix the row or pass a GSM8K file.")
    # "1,000" is how GSM8K writes thousands; rewards compare bare numbers.
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise DatasetError(f"{where}: field 'answer' has nothing after '####'. Add the final answer.")
    return final
