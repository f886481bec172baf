"""Kernel calls made visible to ``torch.profiler`` (``scripts/profile_decode_ops.py`` counts them)."""

from __future__ import annotations

import functools

import torch
from torch.autograd.profiler import record_function


def profiled(function):
    """``function``, seen by ``torch.profiler`` as an event ``rlrunbook::<name>`` while a profiler runs."""
    name = f"rlrunbook::{function.__name__}"

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if not torch.autograd._profiler_enabled():
            return function(*args, **kwargs)
        with record_function(name):
            return function(*args, **kwargs)

    return wrapper
