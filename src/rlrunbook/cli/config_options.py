"""The command-line options of a run config, derived from ``TrainConfig``'s fields.

Every leaf field of :class:`~rlrunbook.rl.setup.config.TrainConfig` but ``version`` and ``extra`` is an option:
its flag from :mod:`rlrunbook.rl.setup.flags`, its type, choices and help (the field's description, its default,
its range from the field's bounds and :data:`rlrunbook.rl.setup.limits.LIMITS`) from the field itself, so a field
added to the config is an option with nothing typed twice. Options default to None, so the ``cli`` layer of the
config holds only what was given (:func:`given_values`); a true/false field is ``--flag`` / ``--no-flag``.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

# Fields that are not options, and how they are set instead.
NOT_OPTIONS = {"version": "the schema version of a config file", "extra": "task options: extra.KEY=VALUE"}
_METAVARS = {int: "N", float: "X", str: "TEXT"}


@dataclass(frozen=True)
class ConfigOption:
    """One config field as an option: its dotted ``key``, flags, value ``kind`` (int, float, bool, str, or
    tuple for a repeatable text option), ``choices`` of a Literal field, and help text."""

    key: str
    flags: tuple[str, ...]
    kind: type
    choices: tuple[str, ...] | None
    help: str
    section: str | None

    @property
    def dest(self) -> str:
        return self.key.replace(".", "__")


def _unwrap(annotation: Any) -> Any:
    """The value type of an annotation: ``Optional`` and ``Annotated`` taken off."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            (annotation,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        else:
            return annotation


def _bounds(field: FieldInfo, annotation: Any) -> list[str]:
    """``>= 0``-style bounds of a field (pydantic's ``ge``/``gt``/``le``/``lt``), from its metadata."""
    metadata = list(field.metadata)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if typing.get_origin(arg) is typing.Annotated:
                metadata += typing.get_args(arg)[1:]
    symbols = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return [f"{symbol} {getattr(item, name):g}" for item in metadata for name, symbol in symbols.items()
            if getattr(item, name, None) is not None]


def _help(key: str, field: FieldInfo, annotation: Any) -> str:
    from rlrunbook.rl.setup.limits import LIMITS

    notes = []
    if field.default is not None and not field.is_required() and field.default_factory is None:
        default = field.default
        shown = "true" if default is True else "false" if default is False else "none" if default == () else default
        notes.append(f"default {shown}")
    if key in LIMITS:
        notes.append(LIMITS[key].range())
    else:
        notes += _bounds(field, annotation)
    text = (field.description or "").rstrip(".")
    return (f"{text} ({'; '.join(notes)})" if notes else text).replace("%", "%%")


def _option(key: str, field: FieldInfo, section: str | None) -> ConfigOption:
    from rlrunbook.rl.setup.flags import flags

    value_type = _unwrap(field.annotation)
    choices = None
    if typing.get_origin(value_type) is typing.Literal:
        choices, value_type = tuple(typing.get_args(value_type)), str
    elif typing.get_origin(value_type) is tuple:
        value_type = tuple
    if value_type not in (int, float, bool, str, tuple):
        raise TypeError(f"config field {key} has type {field.annotation!r}, which has no option form: add it to "
                        "NOT_OPTIONS with how it is set instead, or give it a plain type")
    return ConfigOption(key, flags(key), value_type, choices, _help(key, field, field.annotation), section)


def config_options() -> Iterator[ConfigOption]:
    """The options of every leaf field of ``TrainConfig``, sections' fields after the flat ones."""
    from rlrunbook.rl.setup.config import TrainConfig

    sections = []
    for name, field in TrainConfig.model_fields.items():
        if name in NOT_OPTIONS:
            continue
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            sections.append((name, field.annotation))
            continue
        yield _option(name, field, None)
    for name, model in sections:
        for leaf, field in model.model_fields.items():
            yield _option(f"{name}.{leaf}", field, name)


def _add(parser, option: ConfigOption) -> None:
    common = dict(dest=option.dest, default=None, help=option.help)
    if option.kind is bool:
        parser.add_argument(*option.flags, action=argparse.BooleanOptionalAction, **common)
    elif option.kind is tuple:
        parser.add_argument(*option.flags, action="append", metavar="TEXT", **common)  # repeatable
    elif option.choices is not None:
        parser.add_argument(*option.flags, choices=option.choices, **common)
    else:
        parser.add_argument(*option.flags, type=option.kind, metavar=_METAVARS[option.kind], **common)


def add_config_options(parser: argparse.ArgumentParser, keys: Sequence[str] | None = None) -> None:
    """Add the options of ``keys`` (default: every field) to ``parser``; the flat fields in one group, each
    section's in a group of its own headed by the section's description."""
    from rlrunbook.rl.setup.config import TrainConfig

    chosen = [option for option in config_options() if keys is None or option.key in keys]
    groups: dict[str | None, Any] = {}
    for option in chosen:
        if option.section not in groups:
            if option.section is None:
                groups[None] = parser.add_argument_group("config fields", "each sets the config key of its name "
                                                         "(later layers: sweep values)")
            else:
                model = TrainConfig.model_fields[option.section].annotation
                summary = " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())
                groups[option.section] = parser.add_argument_group(f"{option.section}.*", summary)
        _add(groups[option.section], option)


def given_values(args: argparse.Namespace) -> dict[str, object]:
    """The config keys given as options (dotted names) and their values: the config's ``cli`` layer."""
    given = {}
    for option in config_options():
        value = getattr(args, option.dest, None)
        if value is not None:
            given[option.key] = value
    return given


def _metavar(option: ConfigOption) -> str:
    if option.kind is bool:
        return ""
    return " {" + ",".join(option.choices) + "}" if option.choices else " " + _METAVARS.get(option.kind, "TEXT")


def reference_table() -> str:
    """The Markdown table of every config option (docs/cli.md holds it; ``scripts/config_reference.py``
    rewrites it there), one row per field: its flags, dotted key and help."""
    rows = ["| option | config key | meaning (default; range) |", "|---|---|---|"]
    for option in config_options():
        negated = [f"--no-{flag[2:]}" for flag in option.flags if option.kind is bool and flag.startswith("--")]
        flags = ", ".join(f"`{flag}{_metavar(option)}`" for flag in (*option.flags, *negated))
        rows.append(f"| {flags} | `{option.key}` | {option.help.replace('%%', '%').replace('|', '/')} |")
    return "\n".join(rows) + "\n"
