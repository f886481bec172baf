"""Set-up: a run resolved before any model loads.

It owns the validated configuration (``TrainConfig``) and the layers it is built from (files,
presets, overrides, sweeps), the data set and its cache, the seeded problem order with the
held-out split and the data cursor, the backend service and training device, the checks of the
run's surroundings (log root, backend, credentials, model folders), and checkpoints with the
planning of an exact resume. Every user error surfaces here, before a run directory exists.
"""
