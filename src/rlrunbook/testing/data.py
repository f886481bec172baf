"""The data requirement of the ``data`` tests, and the data every other test sees.

The project's real data sets (GSM8K, NQ-open, CNN/DailyMail; their licenses are in the data folder's
README) are not part of the repository. :func:`rlrunbook.rl.data.default_local_path` finds them in
``$RLRUNBOOK_DATA_DIR`` when it is set, else in ``shared/data`` beside the checkout. A test that reads
them is marked ``@pytest.mark.data("gsm8k", ...)`` with the kinds it reads (``pytest -m data`` selects
exactly those): without a copy it skips with one line naming where it looked, and
``RLRUNBOOK_REQUIRE_DATA=1`` turns that skip into a failure, so a CI step that provides the data cannot
pass by skipping it.

Every other test generates what it reads (:func:`write_data_root`, the embedded news set, the built-in
arithmetic set) and runs the same whether or not real data lies beside the checkout: the suite shows
those tests an empty data root (:class:`DataRoots`), and no test reaches the Hugging Face hub
(:func:`offline_hub_env`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path

from rlrunbook.rl.data.sources import DATA_DIR_ENV, LOCAL_FILES, data_roots_searched, default_local_path
from rlrunbook.rl.data.synthetic_news import synthetic_news
from rlrunbook.testing.requirement import outcome, required

REQUIRE_ENV = "RLRUNBOOK_REQUIRE_DATA"

def offline_hub_env(datasets_cache: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """What the suite sets for every test, so that none reaches the Hugging Face hub for data and none reads a data
    set this machine once fetched from it: ``datasets`` offline (a hub call fails at once instead of retrying for
    half a minute) with an empty cache of its own. The hub's models are offline too (``HF_HUB_OFFLINE=1``: from the
    local cache only), unless ``HF_HUB_OFFLINE`` is set already: a GPU run on a hub model the user names
    (``RLRUNBOOK_GPU_MODELS``) may download it with ``HF_HUB_OFFLINE=0``."""
    return {"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(datasets_cache),
            "HF_HUB_OFFLINE": environ.get("HF_HUB_OFFLINE", "1")}


def data_required(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``RLRUNBOOK_REQUIRE_DATA`` turns the skip into a failure."""
    return required(REQUIRE_ENV, env)


def missing_data_reason(kinds: Iterable[str]) -> str | None:
    """Which of the real data sets ``kinds`` are not here and where they were looked for, in one line;
    ``None`` when every one is here."""
    kinds = tuple(kinds)
    if not kinds:
        raise ValueError("a `data` mark names the data sets its test reads, e.g. @pytest.mark.data('gsm8k')")
    missing = [kind for kind in kinds if default_local_path(kind) is None]  # also refuses an unknown kind
    if not missing:
        return None
    files = ", ".join(f"{kind}/{LOCAL_FILES[kind]}" for kind in missing)
    roots = data_roots_searched()
    if os.environ.get(DATA_DIR_ENV, "").strip():
        where = f"${DATA_DIR_ENV} ({roots[0]})"
    elif roots:
        where = f"shared/data beside the checkout ({' or '.join(map(str, roots))}; ${DATA_DIR_ENV} is unset)"
    else:
        where = f"no checkout above the package and ${DATA_DIR_ENV} is unset"
    return f"no {files} in {where}"


def data_outcome(missing: str | None, required: bool) -> tuple[str, str] | None:
    """What a ``data`` test does: ``None`` (run), ``("skip", reason)`` or ``("fail", reason)``; one line each."""
    return outcome(missing, required, REQUIRE_ENV, fails_with="the real data is missing",
                   skips_with="needs the project's real data", fix=f"set {DATA_DIR_ENV} to the folder that holds it")


def real_data_path(kind: str) -> Path:
    """The real copy of data set ``kind`` for a test marked ``data(kind)`` (its setup checked that it is here)."""
    path = default_local_path(kind)
    if path is None:
        raise FileNotFoundError(f"{missing_data_reason([kind])}: mark the test @pytest.mark.data({kind!r})")
    return path


class DataRoots:
    """The data root tests see through ``$RLRUNBOOK_DATA_DIR``: ``hidden`` (an empty folder) from the start of the
    suite, the user's own (the variable as it was, or unset: ``shared/data`` beside the checkout) while a test
    marked ``data`` runs. Subprocesses inherit what their test sees."""

    def __init__(self, environ: MutableMapping[str, str], hidden: Path):
        self._environ = environ
        self._real = environ.get(DATA_DIR_ENV)
        self.hidden = hidden

    def hide(self) -> None:
        self._environ[DATA_DIR_ENV] = str(self.hidden)

    def show(self) -> str | None:
        """Show the user's own data root; returns what was set before, for :meth:`put_back`."""
        before = self._environ.get(DATA_DIR_ENV)
        self.put_back(self._real)
        return before

    def put_back(self, value: str | None) -> None:
        if value is None:
            self._environ.pop(DATA_DIR_ENV, None)
        else:
            self._environ[DATA_DIR_ENV] = value


# ---- generated stand-ins for the real files: the same layout and schemas, text written for this project ----

_GSM8K_TEMPLATES = [
    ("A farm has {a} rows of {b} apple trees. How many apple trees are on the farm?",
     "There are {a} rows of {b} trees, so {a} * {b} = <<{a}*{b}={v}>>{v} trees.", "*"),
    ("Mia had {a} stickers and bought {b} more. How many stickers does she have now?",
     "She has {a} + {b} = <<{a}+{b}={v}>>{v} stickers.", "+"),
    ("A library owned {a} books and gave away {b} of them. How many books are left?",
     "{a} - {b} = <<{a}-{b}={v}>>{v} books are left.", "-"),
]


def gsm8k_rows(n: int) -> list[dict]:
    """``n`` word problems in GSM8K's schema (``question``; ``answer`` with a ``#### <number>`` last line,
    thousands written with commas), deterministic."""
    rows = []
    for i in range(n):
        question, solution, op = _GSM8K_TEMPLATES[i % len(_GSM8K_TEMPLATES)]
        a, b = 12 + 37 * i, 3 + (i * 7) % 40
        value = {"*": a * b, "+": a + b, "-": a - b}[op]
        rows.append({"question": question.format(a=a, b=b),
                     "answer": f"{solution.format(a=a, b=b, v=value)}\n#### {value:,}"})
    return rows


_NQ_OPEN = [
    ("what colour is the sky on a clear day", ["blue"]),
    ("how many legs does a spider have", ["eight", "8"]),
    ("which planet is closest to the sun", ["Mercury"]),
    ("what is the frozen form of water called", ["ice"]),
    ("what do bees make from nectar", ["honey"]),
    ("which ocean lies between africa and australia", ["the Indian Ocean", "Indian Ocean"]),
]


def nq_open_rows(n: int) -> list[dict]:
    """``n`` questions in NQ-open's schema (``question``; ``answer``: a list of accepted text answers)."""
    return [{"question": q, "answer": list(a)} for q, a in (_NQ_OPEN[i % len(_NQ_OPEN)] for i in range(n))]


def cnn_dailymail_rows(n: int) -> list[dict]:
    """``n`` articles in the CNN/DailyMail copy's schema (``id``: an int, ``article``, ``highlights``), from the
    embedded synthetic news set."""
    return [{"id": i, "article": r.document, "highlights": r.highlights} for i, r in enumerate(synthetic_news(n, 0))]


def write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def write_data_root(root: Path, rows: int = 24) -> dict[str, Path]:
    """A data root laid out as the real one (``<kind>/<file>``) holding ``rows`` generated rows of each kind;
    point ``$RLRUNBOOK_DATA_DIR`` at it and the kind names (``gsm8k``, ``nq_open``, ``cnn_dailymail``) resolve
    to these files."""
    makers = {"gsm8k": gsm8k_rows, "nq_open": nq_open_rows, "cnn_dailymail": cnn_dailymail_rows}
    return {kind: write_jsonl(root / kind / LOCAL_FILES[kind], makers[kind](rows)) for kind in LOCAL_FILES}
