"""``python -m rlrunbook.cookbook``: the cookbook runner (:mod:`rlrunbook.cookbook.runner`)."""

import sys

from rlrunbook.cookbook.runner import main

if __name__ == "__main__":
    sys.exit(main())
