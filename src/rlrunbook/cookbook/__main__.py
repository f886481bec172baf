"""``python -m rlrunbook.cookbook [--renderer NAME] [--hf-dataset HUB=FILE]... RECIPE [recipe args]``.

Binds the local backend in this process (see :mod:`rlrunbook.cookbook`), then runs the recipe
module as ``__main__`` with ``sys.argv = [RECIPE, *recipe args]``, exactly as
``python -m RECIPE [recipe args]`` would. Exit status: the recipe's; 2 when the runner's own
options are wrong or when the local backend refuses what the recipe asked for (the message
names the reason and the fix).
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from rlrunbook.errors import RlrunbookError


DESCRIPTION = ("Run a tinker-cookbook recipe unmodified on the rlrunbook local backend "
               "(TINKER_BACKEND=local, the default; =api runs it against the hosted service).")


def _dataset_option(text: str) -> tuple[str, Path]:
    name, sep, file = text.partition("=")
    if not sep or not name or not file:
        raise argparse.ArgumentTypeError(f"{text!r} is not HUB_NAME=FILE (e.g. openai/gsm8k=data/gsm8k.jsonl)")
    return name, Path(file).expanduser()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The runner's options, its recipe and the recipe's arguments: shared by ``python -m rlrunbook.cookbook``
    and ``rlrunbook cookbook``, so both take the same command line."""
    parser.add_argument("--renderer", metavar="NAME",
                        help="renderer for models the cookbook's model table does not know (the built-ins: "
                             "qwen3_instruct, i.e. ChatML)")
    parser.add_argument("--hf-dataset", metavar="HUB_NAME=FILE", type=_dataset_option, action="append", default=[],
                        help="serve datasets.load_dataset(HUB_NAME) from a local .jsonl/.json/.parquet/.csv file "
                             "(repeatable)")
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
    from rlrunbook.cookbook.binding import (
        Bindings,
        accept_zero_advantage_batches,
        answer_model_table,
        bind_local_clients,
        register_builtin_tokenizers,
        serve_datasets_locally,
    )

    version = check_cookbook_version()
    bindings = Bindings()
    bindings.lines.append(f"tinker-cookbook {version}")
    if backend_name() == "local":  # before any cookbook module binds the name
        bind_local_clients(bindings)
        accept_zero_advantage_batches(bindings)
    else:
        bindings.lines.append("TINKER_BACKEND=api: the recipe talks to the hosted service")
    register_builtin_tokenizers(bindings)
    answer_model_table(bindings, args.renderer)
    serve_datasets_locally(bindings, dict(args.hf_dataset))
    return bindings


def run(args: argparse.Namespace) -> int:
    """Run the recipe of parsed arguments (``recipe``, ``recipe_args``, ``renderer``, ``hf_dataset``)."""
    try:
        bindings = prepare(args)
        for line in bindings.lines:
            print(f"[rlrunbook.cookbook] {line}", file=sys.stderr, flush=True)
        sys.argv = [args.recipe, *args.recipe_args]
        runpy.run_module(args.recipe, run_name="__main__", alter_sys=True)
    except RlrunbookError as error:
        print(f"rlrunbook.cookbook: error: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
