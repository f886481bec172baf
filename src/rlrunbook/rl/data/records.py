"""The records tasks consume, and a fingerprint of a list of them for the run metadata.

Records are frozen so that a data set loaded once can be shared between a task, its reward and
the run metadata without anyone mutating it under the others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass

from rlrunbook.errors import InputError


@dataclass(frozen=True)
class QARecord:
    """A question with its accepted answers (GSM8K, NQ-open, the built-in arithmetic set).

    ``answers`` holds every accepted final answer (GSM8K: one, the number after ``#### `` without
    thousands commas; NQ-open: several aliases). ``solution`` is the full worked solution where
    the data set has one (GSM8K), else ``""``.
    """

    id: str
    question: str
    answers: tuple[str, ...]
    solution: str = ""

    def __post_init__(self) -> None:
        # A list would make the record unhashable and mutable; a bare str would iterate as characters.
        if not isinstance(self.answers, tuple) or not self.answers:
            raise InputError(f"QARecord {self.id!r}: answers={self.answers!r} must be a non-empty tuple "
                             "of str; wrap a single answer as (answer,).")
        if not all(isinstance(a, str) for a in self.answers):
            raise InputError(f"QARecord {self.id!r}: answers={self.answers!r} must all be str.")


@dataclass(frozen=True)
class SummaryRecord:
    """A document to summarise with its reference summary (CNN/DailyMail ``highlights``)."""

    id: str
    document: str
    highlights: str


def fingerprint_records(records: Iterable[QARecord | SummaryRecord]) -> str:
    """The sha256 hex digest of a canonical JSON rendering of ``records``, in order.

    The record type is part of the rendering, so equal fields under different record kinds give
    different fingerprints; key order and whitespace are fixed so the digest is stable across runs.
    """
    canonical = []
    for record in records:
        if not dataclasses.is_dataclass(record) or isinstance(record, type):
            raise InputError(f"fingerprint_records: {record!r} is not a record; pass QARecord or "
                             "SummaryRecord instances.")
        canonical.append({"kind": type(record).__name__, **dataclasses.asdict(record)})
    text = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
