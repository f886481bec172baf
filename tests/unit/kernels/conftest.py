"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def on_triton(monkeypatch):
    """ops dispatches CPU tensors to the Triton kernels (interpreted) instead of the C kernels."""
    from rlrunbook.kernels import gpu, ops

    monkeypatch.setattr(ops, "_backend", lambda device: gpu)
