"""Who may read a run's checkpoints: its tenant.

A run made through this server belongs to the tenant whose key created its model (the store's ``runs``
table, which keeps it after the model's session is forgotten). Another tenant's run answers as an unknown one, by run id and by ``tinker://`` path alike, and is left
out of listings; a run the store does not know (one written into the storage by another process, such as a
training run in process) is the operator's and visible to every tenant. Without keys there is one tenant.
An SDK model id (``<session>:train:<n>``) names its run (the latest, if a restart made it again) wherever a
run id is taken. A copy made through the server (``copy_weights``) is its caller's run; a published
checkpoint is readable by path by every tenant (:mod:`rlrunbook.service.sharing`).
"""

from __future__ import annotations

from collections.abc import Callable

from rlrunbook.backend.storage import parse_tinker_path
from rlrunbook.errors import ModelNotFoundError
from rlrunbook.service.sharing import Sharing
from rlrunbook.service.store import ServeStore


class Ownership:
    """The tenant checks of run ids and checkpoint paths, read from the server's store."""

    def __init__(self, store: ServeStore, sharing: Sharing | None = None):
        self.store = store
        self.sharing = sharing

    def _rows(self) -> list[dict]:
        return self.store.runs()

    def _owners(self) -> dict[str, str]:
        """Run id -> tenant of every run this server made: its models' runs and its copies."""
        owners = {row["run_id"]: row["tenant"] for row in self._rows() if row["run_id"]}
        if self.sharing is not None:
            owners.update(self.sharing.copy_owners())
        return owners

    def owner(self, run_id: str) -> str | None:
        """The tenant whose model (or copy) made run ``run_id``; None for a run this server did not make."""
        return self._owners().get(run_id)

    def run_id(self, run_or_model_id: str, tenant: str) -> str:
        """The storage's run id for ``run_or_model_id``: itself, or the run of this tenant's SDK model id;
        ``ModelNotFoundError`` (404) for a run of another tenant, as for one that does not exist."""
        made = [row for row in self._rows() if row["model_id"] == run_or_model_id and row["tenant"] == tenant]
        if made:
            return made[-1]["run_id"]
        self.check_run(run_or_model_id, tenant)
        return run_or_model_id

    def visible(self, run_id: str, tenant: str) -> bool:
        owner = self.owner(run_id)
        return owner is None or owner == tenant

    def visible_to(self, tenant: str) -> Callable[[str], bool]:
        """:meth:`visible` for many runs: the store is read once, for a listing."""
        owners = self._owners()
        return lambda run_id: owners.get(run_id, tenant) == tenant

    def check_run(self, run_id: str, tenant: str) -> None:
        if not self.visible(run_id, tenant):
            raise ModelNotFoundError(f"no training run {run_id!r} in this storage.")

    def check_path(self, path: str | None, tenant: str) -> None:
        """``ModelNotFoundError`` for a ``tinker://`` path of another tenant's run unless it is published (None
        passes)."""
        if path is None:
            return
        parsed = parse_tinker_path(path)
        if not self.visible(parsed.model_id, tenant) and not (self.sharing and self.sharing.is_published(path)):
            raise ModelNotFoundError(f"no checkpoint at {parsed.path}.")
