#!/usr/bin/env python3
"""Hostile-input run: hundreds of bad, contradictory or malicious inputs against the installed ``rlrunbook``.

Every case runs the command as a user types it, in a fresh temporary folder of its own (HOME, working folder,
``TINKER_LOCAL_STORAGE``, ``RLRUNBOOK_CACHE_DIR``, ``RLRUNBOOK_LOG_ROOT``, an empty ``RLRUNBOOK_DATA_DIR``, the
Hugging Face caches, offline), on the built-in ``tiny`` model, under a time limit, and is classified into one
outcome (the table of outcomes and which pass: scripts/hostile/classify.py).

This script is the entry point only; the harness is the package beside it, scripts/hostile/ (imported as
``hostile``: this folder is ``sys.path[0]`` when the script runs): ``classify`` (the outcomes), ``case`` (the
case model and helpers), ``cases_inputs``, ``cases_files``, ``cases_runs`` and ``cases`` (the case table),
``runner`` (running one case) and ``main`` (the options and the report).

Usage::

    python scripts/hostile_inputs.py                       # against ./.venv/bin/rlrunbook, 2 workers
    python scripts/hostile_inputs.py /path/to/.venv -j 2 --json /tmp/hostile.json
    python scripts/hostile_inputs.py --only signals --only secrets
    python scripts/hostile_inputs.py --list                # the cases, no run

Exit 0 when every case passes, 1 otherwise.
"""

from __future__ import annotations

import sys

from hostile.main import main

if __name__ == "__main__":
    sys.exit(main())
