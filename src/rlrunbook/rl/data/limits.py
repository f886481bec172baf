"""The limits of data files and generated data sets, in one place.

A data file is read one line at a time and each limit is checked before the line is parsed, so a hostile
file costs at most one line's memory and time: a 2 GB line (``MemoryError`` if the whole file were read
at once), a JSON array nested 100,000 deep (``RecursionError``), a 5,001-digit integer (Python refuses to
convert more than 4,300 digits). Each is refused with the file, the line and the limit. The limits lie far
beyond any real row: GSM8K's rows are under 2 KB, CNN/DailyMail's longest article about 100 KB, and every
row of the tasks' schemas nests two levels (an object holding a list of strings).
"""

from __future__ import annotations

MAX_LINE_BYTES = 8 * 1024 * 1024  # one JSONL row: 80x CNN/DailyMail's longest article
MAX_JSON_DEPTH = 64  # nested arrays and objects in one row; the schemas use two
MAX_INT_DIGITS = 19  # digits of an integer in a row: 64 bits hold 19; ids and counts need fewer
MAX_GENERATED_ROWS = 1_000_000  # problems of a generated set (extra.test_size, extra.synthetic_size)
