"""Data sets for RL tasks: records, loaders of GSM8K / NQ-open / CNN-DailyMail, the built-in arithmetic set.

>>> from rlrunbook.rl.data import default_local_path, load_gsm8k
>>> records = load_gsm8k(default_local_path("gsm8k") or "openai/gsm8k")  # doctest: +SKIP
"""

from rlrunbook.rl.data.arithmetic import arithmetic_problems
from rlrunbook.rl.data.errors import DatasetError
from rlrunbook.rl.data.jsonl import read_jsonl
from rlrunbook.rl.data.loaders import LOADERS, load_cnn_dailymail, load_gsm8k, load_nq_open
from rlrunbook.rl.data.records import QARecord, SummaryRecord, fingerprint_records
from rlrunbook.rl.data.sources import DATA_DIR_ENV, HUB_SPECS, default_local_path

__all__ = [
    "DATA_DIR_ENV",
    "HUB_SPECS",
    "LOADERS",
    "DatasetError",
    "QARecord",
    "SummaryRecord",
    "arithmetic_problems",
    "default_local_path",
    "fingerprint_records",
    "load_cnn_dailymail",
    "load_gsm8k",
    "load_nq_open",
    "read_jsonl",
]
