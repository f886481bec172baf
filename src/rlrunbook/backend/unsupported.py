"""One clear error for an SDK method the local backend does not have.

A recipe that calls a hosted-only method (``publish_checkpoint_from_tinker_path``, ``get_console_url``,
...) should fail naming the method and why, not with a bare
``AttributeError: 'LocalTrainingClient' object has no attribute ...``. :data:`REFUSED` says why for each
method the local backend refuses (an ``*_async`` twin shares its method's reason); docs/tinker-api.md
lists them, and tests/unit/backend/test_sdk_coverage.py keeps the page, this table and the installed SDK in step.
"""

from __future__ import annotations

_HOSTED_ACCOUNT = "it reads the hosted service's account records, which a local backend does not keep"
_CONSOLE = "it links to the hosted Tinker Console, which shows only runs of the hosted service"
_PROJECTS = "projects belong to the hosted service's accounts; the local backend has none"
_PUBLISHING = ("publishing makes a checkpoint readable by other accounts of the hosted service; local "
               "checkpoints are folders that anyone with access to the files reads")

# (client, method) -> why the local backend refuses it.
REFUSED: dict[tuple[str, str], str] = {
    ("ServiceClient", "get_console_url"): _CONSOLE,
    ("ServiceClient", "holder"): "it is the SDK's internal HTTP connection holder (deprecated there); a "
                                 "local ServiceClient runs in process and holds no connection",
    ("TrainingClient", "get_console_url"): _CONSOLE,
    ("RestClient", "publish_checkpoint_from_tinker_path"): _PUBLISHING,
    ("RestClient", "unpublish_checkpoint_from_tinker_path"): _PUBLISHING,
    ("RestClient", "whoami"): "it reads the identity in the hosted service's credential; the local backend "
                              "takes no credential",
    ("RestClient", "get_billing_usage"): _HOSTED_ACCOUNT,
    ("RestClient", "get_audit_log"): _HOSTED_ACCOUNT,
    ("RestClient", "get_current_checkpoint_storage_usage"): _HOSTED_ACCOUNT + " (locally: du -s on "
                                                            "TINKER_LOCAL_STORAGE)",
    ("RestClient", "export_session_trace"): "the trace is recorded by the hosted service; locally set "
                                            "TINKER_LOCAL_TIMELINE for a timeline of the backend's calls",
    ("RestClient", "assign_session_project"): _PROJECTS,
    ("RestClient", "search_sessions"): "it searches the hosted service's session index by owner and "
                                       "project, which the local backend does not have; use list_sessions "
                                       "and get_session",
}


def refusal_reason(owner: str, name: str) -> str | None:
    """Why ``owner.name`` is refused locally (an ``*_async`` twin shares its method's reason), or None."""
    reason = REFUSED.get((owner, name))
    if reason is None and name.endswith("_async"):
        reason = REFUSED.get((owner, name.removesuffix("_async")))
    return reason


def refuse_sdk_attribute(owner: str, sdk_class: type, name: str) -> AttributeError:
    """The ``AttributeError`` to raise from a local client's ``__getattr__`` for ``name``."""
    if not name.startswith("_") and hasattr(sdk_class, name):
        reason = refusal_reason(owner, name) or "it has no local equivalent yet"
        return AttributeError(
            f"{owner}.{name} is part of the Tinker SDK but not of the rlrunbook local backend: {reason}. Run "
            "this code against the hosted service (TINKER_BACKEND=api), or avoid the call when "
            "TINKER_BACKEND=local."
        )
    return AttributeError(f"local {owner} has no attribute {name!r}")
