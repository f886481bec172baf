"""The options a task or a paradigm reads, declared, so that ``extra.*`` keys are checked before any work.

A task reads its options from ``self.options`` (``extra.test_size``, ``extra.format_bonus``, ...). Each
task and paradigm declares what it reads in ``declared_options``, a mapping of names to :class:`TaskOption`;
:func:`check_extra` then refuses, before any model loads, an ``extra`` key that nothing declares (naming the
nearest declared one: ``extra.test_sise`` → ``test_size``), a key that a config field sets
(``extra.summary_max_words``: use ``--summary-max-words``), a value of the wrong type (``extra.test_size=abc``)
or outside its bounds, and an option that the run's data set or reward does not read
(``extra.format_bonus`` with ``--reward-fn text``).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlrunbook.errors import ConfigError


def _key(name: Any) -> str:
    """``extra.<name>`` as a message shows it: a name with a newline or other control character by its repr."""
    return f"extra.{name}" if isinstance(name, str) and name.isprintable() else f"extra.{name!r}"


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


@dataclass(frozen=True)
class TaskOption:
    """One option a task reads: its type, default, bounds, and the data sets and rewards that read it.

    ``field``: the config field that sets it (``summary_max_words``, ``reward.verify_weight``); such an
    option is not an ``extra`` key. ``datasets`` / ``reward_fns``: it is read only with these (empty: always).
    ``low``/``high`` are inclusive unless ``low_open``/``high_open``.
    """

    kind: type
    default: Any
    description: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    field: str | None = None
    datasets: tuple[str, ...] = ()
    reward_fns: tuple[str, ...] = ()

    def applies(self, dataset: str, reward_fn: str) -> bool:
        """Whether a run on ``dataset`` with ``reward_fn`` reads this option."""
        return ((not self.datasets or dataset in self.datasets)
                and (not self.reward_fns or reward_fn in self.reward_fns))

    def needs(self) -> str:
        """The runs that read it, in words: ``--dataset test``, ``--reward-fn numeric``."""
        parts = [f"--dataset {' or '.join(self.datasets)}"] if self.datasets else []
        parts += [f"--reward-fn {' or '.join(self.reward_fns)}"] if self.reward_fns else []
        return " with ".join(parts) or "every run"

    def bounds(self) -> str:
        """The allowed range in words: ``from 1 to 1,000,000``, ``above 0 and at most 60``."""
        def number(value: float) -> str:
            return f"{value:,}" if isinstance(value, int) else f"{value:g}"
        low = None if self.low is None else f"{'above' if self.low_open else 'at least'} {number(self.low)}"
        high = None if self.high is None else f"{'below' if self.high_open else 'at most'} {number(self.high)}"
        return " and ".join(part for part in (low, high) if part) or "any value"

    def check(self, name: str, value: Any) -> None:
        """``ConfigError`` naming ``extra.<name>`` if ``value`` has the wrong type or lies outside the bounds."""
        what = f"{self.description} (default {self.default!r}; {self.bounds()})"
        wanted = _KIND_NAMES.get(self.kind, self.kind.__name__)
        ok = isinstance(value, self.kind) and not (isinstance(value, bool) and self.kind is not bool)
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise ConfigError(f"extra.{name}={shown} is {_KIND_NAMES.get(type(value), type(value).__name__)}, "
                              f"but it must be {wanted}: the {what}. Pass e.g. extra.{name}={self.default!r}.")
        if self.kind in (int, float):
            number = float(value)
            too_low = self.low is not None and (number <= self.low if self.low_open else number < self.low)
            too_high = self.high is not None and (number >= self.high if self.high_open else number > self.high)
            if not math.isfinite(number) or too_low or too_high:
                raise ConfigError(f"extra.{name}={value!r} is out of range: the {what}. Pass a value "
                                  f"{self.bounds()}.")


def check_extra(extra: Mapping[str, Any], declared: Mapping[str, TaskOption], owner: str, *,
                dataset: str, reward_fn: str) -> None:
    """``ConfigError`` for the first ``extra`` key that ``declared`` (the options of ``owner``, e.g.
    ``--env qa with --mode single_turn``) does not read in a run on ``dataset`` with ``reward_fn``."""
    extras = {name: option for name, option in declared.items() if option.field is None}
    for name, value in extra.items():
        option = declared.get(name)
        if option is None:
            close = difflib.get_close_matches(name, list(extras), n=1)
            hint = f"Did you mean extra.{close[0]}? " if close else ""
            known = ", ".join(f"extra.{n}" for n in extras) or "none"
            raise ConfigError(f"{_key(name)} is not an option of {owner}, so it would have no effect. {hint}"
                              f"The options it reads: {known}.")
        if option.field is not None:
            raise ConfigError(f"extra.{name} is set by the config field {option.field} "
                              f"(`{option.field}=...`), not by extra. Set it there.")
        if not option.applies(dataset, reward_fn):
            raise ConfigError(f"extra.{name} has no effect in this run: {owner} reads it only with "
                              f"{option.needs()}, and this run has --dataset {dataset} with --reward-fn "
                              f"{reward_fn}. Drop it, or change the data set or reward.")
        option.check(name, value)
