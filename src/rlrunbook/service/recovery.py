"""Restart recovery: what an earlier server on the same storage acknowledged, filed again from the store.

Sessions, models and samplers come back as their records say; a session gets a full timeout to send its next
heartbeat, and one that had ended is forgotten a full grace period after the restart (when it ended is not
recorded). A model that was live comes back ``restarted``: its weights died with the earlier server, so its
calls are refused (naming its last saved state) until ``load_state``; its next ``seq_id`` follows the last
one accepted. A sampler's client is made again on its first use (one of weights held in memory only is
refused). A request that was still pending fails, answering that the server restarted.
"""

from __future__ import annotations

import time

from rlrunbook.service.futures import SeqOrder
from rlrunbook.service.holdings import Holdings
from rlrunbook.service.records import DEFAULT_PROJECT, Model, Sampler, Session, order_thread_name
from rlrunbook.service.store import ServeStore

RESTARTED = ("rlrunbook serve restarted while this request was pending; its result is lost. Calls of a "
             "training client made before the restart are gone with the server's memory: restore the last "
             "saved state with training_client.load_state(path) and send the call again.")


def restore(holdings: Holdings, store: ServeStore) -> dict[str, int]:
    """File the store's sessions, models and samplers in ``holdings`` and fail its pending futures; the counts
    of sessions, models and futures failed."""
    pending = store.fail_pending(RESTARTED)
    store.sweep()
    now = time.monotonic()
    for row in store.sessions():
        status = row["status"]
        holdings.sessions[row["session_id"]] = Session(row["session_id"], row["tenant"], row["user_metadata"],
                                                       created=row["created"], status=status,
                                                       ended=None if status == "active" else now,
                                                       display_name=row["display_name"],
                                                       project_id=row["project_id"] or DEFAULT_PROJECT,
                                                       finish_reason=row["finish_reason"])
    for row in store.models():
        status = "restarted" if row["status"] == "live" else row["status"]
        if status != row["status"]:
            store.model_update(row["model_id"], status=status)
        holdings.models[row["model_id"]] = Model(
            row["model_id"], row["session_id"], row["tenant"], row["base_model"], row["lora"],
            SeqOrder(order_thread_name(row["model_id"]), first=row["last_seq"] + 1), status=status,
            last_saved=row["last_saved"], last_seq=row["last_seq"])
    for row in store.samplers():
        holdings.samplers[row["sampler_id"]] = Sampler(row["sampler_id"], row["session_id"], row["tenant"], None,
                                                       row["model_path"], row["base_model"], row["snapshot"])
    return {"sessions": len(holdings.sessions), "models": len(holdings.models), "pending_failed": pending}
