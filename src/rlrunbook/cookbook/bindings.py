"""What ``python -m rlrunbook.cookbook`` changes in its own process before the recipe runs.

Each function changes one thing, returns a line saying what it did (the runner prints it), and
has an ``undo`` for tests. None of them is imported by the library: only the runner calls them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
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
    is kept (``split="test[:50]"`` gives the first 50 rows). ``streaming=True`` is honoured: the recipe
    gets what ``datasets`` gives for a streamed local file, an ``IterableDataset`` (or a dict of them),
    and a slice ``[:N]``/``[M:N]`` becomes ``skip``/``take``. Other names load as usual.
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

    class EveryStreamedSplit(datasets.IterableDatasetDict):
        def __missing__(self, key: str) -> datasets.IterableDataset:
            return self["train"]

    def load_dataset(path, *args, split=None, streaming=False, **kwargs):
        if path not in files:
            return original(path, *args, split=split, streaming=streaming, **kwargs)
        file = Path(files[path])
        # A split expression keeps its slice ("test[:50]" -> the file's first 50 rows).
        selection = "" if split is None else str(split)[len(str(split).split("[")[0]):]
        if streaming:
            data = _sliced_stream(original(_BUILDERS[file.suffix], data_files=str(file), split="train",
                                           streaming=True), selection, path)
            logger.info("streaming %s (split %s) from %s", path, split or "any", file)
            return data if split is not None else EveryStreamedSplit({"train": data})
        data = original(_BUILDERS[file.suffix], data_files=str(file), split="train" + selection)
        logger.info("serving %s (split %s) from %s (%d rows)", path, split or "any", file, len(data))
        return data if split is not None else EverySplit({"train": data})

    datasets.load_dataset = load_dataset

    def undo() -> None:
        datasets.load_dataset = original

    listing = ", ".join(f"{name} <- {file}" for name, file in files.items())
    bindings.add(f"hub data sets served from local files: {listing}", undo)


def _sliced_stream(stream, selection: str, name: str):
    """``stream`` limited by a split's row slice (``"[:50]"``, ``"[10:20]"``, ``""``): ``skip`` then ``take``."""
    import re

    if not selection:
        return stream
    match = re.fullmatch(r"\[(\d*):(\d*)\]", selection)
    if match is None:
        raise ConfigError(f"--hf-dataset {name}: the split slice {selection!r} cannot be streamed; a streamed data "
                          "set takes row ranges only ([:N] or [M:N]).")
    start, stop = (int(group) if group else None for group in match.groups())
    if start:
        stream = stream.skip(start)
    if stop is not None:
        stream = stream.take(stop - (start or 0))
    return stream


def check_stand_in_tokenizer(name: str, model: str, tokenizer) -> None:
    """``ConfigError`` unless the renderer the cookbook recommends for ``name`` works with the stand-in's tokenizer:
    a prompt built and a short reply parsed, as a recipe does (a Qwen3.5 renderer needs ``</think>`` as one token).
    Names the cookbook's table does not know are not checked (the recipe names a renderer itself)."""
    import traceback

    from tinker_cookbook import model_info
    from tinker_cookbook.renderers import get_renderer

    try:
        renderer_name = model_info.get_recommended_renderer_name(name)
    except Exception:  # noqa: BLE001 - not in the table: nothing to check against
        return
    try:
        renderer = get_renderer(renderer_name, tokenizer)
        renderer.build_generation_prompt([{"role": "user", "content": "Is it an animal?"}])
        renderer.parse_response(list(tokenizer.encode("yes", add_special_tokens=False)))
    except Exception as error:  # noqa: BLE001 - any failure of the renderer on this tokenizer is the finding
        frame = traceback.extract_tb(error.__traceback__)[-1]
        check = f"{Path(frame.filename).name}:{frame.lineno}: {frame.line}" if frame.line else str(error)
        raise ConfigError(
            f"--hf-model {name}={model}: the cookbook renders {name} with {renderer_name!r}, which fails on the "
            f"stand-in's tokenizer ({type(error).__name__} at {check}). Stand in a model whose tokenizer has what "
            f"that renderer needs: for Qwen3-family names, the built-in tiny-thinking (<think> and </think> as "
            f"single tokens): --hf-model {name}=tiny-thinking."
        ) from None


def stand_in_models(bindings: Bindings, stand_ins: Mapping[str, str]) -> None:
    """Serve each hub model name a recipe hard-codes from a local model: the backend loads the stand-in for it
    (``TINKER_LOCAL_MODEL_STAND_INS``) and the cookbook's ``get_tokenizer(name)`` gives the stand-in's tokenizer.

    The recipe still picks its renderer for the hub name, so the stand-in's tokenizer must hold what that
    renderer needs (e.g. ``<think>`` as one token); a stand-in that does not is named when the recipe fails.
    """
    if not stand_ins:
        return
    import os

    from tinker_cookbook import tokenizer_utils

    from rlrunbook.backend.settings import STAND_INS_ENV, parse_stand_ins
    from rlrunbook.models import load_tokenizer, resolve_model

    folders = {name: resolve_model(model) for name, model in stand_ins.items()}  # fails now, naming the model
    for name, folder in folders.items():
        check_stand_in_tokenizer(name, stand_ins[name], load_tokenizer(folder))
    chosen = os.environ.get(STAND_INS_ENV)
    pairs = dict(parse_stand_ins(chosen or "", STAND_INS_ENV))
    pairs.update(stand_ins)
    os.environ[STAND_INS_ENV] = ",".join(f"{name}={model}" for name, model in pairs.items())
    replaced = {name: tokenizer_utils._CUSTOM_TOKENIZER_REGISTRY.get(name) for name in stand_ins}
    for name, folder in folders.items():
        tokenizer_utils.register_tokenizer(name, cache(lambda folder=folder: load_tokenizer(folder)))

    def undo() -> None:
        if chosen is None:
            os.environ.pop(STAND_INS_ENV, None)
        else:
            os.environ[STAND_INS_ENV] = chosen
        for name, factory in replaced.items():
            tokenizer_utils.unregister_tokenizer(name)
            if factory is not None:
                tokenizer_utils.register_tokenizer(name, factory)

    listing = ", ".join(f"{name} <- {model}" for name, model in stand_ins.items())
    bindings.add(f"hub models served by local ones ({STAND_INS_ENV}): {listing}", undo)
