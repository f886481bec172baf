"""What ``TINKER_BACKEND=api`` needs before the first call: a credential, and a service that answers in time.

The SDK retries a service it cannot reach for minutes (its own budget: 10 tries of up to 60 s per request,
then up to 5 minutes of backed-off retries per call), so a ServiceClient made without network would wait
through that budget before saying anything. :func:`check_reachable` asks once, up front, within a stated
budget (``RLRUNBOOK_API_TIMEOUT_S`` seconds per attempt, ``RLRUNBOOK_API_ATTEMPTS`` attempts, 1 s then 2 s
... between them) and, when the budget is spent, raises :class:`~rlrunbook.errors.ServiceUnreachableError`
naming the address, the budget, the last failure and the fix. Calls after that point run under the SDK's
budget.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rlrunbook.errors import ConfigError, ServiceUnreachableError

TIMEOUT_ENV = "RLRUNBOOK_API_TIMEOUT_S"
ATTEMPTS_ENV = "RLRUNBOOK_API_ATTEMPTS"
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_ATTEMPTS = 3
_MAX_TIMEOUT_S = 600.0
_MAX_ATTEMPTS = 20

MISSING_KEY = ("TINKER_BACKEND=api talks to the hosted Tinker service and needs a key: set TINKER_API_KEY (or "
               "TINKER_CREDENTIAL_CMD, or run `tinker auth login`), or unset TINKER_BACKEND to train on this "
               "machine with the local backend.")


def check_credentials(environ: Mapping[str, str]) -> None:
    """``ConfigError`` unless ``TINKER_API_KEY``, ``TINKER_CREDENTIAL_CMD`` or a key stored by ``tinker auth
    login`` gives a credential. Asked of the SDK's own lookup, so the answer matches what its ServiceClient
    does; without this check its error (``tinker.TinkerError``) came only when the client was made."""
    if environ.get("TINKER_API_KEY") or environ.get("TINKER_CREDENTIAL_CMD"):
        return  # the SDK validates the key itself when the client is made
    try:
        from tinker.lib._auth_token_provider import resolve_auth_provider  # the stored-credential lookup
    except ImportError:
        raise ConfigError(MISSING_KEY) from None
    try:
        resolve_auth_provider(None, enforce_cmd=False)
    except Exception as error:  # noqa: BLE001 - tinker.TinkerError and whatever a stored file may raise
        raise ConfigError(f"{MISSING_KEY} (the SDK says: {error})") from None


@dataclass(frozen=True)
class Budget:
    """How long :func:`check_reachable` may try: ``attempts`` tries of ``timeout_s`` seconds each."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    attempts: int = DEFAULT_ATTEMPTS

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Budget:
        """``RLRUNBOOK_API_TIMEOUT_S`` and ``RLRUNBOOK_API_ATTEMPTS``, checked (``ConfigError`` naming the value)."""
        timeout, attempts = DEFAULT_TIMEOUT_S, DEFAULT_ATTEMPTS
        raw = environ.get(TIMEOUT_ENV, "").strip()
        if raw:
            try:
                timeout = float(raw)
            except ValueError:
                timeout = float("nan")
            if not 0 < timeout <= _MAX_TIMEOUT_S:  # nan fails too
                raise ConfigError(f"{TIMEOUT_ENV}={raw!r} must be a number of seconds in (0, {_MAX_TIMEOUT_S:g}], "
                                  f"e.g. {DEFAULT_TIMEOUT_S:g}.")
        raw = environ.get(ATTEMPTS_ENV, "").strip()
        if raw:
            if not raw.isdigit() or not 1 <= int(raw) <= _MAX_ATTEMPTS:
                raise ConfigError(f"{ATTEMPTS_ENV}={raw!r} must be a whole number from 1 to {_MAX_ATTEMPTS}, "
                                  f"e.g. {DEFAULT_ATTEMPTS}.")
            attempts = int(raw)
        return cls(timeout, attempts)

    def describe(self) -> str:
        pauses = " + ".join(f"{_pause(i):g}" for i in range(self.attempts - 1))
        return (f"{self.attempts} attempt(s) of {self.timeout_s:g} s" + (f", {pauses} s apart" if pauses else "")
                + f" ({TIMEOUT_ENV}, {ATTEMPTS_ENV})")


def _pause(attempt: int) -> float:
    return float(min(2**attempt, 8))


def _http_probe(url: str, timeout_s: float) -> None:
    """One request to ``url``: any HTTP answer (even 404) means the service is reachable; raises otherwise.
    Through httpx (the SDK's own client), so proxies set in the environment are honoured as the SDK does."""
    import httpx

    with httpx.Client(timeout=httpx.Timeout(timeout_s), follow_redirects=False) as client:
        client.head(url)


def _attempt(probe: Callable[[str, float], None], url: str, timeout_s: float) -> BaseException | None:
    """Run ``probe`` within ``timeout_s`` (name resolution included, which no socket timeout bounds); the
    failure, or None when the service answered."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            probe(url, timeout_s)
            outcome.append(None)
        except Exception as error:  # noqa: BLE001 - any failure of the probe is the answer "not reachable"
            outcome.append(error)

    worker = threading.Thread(target=run, name="rlrunbook-api-probe", daemon=True)
    worker.start()
    worker.join(timeout_s + 1.0)
    return outcome[0] if outcome else TimeoutError(f"no answer within {timeout_s:g} s")


def check_reachable(base_url: str, budget: Budget, *, probe: Callable[[str, float], None] = _http_probe,
                    sleep: Callable[[float], None] = time.sleep) -> None:
    """``ServiceUnreachableError`` unless the service at ``base_url`` answers within ``budget``."""
    failure: BaseException | None = None
    for attempt in range(budget.attempts):
        if attempt:
            sleep(_pause(attempt - 1))
        failure = _attempt(probe, base_url, budget.timeout_s)
        if failure is None:
            return
    raise ServiceUnreachableError(
        f"the Tinker service at {base_url} did not answer: {budget.describe()} all failed, the last with "
        f"{type(failure).__name__}: {failure}. Check the network and TINKER_BASE_URL, raise {TIMEOUT_ENV} for a "
        "slow link, or unset TINKER_BACKEND to train on this machine with the local backend.")


def check_api_access(environ: Mapping[str, str]) -> None:
    """Everything ``TINKER_BACKEND=api`` needs before the first call: a credential, then a service that answers."""
    from tinker.lib.base_url import resolve_base_url

    check_credentials(environ)
    budget = Budget.from_env(environ)
    check_reachable(resolve_base_url(environ.get("TINKER_BASE_URL") or None), budget)
