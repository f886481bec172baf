import sys

from rlrunbook.cli import main

sys.exit(main())
