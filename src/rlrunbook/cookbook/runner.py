"""``python -m rlrunbook.cookbook [--renderer NAME] [--hf-dataset HUB=FILE]... [--hf-model HUB=MODEL]... RECIPE [args]``.

Binds the local backend in this process (see :mod:`rlrunbook.cookbook`), then runs the recipe
module as ``__main__`` with ``sys.argv = [RECIPE, *recipe args]``, exactly as
``python -m RECIPE [recipe args]`` would. Exit status: the recipe's; 2 when the runner's own
options are wrong or when the local backend refuses what the recipe asked for (the message
names the reason and the fix, or when what the recipe needs cannot be had: a recipe module that does not
exist, the hosted service without a key or out of reach, a folder it cannot write); 70 when the local
backend itself fails (a bug: its traceback and where to report it); 128 + N after signal N (Ctrl-C,
SIGTERM, SIGHUP), as ``rlrunbook`` (see :mod:`rlrunbook.boundary.signals`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
import traceback
from pathlib import Path

from rlrunbook.boundary import reporting, signals
from rlrunbook.errors import ConfigError

DESCRIPTION = ("Run a tinker-cookbook recipe unmodified on the rlrunbook local backend "
               "(TINKER_BACKEND=local, the default; =api runs it against the hosted service).")


def _dataset_option(text: str) -> tuple[str, Path]:
    name, sep, file = text.partition("=")
    if not sep or not name or not file:
        raise argparse.ArgumentTypeError(f"{text!r} is not HUB_NAME=FILE (e.g. openai/gsm8k=data/gsm8k.jsonl)")
    return name, Path(file).expanduser()


def _model_option(text: str) -> tuple[str, str]:
    name, sep, model = text.partition("=")
    if not sep or not name or not model:
        raise argparse.ArgumentTypeError(f"{text!r} is not HUB_NAME=MODEL (e.g. Qwen/Qwen3.5-9B=tiny, a built-in "
                                         "model or a model folder)")
    return name, model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The runner's options, its recipe and the recipe's arguments: shared by ``python -m rlrunbook.cookbook``
    and ``rlrunbook cookbook``, so both take the same command line."""
    parser.add_argument("--renderer", metavar="NAME",
                        help="renderer for models the cookbook's model table does not know (the built-ins: "
                             "qwen3_instruct, i.e. ChatML)")
    parser.add_argument("--hf-dataset", metavar="HUB_NAME=FILE", type=_dataset_option, action="append", default=[],
                        help="serve datasets.load_dataset(HUB_NAME) from a local .jsonl/.json/.parquet/.csv file "
                             "(repeatable)")
    parser.add_argument("--hf-model", metavar="HUB_NAME=MODEL", type=_model_option, action="append", default=[],
                        help="serve a hub model the recipe names (for sampling, training and its tokenizer) from a "
                             "built-in model or a local model folder (repeatable)")
    parser.add_argument("recipe", help="the recipe's module, e.g. tinker_cookbook.recipes.math_rl.train")
    parser.add_argument("recipe_args", nargs=argparse.REMAINDER, help="passed to the recipe unchanged")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rlrunbook.cookbook",
        description=DESCRIPTION,
    )
    add_arguments(parser)
    return parser.parse_args(argv)


def prepare(args: argparse.Namespace):
    """Check the cookbook version and make the bindings; returns them (``.lines``, ``.undo()``)."""
    from rlrunbook.backend import backend_name
    from rlrunbook.cookbook import check_cookbook_version
    from rlrunbook.cookbook.bindings import (
        Bindings,
        accept_zero_advantage_batches,
        answer_model_table,
        bind_local_clients,
        register_builtin_tokenizers,
        sample_concurrently_when_off_policy,
        serve_datasets_locally,
        stand_in_models,
    )

    version = check_cookbook_version()
    bindings = Bindings()
    bindings.lines.append(f"tinker-cookbook {version}")
    if backend_name() == "local":  # before any cookbook module binds the name
        bind_local_clients(bindings)
        accept_zero_advantage_batches(bindings)
        sample_concurrently_when_off_policy(bindings, args.recipe_args)
    else:
        from rlrunbook.backend.api_access import check_api_access

        check_api_access(os.environ)  # a key, and a service that answers: before the recipe's first call
        bindings.lines.append("TINKER_BACKEND=api: the recipe talks to the hosted service")
    register_builtin_tokenizers(bindings)
    answer_model_table(bindings, args.renderer)
    serve_datasets_locally(bindings, dict(args.hf_dataset))
    if args.hf_model and backend_name() != "local":
        raise ConfigError("--hf-model stands a local model in for a hub name on the local backend; with "
                          "TINKER_BACKEND=api the hosted service serves the hub model itself. Drop --hf-model.")
    stand_in_models(bindings, dict(args.hf_model))
    return bindings


# Recipe packages the local backend cannot serve, and why: refused before any model loads.
UNSERVED_RECIPES = {
    "tinker_cookbook.recipes.vlm_classifier": "it trains a vision-language model on images (image chunks in "
    "ModelInput), and the local backend serves text-only causal language models",
    "tinker_cookbook.recipes.audio": "it trains a speech model on audio (audio chunks in ModelInput), and the "
    "local backend serves text-only causal language models",
}


def check_recipe(module: str) -> None:
    """``ConfigError`` naming the recipes there are unless ``module`` can be run as ``python -m module``, or naming
    why the local backend cannot serve it (:data:`UNSERVED_RECIPES`)."""
    from rlrunbook.backend import backend_name

    for package, why in UNSERVED_RECIPES.items():
        if (module == package or module.startswith(package + ".")) and backend_name() == "local":
            raise ConfigError(f"recipe {module} cannot run on the local backend: {why}. Run it against the hosted "
                              "service (TINKER_BACKEND=api with TINKER_API_KEY set).")
    why = "no such module"
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:  # a package runs its __main__
            spec, why = importlib.util.find_spec(f"{module}.__main__"), "a package without __main__"
    except (ImportError, ValueError) as error:  # a parent package that does not exist, or an empty name
        spec, why = None, f"{type(error).__name__}: {error}"
    if spec is None:
        raise ConfigError(f"recipe {module!r} cannot be run ({why}). Pass the module of a recipe, e.g. "
                          f"tinker_cookbook.recipes.math_rl.train; the recipes here: {_recipes()}.")


def _recipes() -> str:
    """The runnable recipe modules of the installed cookbook: its ``recipes`` modules (two levels down) that
    have a ``__main__`` block."""
    spec = importlib.util.find_spec("tinker_cookbook")
    if spec is None or not spec.submodule_search_locations:
        return "none (tinker-cookbook is not installed: bash scripts/setup.sh installs it)"
    root = Path(next(iter(spec.submodule_search_locations))) / "recipes"
    found = []
    for path in sorted([*root.glob("*.py"), *root.glob("*/*.py")]):
        try:
            runnable = "__main__" in path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if runnable and path.name != "__init__.py":
            found.append(".".join(("tinker_cookbook", *path.relative_to(root.parent).with_suffix("").parts)))
    return ", ".join(found) or f"none found under {root}"


def _inside_rlrunbook(error: BaseException) -> bool:
    """Whether ``error`` was raised in rlrunbook's own code (the local backend), not in the recipe or a library."""
    package = str(Path(__file__).resolve().parents[1])
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and str(Path(frames[-1].filename).resolve()).startswith(package + os.sep)


def _renderer_names() -> str:
    """The renderer names the installed cookbook documents (``get_renderer``'s docstring lists them)."""
    import inspect
    import re

    from tinker_cookbook import renderers

    names = re.findall(r'``"([A-Za-z0-9_.-]+)"``', inspect.getdoc(renderers.get_renderer) or "")
    names += list(renderers.get_registered_renderer_names())
    return ", ".join(dict.fromkeys(names)) or "see tinker_cookbook.renderers.get_renderer"


def _unknown_renderer(error: BaseException, renderer: str | None) -> bool:
    """Whether ``error`` is the cookbook refusing the renderer that ``--renderer`` named."""
    return (renderer is not None and type(error).__name__ == "RendererError"
            and "unknown renderer" in str(error).lower() and renderer in str(error))


def _recipe_failed(error: BaseException, recipe: str, renderer: str | None = None) -> int:
    """A recipe's exception: described where anticipated (exit 2), a bug report where rlrunbook raised it
    (exit 70), else the recipe's own traceback and exit 1, as ``python -m RECIPE`` gives."""
    interrupt = signals.interrupted_by(error)
    if interrupt is not None:  # a signal's KeyboardInterrupt that a library turned into its own error
        raise interrupt from error
    if _unknown_renderer(error, renderer):  # the runner's own option, not the recipe's failure
        return reporting.refuse(f"--renderer {renderer!r} is not a renderer of the installed tinker-cookbook. "
                                 f"Pass one of: {_renderer_names()}.", "rlrunbook.cookbook: error")
    message = reporting.describe(error)
    if message is not None:
        return reporting.refuse(f"{type(error).__name__}: {message}", "rlrunbook.cookbook: error")
    if _inside_rlrunbook(error):
        return reporting.report_bug(error)
    traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    print(f"rlrunbook.cookbook: the recipe {recipe} stopped with {type(error).__name__} (its traceback above).",
          file=sys.stderr, flush=True)
    return 1


def run(args: argparse.Namespace) -> int:
    """Run the recipe of parsed arguments (``recipe``, ``recipe_args``, ``renderer``, ``hf_dataset``): what the
    runner cannot do is refused (exit 2), the recipe's own failure told apart from rlrunbook's."""
    try:
        bindings = prepare(args)
        for line in bindings.lines:
            print(f"[rlrunbook.cookbook] {line}", file=sys.stderr, flush=True)
        check_recipe(args.recipe)
    except Exception as error:  # noqa: BLE001 - the runner's own boundary (see rlrunbook.boundary.reporting)
        interrupt = signals.interrupted_by(error)
        if interrupt is not None:
            raise interrupt from error
        message = reporting.describe(error)
        if message is None:
            return reporting.report_bug(error)
        return reporting.refuse(f"{type(error).__name__}: {message}", "rlrunbook.cookbook: error")
    sys.argv = [args.recipe, *args.recipe_args]
    try:
        runpy.run_module(args.recipe, run_name="__main__", alter_sys=True)
    except Exception as error:  # noqa: BLE001 - the recipe's failure, told apart from rlrunbook's
        return _recipe_failed(error, args.recipe, args.renderer)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the recipe; the exit status (see the module docstring). Signals stop it as they stop ``rlrunbook``."""
    restore = signals.install()
    try:
        try:
            return run(parse_args(sys.argv[1:] if argv is None else argv))
        except KeyboardInterrupt as interrupt:
            return signals.finish(interrupt)
    except KeyboardInterrupt as again:
        return signals.finish_now(again)
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())
