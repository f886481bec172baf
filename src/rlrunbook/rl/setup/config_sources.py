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


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"{Path(self.name)}: key {key!r} is given twice (lines {seen[key]} and {line}); "
                                  "YAML would silently keep the second. Keep one of them.")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_text(path: Path) -> str:
    """The file as text; ``ConfigError`` naming the problem when it is binary or not UTF-8."""
    data = path.read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError(f"{path}: a config file is YAML text, but this one is binary (a NUL byte at offset "
                          f"{nul}). Pass the YAML file, or a preset name.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}). "
                          "Save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or pass another file.") from None


def load_config_file(name: str | Path) -> tuple[Path, dict[str, Any]]:
    """Parse a YAML config file into a (nested) mapping; the file must be a mapping at top level.

    Refused with the cause and the fix: a binary or non-UTF-8 file, invalid YAML, a key given twice.
    """
    path = resolve_config_file(name)
    text = _read_text(path)
    try:
        loader = _UniqueKeyLoader(text)
        loader.name = str(path)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({error}).") from None
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


def parse_value(text: str) -> Any:
    """A command-line value as YAML: ``4`` → int, ``1e-4`` → float, ``true`` → bool, ``null`` → None."""
    try:
        value = yaml.safe_load(text)
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
    return key.strip(), parse_value(raw)


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """``learning_rate=1e-4,3e-4`` or ``learning_rate=[1e-4, 3e-4]`` → the key and its value list."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"sweep {text!r} is not of the form key=v1,v2 (e.g. learning_rate=1e-4,3e-4).")
    value = parse_value(raw)
    values = value if isinstance(value, list) else [parse_value(part) for part in raw.split(",")]
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
        lines.append(f"{key}: {problem['msg']} (got {problem.get('input')!r}, from {origin})"
                     + (f"; it is the {what}" if what else ""))
    return "invalid config: " + "; ".join(lines) + ". Give a valid value where it came from."


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
    layers.append(("override", dict(parse_override(item) for item in overrides)))
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


def sweep_grid(file: str | Path | None, sweeps: Iterable[str]) -> list[dict[str, Any]]:
    """Every combination of the sweep values (file's ``sweep:`` then ``--sweep``); ``[{}]`` when none."""
    axes: dict[str, list[Any]] = {}
    if file is not None:
        path, tree = load_config_file(file)
        section = tree.get(SWEEP_KEY) or {}
        if not isinstance(section, dict) or not all(isinstance(v, list) and v for v in section.values()):
            raise ConfigError(f"{path}: 'sweep' must map keys to non-empty lists, e.g. sweep: {{learning_rate: [1e-4, 3e-4]}}.")
        axes.update(section)
    axes.update(parse_sweep(text) for text in sweeps)
    _check_keys(axes, "sweep")
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


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
