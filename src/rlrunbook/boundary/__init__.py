"""Where a command process meets its user: how it stops on a signal (:mod:`~rlrunbook.boundary.signals`) and
how its errors are told (:mod:`~rlrunbook.boundary.reporting`: a refusal in one paragraph, exit 2, or a bug
report, exit 70). Shared by the ``rlrunbook`` command and ``python -m rlrunbook.cookbook``."""
