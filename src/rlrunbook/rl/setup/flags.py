"""The command-line flag of every config key, in one table.

A key's flag is ``--`` and the key with dashes; a section's field joins the two (``backend.device`` is
``--backend-device``). The exceptions are the runbook's established names: the short forms ``-n`` and ``-s``
and the section fields with flags of their own (``--kl-coef``, ``--val-every``, ``--cache-dataset``: ``LONG``).
``rlrunbook train`` derives its options from this table and the config's fields
(:mod:`rlrunbook.cli.config_options`); every message that names a value names it by :func:`named`.
"""

from __future__ import annotations

SHORT = {"num_rollouts": "-n", "steps": "-s"}
LONG = {
    "loss.kl_coef": "--kl-coef",
    "loss.kl_estimator": "--kl-estimator",
    "loss.entropy_coef": "--entropy-coef",
    "loss.grad_clip_norm": "--grad-clip-norm",
    "checkpoint.every": "--checkpoint-every",
    "validation.every": "--val-every",
    "validation.samples": "--val-samples",
    "data.cache": "--cache-dataset",
    "data.max_prompt_tokens": "--max-prompt-tokens",
    "data.truncate_prompts": "--truncate-prompts",
    "reward.blocklist": "--blocklist",
    "reward.reject_blocklisted": "--reject-blocklisted",
}


def long_flag(key: str) -> str:
    """``--max-tokens`` for ``max_tokens``, ``--backend-device`` for ``backend.device``, or the established name."""
    return LONG.get(key) or "--" + key.replace(".", "-").replace("_", "-")


def flags(key: str) -> tuple[str, ...]:
    """Every flag of ``key``, the short form first (``("-n", "--num-rollouts")``)."""
    return (SHORT[key], long_flag(key)) if key in SHORT else (long_flag(key),)


def named(key: str) -> str:
    """How a message names ``key``: its flag, then the key (``-n (num_rollouts)``, ``--kl-coef (loss.kl_coef)``)."""
    return f"{flags(key)[0]} ({key})"
