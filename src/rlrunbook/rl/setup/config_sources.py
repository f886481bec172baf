"""Building a :class:`TrainConfig` from layers, recording where every value came from.

Layers, later ones winning: the field defaults, a config file (a path or the name of a preset under
``configs/``), dotted ``key.sub=value`` overrides, explicit CLI flags, then the values of one sweep point. Every leaf field gets a
source (``default``, ``file:<path>``, ``override``, ``sweep`` or ``cli``) that the run records in
``run_metadata.json``. ``strict`` refuses any leaf that fell back to its default ("no silent
defaults"). A ``sweep`` (in the file or from ``--sweep key=a,b``) maps keys to value lists and
expands into one config per combination.
"""

from __future__ import annotations

import difflib
import hmac
import itertools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlrunbook.errors import ConfigError
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.config_checks import validate
from rlrunbook.rl.setup.limits import MAX_SWEEP_POINTS, shown
from rlrunbook.rl.setup.yaml_source import load_yaml, parse_yaml, read_config_text
from rlrunbook.run.redaction import holds_secret, is_secret_path

PRESET_DIR = Path(__file__).resolve().parents[4] / "configs"  # the project's presets (source checkout)
SWEEP_KEY = "sweep"
# Tells apart the sweep points of secret values in run names without deriving anything stable from them.
_NAME_SALT = os.urandom(16)


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated config, the source of each of its leaf fields, and the file it came from."""

    config: TrainConfig
    sources: dict[str, str]
    file: Path | None = None


def leaf_keys(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[str]:
    """Dotted names of every settable field: ``steps``, ``loss.kl_coef``, ... (``extra`` is one leaf)."""
    keys: list[str] = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += leaf_keys(annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def list_presets() -> list[str]:
    """Names of the shipped presets (file stems under ``configs/``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) if PRESET_DIR.is_dir() else []


def resolve_config_file(name: str | Path) -> Path:
    """A config file path, or a preset name (``tiny-cpu-smoke``) resolved under ``configs/``."""
    path = Path(name)
    if path.is_file():
        return path
    if path.is_dir():
        raise ConfigError(f"config file {str(name)!r} is a directory. Pass the YAML file inside it, or a preset "
                          f"name ({', '.join(list_presets()) or 'none found'}).")
    preset = PRESET_DIR / f"{name}.yaml"
    if path.suffix == "" and preset.is_file():
        return preset
    raise ConfigError(f"config file {str(name)!r} does not exist and is not a preset. "
                      f"Presets: {', '.join(list_presets()) or '(none found)'}; or pass a path to a YAML file.")


def load_config_file(name: str | Path) -> tuple[Path, dict[str, Any]]:
    """Parse a YAML config file into a (nested) mapping; the file must be a mapping at top level.

    Refused with the cause and the fix: a binary, non-UTF-8 or oversized file, invalid YAML, a key given
    twice or not a string, and the limits of :mod:`rlrunbook.rl.setup.yaml_source` (aliases, nesting).
    """
    path = resolve_config_file(name)
    data = load_yaml(read_config_text(path), str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of keys to values, not {type(data).__name__}.")
    return path, data


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"loss": {"kl_coef": 0.1}}`` → ``{"loss.kl_coef": 0.1}``; mappings under known sections only."""
    sections = {key.split(".")[0] for key in leaf_keys() if "." in key}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and not prefix and key in sections:
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for dotted, value in flat.items():
        *parents, leaf = dotted.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{dotted}: {'.'.join(parents)} is a value, not a section.")
        node[leaf] = value
    return tree


def parse_value(text: str, name: str = "a command-line value") -> Any:
    """A command-line value as YAML: ``4`` → int, ``1e-4`` → float, ``true`` → bool, ``null`` → None; text that
    is not YAML stays a string. The limits of config files apply (``ConfigError``)."""
    try:
        value = parse_yaml(text, name)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", text.strip()):
        return float(text)  # YAML 1.1 reads 1e-4 as a string
    return value


def parse_override(text: str) -> tuple[str, Any]:
    """``loss.kl_coef=0.05`` → ``("loss.kl_coef", 0.05)``."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form key.sub=value (e.g. loss.kl_coef=0.05 or steps=4).")
    return key.strip(), parse_value(raw, f"override {key.strip()}")


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """``learning_rate=1e-4,3e-4`` or ``learning_rate=[1e-4, 3e-4]`` → the key and its value list."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"sweep {text!r} is not of the form key=v1,v2 (e.g. learning_rate=1e-4,3e-4).")
    value = parse_value(raw, f"sweep {key.strip()}")
    values = value if isinstance(value, list) else [parse_value(part, f"sweep {key.strip()}")
                                                     for part in raw.split(",")]
    if not values:
        raise ConfigError(f"sweep {text!r} lists no values.")
    return key.strip(), values


def _check_keys(flat: Mapping[str, Any], origin: str) -> None:
    known = leaf_keys()
    for key in flat:
        if key in known or key.startswith("extra."):
            continue
        members = [k for k in known if k.startswith(f"{key}.")]
        if members:
            raise ConfigError(f"{key!r} is a section, not a value ({origin}): set its keys, e.g. {members[0]}=..., "
                              f"or in a file a mapping under '{key}:' (keys: {', '.join(members)}).")
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown config key {key!r} ({origin}).{hint} Known keys: `rlrunbook show-config`.")


def _field_description(key: str) -> str | None:
    """The ``description`` of the config field at dotted ``key`` (None for extras and unknown keys)."""
    model: Any = TrainConfig
    info = None
    for part in key.split("."):
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return None
        info = fields[part]
        model = info.annotation
    return info.description if info is not None else None


def _validation_message(error: ValidationError, sources: Mapping[str, str]) -> str:
    lines = []
    for problem in error.errors():
        key = ".".join(str(part) for part in problem["loc"])
        origin = sources.get(key, "default")
        what = _field_description(key)
        lines.append(f"{key}: {problem['msg']} (got {shown(problem.get('input'))}, from {origin})"
                     + (f"; it is the {what}" if what else ""))
    return "invalid config: " + "; ".join(lines) + ". Give a valid value where it came from."


def _overrides(items: Sequence[str]) -> dict[str, Any]:
    """The ``key=value`` overrides as a mapping; a key given twice is refused (the first would vanish unseen)."""
    flat: dict[str, Any] = {}
    for item in items:
        key, value = parse_override(item)
        if key in flat:
            raise ConfigError(f"override {key!r} is given twice ({key}={shown(flat[key])} and {shown(item)}); "
                              "only the last would count. Keep one of them.")
        flat[key] = value
    return flat


def _check_layer(flat: Mapping[str, Any], origin: str) -> None:
    """Each layer's values must be valid on their own: a bad ``temperature=abc`` is refused even when a
    later layer (``--temperature 0.7``) would have replaced it, instead of being dropped unseen."""
    if not flat:
        return
    try:
        TrainConfig.model_validate(unflatten(flat))
    except ValidationError as error:
        raise ConfigError(_validation_message(error, dict.fromkeys(flat, origin))) from None


def build_config(*, file: str | Path | None = None, overrides: Sequence[str] = (),
                 cli: Mapping[str, Any] | None = None, strict: bool = False,
                 sweep_values: Mapping[str, Any] | None = None) -> ResolvedConfig:
    """Merge the layers into one validated config; see the module docstring."""
    layers: list[tuple[str, dict[str, Any]]] = []
    path = None
    if file is not None:
        path, tree = load_config_file(file)
        tree = {k: v for k, v in tree.items() if k != SWEEP_KEY}
        layers.append((f"file:{path}", flatten(tree)))
    layers.append(("override", _overrides(overrides)))
    layers.append(("cli", dict(cli or {})))
    layers.append(("sweep", dict(sweep_values or {})))
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for origin, flat in layers:
        _check_keys(flat, origin)
        _check_layer(flat, origin)
        merged.update(flat)
        sources.update({key: origin for key in flat})
    try:
        config = TrainConfig.model_validate(unflatten(merged))
    except ValidationError as error:
        raise ConfigError(_validation_message(error, sources)) from None
    all_sources = {key: sources.get(key, "default") for key in leaf_keys()}
    all_sources.update({k: v for k, v in sources.items() if k.startswith("extra.")})
    if strict:
        fallen = [key for key, origin in all_sources.items() if origin == "default" and key != "extra"]
        if fallen:
            where = f"the file {path}" if path else "no config file (--config-file)"
            raise ConfigError(
                f"--strict-config: {len(fallen)} field(s) fell back to a default that {where} does not state: "
                f"{', '.join(fallen)}. State each one in the file (null for 'not set'), or drop --strict-config."
            )
    return ResolvedConfig(config, all_sources, path)


def _check_distinct(key: str, values: Sequence[Any], origin: str) -> None:
    """``ConfigError`` if one sweep axis lists a value twice: the two runs would be the same run."""
    seen: dict[Any, int] = {}
    for index, value in enumerate(values):
        try:
            token: Any = value
            hash(token)
        except TypeError:
            token = ("unhashable", repr(value))
        if token in seen:
            raise ConfigError(f"sweep {key!r} ({origin}) lists the value {shown(value)} twice (positions "
                              f"{seen[token] + 1} and {index + 1}): the two runs would be the same run. List each "
                              "value once (for repeated runs, sweep the seed).")
        seen[token] = index


def sweep_grid(file: str | Path | None, sweeps: Iterable[str]) -> list[dict[str, Any]]:
    """Every combination of the sweep values (file's ``sweep:`` then ``--sweep``); ``[{}]`` when none.

    Refused: a key swept twice (in the file and by ``--sweep``, or by two ``--sweep``), a value listed twice
    in one key, and more than ``MAX_SWEEP_POINTS`` combinations.
    """
    axes: dict[str, list[Any]] = {}
    origins: dict[str, str] = {}
    if file is not None:
        path, tree = load_config_file(file)
        section = tree.get(SWEEP_KEY) or {}
        if not isinstance(section, dict) or not all(isinstance(v, list) and v for v in section.values()):
            raise ConfigError(f"{path}: 'sweep' must map keys to non-empty lists, e.g. sweep: {{learning_rate: [1e-4, 3e-4]}}.")
        axes.update(section)
        origins.update(dict.fromkeys(section, f"the sweep: of {path}"))
    for text in sweeps:
        key, values = parse_sweep(text)
        if key in axes:
            raise ConfigError(f"sweep key {key!r} is given twice ({origins[key]} and --sweep {text}); the second "
                              f"list would replace the first unseen. List all of its values once, e.g. "
                              f"--sweep {key}=a,b,c.")
        axes[key] = values
        origins[key] = f"--sweep {text}"
    _check_keys(axes, "sweep")
    points = 1
    for key, values in axes.items():
        _check_distinct(key, values, origins[key])
        points *= len(values)
    if points > MAX_SWEEP_POINTS:
        raise ConfigError(f"the sweep makes {points:,} runs ({' x '.join(str(len(v)) for v in axes.values())}), "
                          f"above the limit of {MAX_SWEEP_POINTS:,}: each point is a whole training run. "
                          "Sweep fewer values.")
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def check_distinct_points(runs: Sequence[ResolvedConfig], points: Sequence[Mapping[str, Any]]) -> None:
    """``ConfigError`` if two sweep points resolve to the same validated config apart from the run name (a
    sweep of names alone, or ``reward_fn=numeric,null`` where null means the task's first): they would train
    the same run twice."""
    seen: dict[str, int] = {}
    for index, resolved in enumerate(runs):
        body = {k: v for k, v in validate(resolved.config).to_dict().items() if k != "name"}
        token = json.dumps(body, sort_keys=True, default=repr)
        if token in seen:
            first = seen[token]
            raise ConfigError(f"sweep points {first + 1} ({shown(dict(points[first]))}) and {index + 1} "
                              f"({shown(dict(points[index]))}) give the same config apart from the run name: the "
                              "same run twice. List each value once (for repeated runs, sweep the seed).")
        seen[token] = index


def _name_value(key: str, value: Any) -> str:
    """``value`` as it appears in a run name; a secret (a secret-named key, or a value holding a credential)
    as ``secret-<tag>``, the tag a keyed hash under a key drawn per process: points stay apart, and a
    directory name says nothing about the value, not even to someone guessing it."""
    if not (is_secret_path(key) or holds_secret(value)):
        return str(value)
    text = repr(value).encode("utf-8", "surrogatepass")
    return f"secret-{hmac.new(_NAME_SALT, text, 'sha256').hexdigest()[:6]}"


def sweep_name(base: str, values: Mapping[str, Any]) -> str:
    """Run name of one sweep point: ``run-learning_rate-0.0003-kl_coef-0.05`` (secret values as
    ``api_key-secret-1f2e3d``, see :func:`_name_value`)."""
    parts = [base] + [f"{key.rsplit('.', 1)[-1]}-{_name_value(key, value)}" for key, value in values.items()]
    return re.sub(r"[^A-Za-z0-9._-]", "_", "-".join(parts))
