"""The one error the data loaders raise.

Every message names the file (or hub data set), the 1-based line or row where one applies,
what is wrong, and how to fix it, so a bad data file is found without a debugger.
"""

from __future__ import annotations

from rlrunbook.errors import InputError


class DatasetError(InputError):
    """A data set file or hub name is missing, unreadable or does not match the expected schema."""
