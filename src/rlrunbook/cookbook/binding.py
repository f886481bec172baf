"""What ``python -m rlrunbook.cookbook`` changes in its own process before the recipe runs.

Each function changes one thing, returns a line saying what it did (the runner prints it), and
has an ``undo`` for tests. None of them is imported by the library: only the runner calls them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlrunbook.errors import ConfigError

logger = logging.getLogger("rlrunbook.cookbook")

# The built-in models speak ChatML (<|im_start|>role ... <|im_end|>): the cookbook's qwen3_instruct renderer.
CHATML_RENDERER = "qwen3_instruct"
# The local backend's switch for a second, sampling worker (rlrunbook.backend.settings).
CONCURRENT_SAMPLING_ENV = "TINKER_LOCAL_CONCURRENT_SAMPLING"


@dataclass
class Bindings:
    """Undo callbacks of the changes made so far, applied in reverse by ``undo()``."""

    lines: list[str] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def add(self, line: str, undo: Callable[[], None]) -> None:
        self.lines.append(line)
        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def bind_local_clients(bindings: Bindings) -> None:
    """``tinker.ServiceClient`` / ``tinker.RestClient`` -> the local backend's, in this process only."""
    import tinker

    from rlrunbook.backend import LocalRestClient, SdkLocalServiceClient

    saved = (tinker.ServiceClient, tinker.RestClient)
    tinker.ServiceClient, tinker.RestClient = SdkLocalServiceClient, LocalRestClient

    def undo() -> None:
        tinker.ServiceClient, tinker.RestClient = saved

    bindings.add("tinker.ServiceClient, tinker.RestClient -> rlrunbook local backend (TINKER_BACKEND=local)", undo)


ZERO_ADVANTAGES_ENV = "TINKER_LOCAL_ZERO_ADVANTAGE_BATCHES"


def accept_zero_advantage_batches(bindings: Bindings) -> None:
    """Train all-zero-advantage batches as the hosted service does, unless the user chose otherwise.

    The cookbook's RL loops send every group, tied ones included, so a batch whose groups all tie
    is normal there; the local backend's default (refuse it) would stop a recipe the service runs.
    """
    _default_env(bindings, ZERO_ADVANTAGES_ENV, "accept", "an all-tied batch is a zero-gradient step, as on the "
                 "hosted service (set it to 'error' to refuse such batches)")


def _default_env(bindings: Bindings, name: str, value: str, why: str) -> None:
    """Set the environment variable ``name`` to ``value`` (saying ``why``) unless the user set it already."""
    import os

    chosen = os.environ.get(name)
    if chosen:
        bindings.add(f"{name}={chosen} (as set)", lambda: None)
        return
    os.environ[name] = value
    bindings.add(f"{name}={value}: {why}", lambda: os.environ.pop(name))


def sample_concurrently_when_off_policy(bindings: Bindings, recipe_args: Sequence[str]) -> None:
    """A recipe run with ``max_steps_off_policy`` > 0 samples while it trains (the cookbook's asynchronous
    loop): let the local backend run sampling on a worker of its own (``TINKER_LOCAL_CONCURRENT_SAMPLING``),
    unless the user chose otherwise. A synchronous recipe keeps one worker (on CPU, splitting the threads
    would only slow its sampling)."""
    values = [arg.split("=", 1)[1] for arg in recipe_args if arg.startswith("max_steps_off_policy=")]
    if not values or not values[-1].strip().isdigit() or int(values[-1]) == 0:
        return
    _default_env(bindings, CONCURRENT_SAMPLING_ENV, "1", f"max_steps_off_policy={values[-1]}, so the backend "
                 "samples on a worker of its own while the trainer trains (set it to 0 for one worker)")


def register_builtin_tokenizers(bindings: Bindings) -> None:
    """Make ``tokenizer_utils.get_tokenizer(name)`` load each built-in model's own tokenizer."""
    from functools import cache

    from tinker_cookbook import tokenizer_utils

    from rlrunbook.models import BUILTIN_MODELS, load_tokenizer, resolve_model

    names = [n for n in BUILTIN_MODELS if not tokenizer_utils.is_tokenizer_registered(n)]
    for name in names:
        tokenizer_utils.register_tokenizer(name, cache(lambda name=name: load_tokenizer(resolve_model(name))))

    def undo() -> None:
        for name in names:
            tokenizer_utils.unregister_tokenizer(name)

    bindings.add(f"tokenizers registered for built-in models: {', '.join(names)}", undo)


def answer_model_table(bindings: Bindings, renderer: str | None) -> None:
    """Let the cookbook's model table answer ``renderer`` for models it does not know.

    The table (``model_info.get_model_attributes``) has no registration hook, so it is wrapped:
    a known model keeps its entry; an unknown one gets ``renderer``, or, without ``--renderer``,
    a ``ConfigError`` saying how to pass one.
    """
    from tinker_cookbook import model_info
    from tinker_cookbook.exceptions import ConfigurationError

    original = model_info.get_model_attributes

    def get_model_attributes(model_name: str) -> model_info.ModelAttributes:
        try:
            return original(model_name)
        except (ConfigurationError, KeyError, ValueError):
            if renderer is None:
                raise ConfigError(
                    f"tinker-cookbook's model table does not know {model_name!r}, so it cannot pick a renderer. "
                    f"Pass one: `rlrunbook cookbook --renderer {CHATML_RENDERER} <recipe> ...` "
                    f"({CHATML_RENDERER} is ChatML, what tiny and smollm2-135m use), or the recipe's own "
                    "renderer_name=... where it has one."
                ) from None
            return model_info.ModelAttributes(organization="local", version_str="", size_str="", is_chat=True,
                                              recommended_renderers=(renderer,))

    model_info.get_model_attributes = get_model_attributes

    def undo() -> None:
        model_info.get_model_attributes = original

    what = f"renderer {renderer!r}" if renderer else "an error naming --renderer"
    bindings.add(f"models unknown to the cookbook's model table get {what}", undo)


_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def serve_datasets_locally(bindings: Bindings, files: Mapping[str, Path]) -> None:
    """``datasets.load_dataset(hub_name, ...)`` -> the local file given for ``hub_name``, as every split.

    Any split the recipe asks for (``split="train"``, or ``dataset["test"]`` of the returned
    DatasetDict) is the whole file, a local file having no splits; a slice in the split expression
    is kept (``split="test[:50]"`` gives the first 50 rows). Other names load as usual.
    """
    if not files:
        return
    import datasets

    for name, file in files.items():
        if not Path(file).is_file():
            raise ConfigError(f"--hf-dataset {name}={file}: no such file.")
        if Path(file).suffix not in _BUILDERS:
            raise ConfigError(f"--hf-dataset {name}={file}: use a {', '.join(_BUILDERS)} file.")
    original = datasets.load_dataset

    class EverySplit(datasets.DatasetDict):
        def __missing__(self, key: str) -> datasets.Dataset:
            return self["train"]

    def load_dataset(path, *args, split=None, **kwargs):
        if path not in files:
            return original(path, *args, split=split, **kwargs)
        file = Path(files[path])
        # A split expression keeps its slice ("test[:50]" -> the file's first 50 rows).
        local_split = "train" if split is None else "train" + str(split)[len(str(split).split("[")[0]):]
        data = original(_BUILDERS[file.suffix], data_files=str(file), split=local_split)
        logger.info("serving %s (split %s) from %s (%d rows)", path, split or "any", file, len(data))
        return data if split is not None else EverySplit({"train": data})

    datasets.load_dataset = load_dataset

    def undo() -> None:
        datasets.load_dataset = original

    listing = ", ".join(f"{name} <- {file}" for name, file in files.items())
    bindings.add(f"hub data sets served from local files: {listing}", undo)
