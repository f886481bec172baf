"""The Tinker API, served locally (transformers + peft) or by the hosted service.

``create_service_client()`` picks the backend from ``TINKER_BACKEND`` (``local`` | ``api``).
The local backend lives under this package's own name, so ``import tinker`` always means the
real SDK (whose ``tinker.types`` the local backend uses for every request and response).
"""

from __future__ import annotations

import os

from rlrunbook.backend.rest_client import LocalRestClient
from rlrunbook.backend.sampling_client import LocalSamplingClient
from rlrunbook.backend.service_client import LocalServiceClient, SdkLocalServiceClient
from rlrunbook.backend.settings import LocalSettings
from rlrunbook.backend.training_client import LocalTrainingClient
from rlrunbook.errors import ConfigError

BACKENDS = ("local", "api")


def backend_name(env: dict[str, str] | None = None) -> str:
    """``TINKER_BACKEND`` if set; else ``local`` (also when the older ``TINKER_LOCAL_BACKEND`` is set)."""
    env = os.environ if env is None else env
    name = env.get("TINKER_BACKEND", "").strip().lower() or "local"
    if name not in BACKENDS:
        raise ConfigError(f"TINKER_BACKEND={name!r} must be one of {BACKENDS}.")
    return name


def create_service_client(**kwargs: object):
    """A ServiceClient of the selected backend: ``LocalServiceClient`` or ``tinker.ServiceClient``.

    For ``api`` the credential and the service's answer are checked first, within a stated budget
    (:mod:`rlrunbook.backend.api_access`): without network the SDK would retry for minutes before saying so.
    """
    if backend_name() == "local":
        return LocalServiceClient(**kwargs)
    import tinker

    from rlrunbook.backend.api_access import check_api_access

    check_api_access(os.environ)
    return tinker.ServiceClient(**kwargs)


__all__ = ["BACKENDS", "LocalRestClient", "LocalSamplingClient", "LocalServiceClient", "LocalSettings",
           "LocalTrainingClient", "SdkLocalServiceClient", "backend_name", "create_service_client"]
