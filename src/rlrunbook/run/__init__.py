"""The run directory ("artifact trail") of a training run: its paths, writer, report and rubric.

A run writes ``<log_root>/<YYYYmmdd-HHMMSS>_<mode>_<env>_<name>/`` (``new_run_dir``), only through
``RunWriter``: every JSON file is written atomically with finite numbers only, so a killed run
leaves complete files and status "running". ``check_run`` applies the runbook's rubrics to
such a directory; the e2e tests and a user on a GPU machine run the same checks
(``python -m rlrunbook.run <run_dir>``).

Artifact schema (version 1)
---------------------------

``run_metadata.json``::

    {"schema_version": 1, "status": "running" | "completed" | "failed" | "interrupted",
     "started_at": ISO-8601 UTC, "finished_at": ISO-8601 UTC | null, "error": str | null,
     "config": {... "mode": "single_turn" | "debate", "env": str, "steps": int, "seed": int ...,
                "loss": {...}, "checkpoint": {...}, ...}   # TrainConfig.to_dict(): sections nested,
     "config_sources": {dotted key: "default" | "file:<path>" | "override" | "cli" | "sweep"}, "argv": [str],
     "world_size": int,                                     # processes of a torchrun run, else 1
     "process": {"pid", "host", "boot_id", "start_ticks"},  # who runs it (run.liveness: "stale" runs)
     "heartbeat_at": ISO-8601 UTC,                          # refreshed every 30 s while it runs
     "resumed_from": {"path", "run", "step"},               # only in a resumed run
     "versions": {"python", "torch", "transformers", "peft", "tinker", "rlrunbook", "numpy": str | "missing"},
     "git": {"commit": str, "dirty": bool} | null, "hardware": {...}, "seeds": {dotted key: value},
     "environment": {TINKER_*, RLRUNBOOK_*, CUDA_*, PYTORCH_*, HF_*, TRANSFORMERS_*, OMP_*, MALLOC_*,
                     PYTHON*: value, secret-named ones "<redacted>"},
     "dataset": {"name", "rows", "fingerprint", "source" (file:PATH | hub:NAME | generated:... | embedded:...), "warnings": [str],
                 "cache": {"path", "status": "written" | "loaded",
                 "source_key", "source_fingerprint", "cached_fingerprint"} (with --cache-dataset)},
     "refused_step": {"step": int, "quantity": "loss:sum" | "grad_norm", "value": str | null,
                      "cause": str, "weights_changed": bool}}   # only when a NaN/inf guard stopped the run

``train_log.jsonl``, one row per step (extra keys allowed)::

    {"step": int, "reward/mean", "reward/std", "reward/min", "reward/max",
     "advantage/nonzero_count": int, "advantage/min", "advantage/max", "loss/sum",
     "num_datums": int, "num_trained_tokens": int, "completion_length/mean",
     "time/sample_s", "time/score_s", "time/forward_backward_s", "time/optim_s", "time/step_s",
     "throughput/sampled_tokens_per_s", "throughput/trained_tokens_per_s", "memory/rss_mb",
     "dynamic_sampling/groups_drawn", "dynamic_sampling/groups_kept", "dynamic_sampling/rounds"}

    A step dynamic sampling skipped (no update) logs ``"skipped": true`` and a ``"skip_reason"`` with
    the step, reward and time keys (``schema.SKIPPED_ROW_*``); its ``training_step_<k>.json`` is
    ``{"step", "skipped": true, "skip_reason", "training_data": [], "num_trained_tokens": 0}``.

``training_step_<k>.json``::

    {"step": k, "loss_fn": str,
     "training_data": [{"prompt_tokens": [int], "completion_tokens": [int],
                        "completion_logprobs": [float], "completion_advantages": [float],
                        "completion_mask": [0 | 1],
                        "metadata": {"reward": float, "centered_reward": float | null,
                                     "role": str, "group": int, "problem_id": str}}],
     "results": {"metrics": {"loss:sum": float, ...}}, "num_trained_tokens": int}

The four completion arrays have equal lengths. ``completion_mask`` is 1 on the trained
debater's own tokens and 0 on injected opponent/judge tokens (single-turn: all 1); advantages
are exactly 0 where the mask is 0.

``baseline_<k>.json`` (single-turn qa/math) and ``summary_<k>.json`` (single-turn summary)::

    {"step": k, "env": str,
     "records": [{"problem_id": str, "group": int, "completion_text": str, "completion_tokens": [int],
                  "reward": float, "reward_metrics": {str: float}, "stop_reason": str}]}

``debate_<k>.json``::

    {"step": k, "env": str,
     "debates": [{"debate_id": str, "problem_id": str, "group": int,
                  "rounds": [{"round": 1 | 2 | 3, "a": {"text": str, "tokens": [int]}, "b": {...}}],
                  "verdict": {"winner": "a" | "b", "judge": str, "scores": {"a": float, "b": float}},
                  "task_rewards": {"a": float, "b": float}}]}

``validation.jsonl`` (only with ``validation.every > 0``), one row per validation at the steps of
``schema.validation_schedule`` (``step`` = optimizer steps applied before it)::

    {"step": int, "num_problems": int, "samples_per_problem": int, "threshold": float,
     "confidence": float, "mean_reward": float, "mean_ci": [low, high],
     "pass@1": float, "pass@1_ci": [low, high], "mean@1": float, "pass@<k>": ..., "mean@<k>": ...,
     "seed": int, "problem_ids": [str], "time/validation_s": float}

``report.png``: reward (mean, min-max band), loss, completion length and non-zero advantage
curves per step (and held-out mean reward / pass@k when validation.jsonl has rows).
"""

from rlrunbook.run.checks import CheckResult
from rlrunbook.run.paths import log_root, new_run_dir
from rlrunbook.run.report import plot_report
from rlrunbook.run.rubric import check_run, format_results, rubric_passed
from rlrunbook.run.schema import SCHEMA_VERSION
from rlrunbook.run.writer import RunWriter

__all__ = [
    "SCHEMA_VERSION",
    "CheckResult",
    "RunWriter",
    "check_run",
    "format_results",
    "log_root",
    "new_run_dir",
    "plot_report",
    "rubric_passed",
]
