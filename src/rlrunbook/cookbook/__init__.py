"""Run tinker-cookbook recipes, unmodified, on the local backend.

``python -m rlrunbook.cookbook [options] <recipe module> [recipe args]`` runs the recipe module as
``__main__`` (``runpy``) in a process where, and only where, these bindings hold:

- ``tinker.ServiceClient`` and ``tinker.RestClient`` are the local backend's clients when
  ``TINKER_BACKEND=local`` (the default). ``import tinker`` is still the real SDK: its types,
  futures and every other name are untouched, and nothing is bound in any other process. With
  ``TINKER_BACKEND=api`` nothing is bound and the recipe talks to the hosted service as usual.
- The built-in model names (``tiny``, ``smollm2-135m``) resolve in the cookbook's tokenizer
  registry (``tokenizer_utils.register_tokenizer``, the cookbook's own extension point).
- ``--renderer NAME`` answers the cookbook's model table for models it does not know (the
  built-ins, local folders); models it knows keep their own entry. Recipes with a renderer
  argument (``renderer_name=...``) can take it there instead.
- ``--hf-dataset HUB_NAME=FILE`` serves a hub data set from a local file, for recipes that
  call ``datasets.load_dataset(HUB_NAME, ...)`` where the hub cannot be reached.

Losses the local backend cannot reproduce exactly (``stable_reinforce``, server-side ``custom``)
are refused with the nearest supported loss named; pass ``loss_fn=importance_sampling`` (or
``cispo``/``ppo``/``gspo``) to the recipe.
"""

from __future__ import annotations

from importlib import metadata

from packaging.version import Version

from rlrunbook.errors import ConfigError

# The tinker-cookbook releases this adapter was validated against (tests/unit/cookbook/test_runner.py pins it).
SUPPORTED_MIN = (0, 6)
SUPPORTED_BELOW = (0, 7)
SUPPORTED_RANGE = ">=0.6,<0.7"


def _release(version: str) -> tuple[int, ...]:
    return Version(version).release


def cookbook_version() -> str:
    """The installed tinker-cookbook version; ``ConfigError`` naming the install command if it is absent."""
    try:
        return metadata.version("tinker-cookbook")
    except metadata.PackageNotFoundError:
        raise ConfigError(
            "tinker-cookbook is not installed. Install the validated release with "
            "`RLRUNBOOK_EXTRAS=test,cookbook bash scripts/setup.sh` (or "
            f"`pip install --no-deps 'tinker-cookbook{SUPPORTED_RANGE}'` plus the `cookbook` extra)."
        ) from None


def check_cookbook_version(version: str | None = None) -> str:
    """``version`` (default: the installed one) if it lies in the supported range, else ``ConfigError``."""
    version = cookbook_version() if version is None else version
    if not SUPPORTED_MIN <= _release(version)[:2] < SUPPORTED_BELOW:
        raise ConfigError(
            f"tinker-cookbook {version} is outside the range this adapter was validated against "
            f"({SUPPORTED_RANGE}); install a release in that range (`pip install --no-deps "
            f"'tinker-cookbook{SUPPORTED_RANGE}'`)."
        )
    return version


__all__ = ["SUPPORTED_BELOW", "SUPPORTED_MIN", "SUPPORTED_RANGE", "check_cookbook_version", "cookbook_version"]
