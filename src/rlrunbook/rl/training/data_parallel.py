"""The loop's side of data parallelism: which groups a rank samples, and the union batch it logs.

Each step's ``num_groups`` question groups are split into contiguous blocks of group indices
(:func:`rlrunbook.distributed.shard`); a rank samples only its block, with the step-global group
index in its seeds, so the union of the ranks' samples is the single-process batch. The ranks
then exchange their rollouts (:func:`union_batch`), so every rank computes the same advantages
over the same union batch and takes the same decisions (no learning signal: every rank raises);
each trains only on the datums of its own groups, and the trainer sums gradients over ranks.
Rank 0 alone writes the run directory; the others get a :class:`NullWriter`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlrunbook import distributed
from rlrunbook.errors import ConfigError
from rlrunbook.metrics import merge_reduced
from rlrunbook.rl.rollout.paradigms import RolloutBatch
from rlrunbook.rl.rollout.rollouts import Rollout


def check_divisible(num_groups: int, world: int) -> None:
    """``ConfigError`` unless ``num_groups`` splits evenly over ``world`` ranks (so shards are equal)."""
    if num_groups % world:
        lower = max(1, num_groups // world) * world
        raise ConfigError(
            f"--num-groups {num_groups} is not divisible by the {world} torchrun processes (WORLD_SIZE): each "
            f"process samples whole groups. Use --num-groups {lower} or {lower + world} (and -n a multiple "
            f"of it), or launch with a --nproc_per_node that divides {num_groups}."
        )


def local_group_ids(num_groups: int) -> list[int]:
    """The step-global indices of the groups this rank samples (all of them for one process)."""
    return distributed.shard(range(num_groups))


def merge_payloads(payloads: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One rollout-file payload from the ranks' payloads: list fields (records, debates) are
    concatenated in rank order, which with contiguous shards is the single-process order; other
    fields (step, env) are the same on every rank and taken from rank 0."""
    merged = dict(payloads[0])
    for key, value in merged.items():
        if isinstance(value, list):
            merged[key] = [item for payload in payloads for item in payload[key]]
    return merged


COUNT_PREFIXES = ("blocklist/", "prompts/")  # batch metrics that are counts: summed over ranks, not averaged


def merge_batches(batches: Sequence[RolloutBatch], own_rank: int = 0) -> RolloutBatch:
    """The union of the ranks' batches (in rank order), as one process would have sampled it.

    Sampled tokens and counts (``blocklist/hits``, ``prompts/truncated``) add up; other batch metrics are
    averaged over ranks, weighted by each rank's rollouts, which is exact for the fractions and per-sample
    means paradigms report (a dynamic-sampling refill may give ranks unequal shares, one none). Timings
    (``time/...``) stay those of ``own_rank``, like every other timing of the step row.
    """
    own = batches[own_rank]
    sizes = [len(b.rollouts) for b in batches]

    def mean(key: str) -> float:
        if len(set(sizes)) == 1:  # equal shares: the plain mean (what one process computes, bit for bit)
            return sum(b.metrics.get(key, 0.0) for b in batches) / len(batches)
        return sum(n * b.metrics.get(key, 0.0) for n, b in zip(sizes, batches, strict=True)) / max(1, sum(sizes))

    keys = dict.fromkeys([*own.metrics, *(key for b in batches for key in b.metrics)])  # a rank with no groups
    metrics = {key: sum(b.metrics.get(key, 0.0) for b in batches) if key.startswith(COUNT_PREFIXES) else mean(key)
               for key in keys}
    metrics.update({key: value for key, value in own.metrics.items() if key.startswith("time/")})
    return RolloutBatch(rollouts=[r for b in batches for r in b.rollouts], kind=batches[0].kind,
                        payload=merge_payloads([b.payload for b in batches]),
                        sampled_tokens=sum(b.sampled_tokens for b in batches), metrics=metrics)


def union_batch(batch: RolloutBatch) -> RolloutBatch:
    """Every rank's rollouts of this step, on every rank (``batch`` itself for one process)."""
    if distributed.world_size() == 1:
        return batch
    return merge_batches(distributed.gather_objects(batch), distributed.rank())


def own_share(chosen: Sequence[tuple[Rollout, float]], group_ids: Sequence[int]) -> list[tuple[Rollout, float]]:
    """The (rollout, advantage) pairs of the union batch that this rank trains: those of its groups."""
    mine = set(group_ids)
    return [(r, a) for r, a in chosen if r.group in mine]


def merge_metrics(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The ranks' forward_backward metrics as one process would report them for the union batch.

    ``:sum`` adds, ``:max``/``:min`` take the extreme; any other reduction is a mean, weighted by
    each rank's ``num_trained_tokens:sum`` (the positions its means were taken over). A rank
    that trained nothing reports ``{}`` and counts for nothing.
    """
    return merge_reduced(parts, [part.get("num_trained_tokens:sum", 0.0) for part in parts])


def union_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """This rank's forward_backward metrics merged with every other rank's (unchanged for one process)."""
    if distributed.world_size() == 1:
        return dict(metrics)
    return merge_metrics(distributed.gather_objects(dict(metrics)))


def shared_run_dir(make: Callable[[], Path]) -> Path:
    """``make()`` (which creates the run directory) on rank 0; its path, broadcast, on every rank.

    Other ranks never create a directory, so a data-parallel run leaves exactly one. If rank 0
    fails to create it, every rank raises (rank 0 its own error), instead of the others waiting.
    """
    if distributed.world_size() == 1:
        return make()
    path, error = None, None
    if distributed.is_main():
        try:
            path = make()
        except Exception as exc:  # noqa: BLE001 - any failure: told to the other ranks, re-raised below
            error = exc
    shared = distributed.broadcast_object(
        str(path) if path is not None else f"error: {type(error).__name__}: {error}" if error else None)
    if error is not None:
        raise error
    if not shared or shared.startswith("error: "):
        raise ConfigError(f"rank 0 could not create the run directory ({shared}); see rank 0's error.")
    return Path(shared)


class NullWriter:
    """The ``RunWriter`` of ranks other than 0: every public writer method, and nothing is written."""

    run_dir = None

    def __getattr__(self, name: str) -> Any:
        from rlrunbook.run.writer import RunWriter

        if name.startswith("_") or not callable(getattr(RunWriter, name, None)):
            raise AttributeError(name)

        def nothing(*args: Any, **kwargs: Any) -> None:
            """Rank 0 writes the run directory."""

        return nothing
