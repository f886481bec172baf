"""Names and required fields of the run-directory artifacts, shared by the writer and the rubric.

The full contract, with every field, is in the ``rlrunbook.run`` package docstring.
"""

from __future__ import annotations

from collections.abc import Iterator

SCHEMA_VERSION = 1
METADATA_FILE = "run_metadata.json"
TRAIN_LOG_FILE = "train_log.jsonl"
VALIDATION_FILE = "validation.jsonl"
REPORT_FILE = "report.png"
ROLLOUT_KINDS = ("baseline", "summary", "debate")
# "interrupted": stopped by Ctrl-C (SIGINT) or SIGTERM, cleanly; resumable from its last checkpoint.
FINAL_STATUSES = ("completed", "failed", "interrupted")

# train_log.jsonl: every row carries these (extra keys allowed).
TRAIN_LOG_INT_KEYS = ("step", "advantage/nonzero_count", "num_datums", "num_trained_tokens")
TRAIN_LOG_FLOAT_KEYS = (
    "reward/mean",
    "reward/std",
    "reward/min",
    "reward/max",
    "advantage/min",
    "advantage/max",
    "loss/sum",
    "completion_length/mean",
    "time/sample_s",
    "time/score_s",
    "time/forward_backward_s",
    "time/optim_s",
    "time/step_s",
    "throughput/sampled_tokens_per_s",
    "throughput/trained_tokens_per_s",
    "memory/rss_mb",
)

# A step skipped by dynamic sampling (no group with reward spread: no update) logs a row marked
# ``"skipped": true`` with a ``skip_reason`` and these keys; its training_step_<k>.json says the same.
SKIPPED_ROW_INT_KEYS = ("step", "num_datums", "num_trained_tokens")
SKIPPED_ROW_FLOAT_KEYS = ("reward/mean", "reward/std", "reward/min", "reward/max", "time/step_s")

# training_step_<k>.json: per-datum arrays that must all have the completion's length.
COMPLETION_ARRAYS = ("completion_tokens", "completion_logprobs", "completion_advantages", "completion_mask")
LOSS_METRIC = "loss:sum"
# |loss:sum| above this in at least one step: below it the update is a no-op in float32.
LOSS_EPSILON = 1e-9

DEBATE_ROUNDS = (1, 2, 3)
DEBATE_SIDES = ("a", "b")

# A PNG starts with this signature and an IHDR chunk and ends with the IEND chunk (length 0,
# type, CRC); checking both ends catches a file cut short, which the signature alone would not.
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"


def rollout_kind(mode: str, env: str) -> str:
    """Which rollout file a run writes each step: ``debate`` for debate runs, else by env.

    Single-turn summary runs log ``summary_<k>.json``; every other single-turn env (qa, math)
    logs ``baseline_<k>.json``, as in the seed repository.
    """
    if mode == "debate":
        return "debate"
    return "summary" if env == "summary" else "baseline"


# validation.jsonl: every row carries these (plus "pass@<k>" and "pass@<k>_ci" for k in ``VALIDATION_KS``).
VALIDATION_INT_KEYS = ("step", "num_problems", "samples_per_problem")
VALIDATION_FLOAT_KEYS = ("mean_reward", "threshold")


def validation_ks(samples: int) -> tuple[int, ...]:
    """The k values a validation reports: 1 and the number of samples per problem."""
    return tuple(sorted({1, samples}))


def validation_schedule(steps: int, every: int) -> list[int]:
    """The ``step`` of each validation row of a run of ``steps`` optimizer steps validating ``every`` N.

    A row's ``step`` counts the optimizer steps applied before it: 0 (the initial weights), every
    multiple of ``every``, and ``steps`` (the final weights) once. ``every=0`` means no validation.
    Example: ``steps=3, every=2`` gives ``[0, 2, 3]``; ``steps=4, every=2`` gives ``[0, 2, 4]``.
    """
    return list(iter_validation_schedule(steps, every))


def iter_validation_schedule(steps: int, every: int) -> Iterator[int]:
    """The steps of :func:`validation_schedule`, one at a time: a reader can stop early, whatever ``steps``."""
    if every <= 0:
        return
    if steps <= 0:  # no step runs: the initial weights, and ``steps`` when it is negative (sorted)
        yield from sorted({0, steps})
        return
    yield from range(0, steps + 1, every)
    if steps % every:
        yield steps


def validation_schedule_length(steps: int, every: int) -> int:
    """``len(validation_schedule(steps, every))``, computed without building it."""
    if every <= 0:
        return 0
    if steps <= 0:
        return len({0, steps})
    return steps // every + 1 + (1 if steps % every else 0)
