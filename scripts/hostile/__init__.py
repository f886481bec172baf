"""The hostile-input run (scripts/hostile_inputs.py is its entry point): hostile inputs against ``rlrunbook``.

Modules: ``classify`` (outcomes and the pure classifier), ``case`` (the case model, shared command lines and
helpers), ``cases_inputs``, ``cases_files`` and ``cases_runs`` (the case tables, one function per class),
``cases`` (the whole table, in order), ``runner`` (running one case, the prepared run) and ``main`` (the command
line). Importing the package imports none of them.
"""
