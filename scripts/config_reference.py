"""Rewrite the table of train's config options in docs/cli.md from the config's fields.

    python scripts/config_reference.py          # rewrite docs/cli.md
    python scripts/config_reference.py --check  # exit 1 if docs/cli.md's table is not the current one
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlrunbook.cli.config_options import reference_table

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
BEGIN, END = "<!-- config options: begin -->\n", "<!-- config options: end -->\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if the table is out of date")
    args = parser.parse_args()
    text = PAGE.read_text(encoding="utf-8")
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    current = reference_table()
    if text[start:end] == current:
        print(f"{PAGE.name}: the config options table is current")
        return 0
    if args.check:
        print(f"{PAGE.name}: the config options table is out of date; run python scripts/config_reference.py",
              file=sys.stderr)
        return 1
    PAGE.write_text(text[:start] + current + text[end:], encoding="utf-8")
    print(f"{PAGE.name}: config options table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
