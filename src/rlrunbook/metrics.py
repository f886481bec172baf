"""Merging Tinker-style metrics (``name:reduction``) of several parts into the metrics of their union.

Used where one logical batch is computed in parts: the trainer's gradient-accumulation chunks and the
ranks of a data-parallel step. ``:sum`` adds, ``:max``/``:min`` take the extreme, and any other
reduction (``:mean``) is a mean weighted by the number of positions each part averaged over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def merge_reduced(parts: Sequence[Mapping[str, float]],
                  weights: Sequence[float | Mapping[str, float]]) -> dict[str, float]:
    """The metrics of the union of ``parts``; ``weights[i]`` is part i's position count, for every key
    (a number) or per key (a mapping; keys it lacks count 0). A key a part lacks is not averaged in."""
    def weight(index: int, key: str) -> float:
        w = weights[index]
        return float(w.get(key, 0.0)) if isinstance(w, Mapping) else float(w)

    merged: dict[str, float] = {}
    for key in sorted({k for part in parts for k in part}):
        values = [(part[key], weight(i, key)) for i, part in enumerate(parts) if key in part]
        reduction = key.rsplit(":", 1)[-1]
        if reduction == "sum":
            merged[key] = sum(v for v, _ in values)
        elif reduction == "max":
            merged[key] = max(v for v, _ in values)
        elif reduction == "min":
            merged[key] = min(v for v, _ in values)
        else:
            merged[key] = sum(v * w for v, w in values) / (sum(w for _, w in values) or 1.0)
    return merged
