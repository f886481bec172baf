"""YAML as config files and command-line values hold it: safe, bounded, and strict about keys.

``yaml.safe_load`` is safe against code execution but not against size: an alias bomb ("billion laughs",
nine levels of nine aliases) expands to 10^9 values and exhausts memory, a sequence nested 100,000 deep
ends in ``RecursionError``, and a 5,001-digit integer in ``ValueError``. :func:`load_yaml` refuses each of
them with the limit named (:mod:`rlrunbook.rl.setup.limits`): the file size, the nesting depth, the number of
aliases and of values after expansion, and the digits of an integer. It also refuses a key given twice in a
mapping (plain YAML keeps the last one silently) and a key that is not a string (``sweep: {1: [a]}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, SequenceNode

from rlrunbook.errors import ConfigError
from rlrunbook.rl.setup.limits import (
    MAX_CONFIG_BYTES,
    MAX_YAML_ALIASES,
    MAX_YAML_DEPTH,
    MAX_YAML_INT_DIGITS,
    MAX_YAML_NODES,
    shown,
)


_KINDS = {int: "a number", float: "a number", bool: "true/false", type(None): "null"}


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the limits of the module docstring, checked while composing."""

    def __init__(self, text: str, name: str):
        super().__init__(text)
        self.name = name
        self._depth = 0
        self._aliases = 0

    def _where(self, mark) -> str:
        return f"{self.name}: line {mark.line + 1}" if mark is not None else self.name

    def compose_node(self, parent, index):
        if self.check_event(AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise ConfigError(f"{self._where(self.peek_event().start_mark)}: more than {MAX_YAML_ALIASES} "
                                  "YAML aliases (*name); a config needs a handful, and many aliases can expand "
                                  "to more values than memory holds. Write the values out.")
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise ConfigError(f"{self._where(self.peek_event().start_mark)}: collections nested more than "
                                  f"{MAX_YAML_DEPTH} deep; a config nests three levels (section, key, list). "
                                  "Flatten the value.")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str):
                kind = _KINDS.get(type(key), f"a {type(key).__name__}")
                raise ConfigError(f"{self.name}: line {line}: the key {shown(key)} is {kind}, but config keys are "
                                  "names. Quote it if it is meant as a name, or fix the key.")
            if key in seen:
                raise ConfigError(f"{self.name}: key {key!r} is given twice (lines {seen[key]} and {line}); "
                                  "YAML would silently keep the second. Keep one of them.")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        digits = sum(c.isalnum() for c in self.construct_scalar(node))
        if digits > MAX_YAML_INT_DIGITS:
            raise ConfigError(f"{self._where(node.start_mark)}: an integer of {digits:,} digits; no setting holds "
                              f"more than {MAX_YAML_INT_DIGITS} (seeds and counts fit in 64 bits, 19 digits). "
                              "Pass a smaller number.")
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _expanded_size(root: Node, name: str) -> int:
    """Values in ``root`` with every alias expanded, counted on the composed graph (each shared node once),
    so the count costs what the file is, not what it expands to. ``ConfigError`` for an alias that refers
    to a collection containing it (``&a [*a]``), whose expansion never ends."""
    sizes: dict[int, int] = {}
    on_path = {id(root)}
    stack = [(root, iter(_children(root)))]
    while stack:
        node, pending = stack[-1]
        child = next(pending, None)
        if child is None:
            stack.pop()
            on_path.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in _children(node))
        elif id(child) in on_path:
            raise ConfigError(f"{name}: line {child.start_mark.line + 1}: a YAML alias refers to a collection that "
                              "contains it, so the value never ends. Write the value out.")
        elif id(child) not in sizes:
            on_path.add(id(child))
            stack.append((child, iter(_children(child))))
    return sizes[id(root)]


def parse_yaml(text: str, name: str) -> Any:
    """The one YAML document of ``text`` (``name``: the file or the option, for messages), within the limits.

    ``ConfigError`` for a limit passed, naming the line where there is one; ``yaml.YAMLError`` for text
    that is not YAML (a command-line value may then be taken as a plain string).
    """
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{name}: {len(text):,} characters; a config is a few kilobytes, and more than "
                          f"{MAX_CONFIG_BYTES:,} is refused. Pass the config file, not a data file.")
    loader = _BoundedLoader(text, name)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, name)
        if size > MAX_YAML_NODES:
            raise ConfigError(f"{name}: its aliases expand to {size:,} values, more than the limit of "
                              f"{MAX_YAML_NODES:,} (an alias bomb, or a data set pasted into a config). "
                              "Write the values out, or put data in a data file.")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_yaml(text: str, name: str) -> Any:
    """:func:`parse_yaml`, with text that is not YAML refused as ``ConfigError`` too."""
    try:
        return parse_yaml(text, name)
    except yaml.YAMLError as error:
        raise ConfigError(f"{name}: not valid YAML ({error}).") from None


def read_config_text(path: Path) -> str:
    """The file as text; ``ConfigError`` naming the problem when it is too large, binary or not UTF-8."""
    with path.open("rb") as file:
        data = file.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES:,} bytes; a config file is a few kilobytes. "
                          "Pass the YAML config file, not a data or model file.")
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError(f"{path}: a config file is YAML text, but this one is binary (a NUL byte at offset "
                          f"{nul}). Pass the YAML file, or a preset name.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}). "
                          "Save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or pass another file.") from None
