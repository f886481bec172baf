"""argparse types shared by the commands: bounded counts, positive tolerances, service URLs."""

from __future__ import annotations

import argparse
import math

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def bounded_int(low: int, high: int, why: str):
    """An argparse type: an integer from ``low`` to ``high`` (a limit of ``rlrunbook.rl.setup.limits``, whose
    reason ``why`` the refusal states), so 10^20 samples are refused at once instead of sampled until killed."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text if len(text) <= 40 else text[:37] + '...'} is outside "
                                             f"{low:,}..{high:,} ({why})")
        return value
    return parse


def limited():
    """The bounded integer types of eval, eval-checkpoints and check-logprobs (imported late: the CLI loads fast)."""
    from rlrunbook.rl.setup import limits

    rows = bounded_int(1, limits.MAX_ROLLOUTS, "rows sampled at once, bounded like train's -n")
    return {"samples": rows, "problems": bounded_int(1, limits.MAX_HELD_OUT, "problems of a data set"),
            "resamples": bounded_int(1, limits.MAX_RESAMPLES, "bootstrap resamples; 2,000 give stable 95% intervals"),
            "seed": bounded_int(0, limits.MAX_SEED, "torch's int64 seeds"),
            "tokens": bounded_int(1, limits.MAX_TOKENS, "beyond any model's context window"),
            "rank": bounded_int(1, limits.MAX_LORA_RANK, "wider than any model's layers")}


def positive_float(text: str) -> float:
    """A finite number > 0 (a tolerance of 0 or less passes nothing; inf or nan checks nothing)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0, e.g. 1e-4")
    return value


def service_url(value: str) -> str:
    """An argparse type: an http(s) URL with a host, as ``TINKER_BASE_URL`` takes it."""
    from urllib.parse import urlparse

    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise argparse.ArgumentTypeError(f"{value!r} is not a service URL: give http://HOST:PORT (the TINKER_BASE_URL "
                                         "that rlrunbook serve prints)")
    return value.rstrip("/")


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

