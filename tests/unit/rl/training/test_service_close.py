"""A service the loop made is closed with the run's outcome: the Tinker SDK's ``ServiceClient.close(status)``
takes it as a required argument (the local backend's has a default), so a bare ``close()`` failed on the API
backend with a TypeError after every run."""

from __future__ import annotations

import pytest

from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.training import loop


class _ClosedWith:
    """Wraps a service; its ``close`` takes the status as the SDK's does (required) and records it."""

    def __init__(self, service, record: list[str]):
        self._service, self._record = service, record

    def __getattr__(self, name):
        return getattr(self._service, name)

    def close(self, status, detail=None):
        self._record.append(status)
        return self._service.close(status, detail)


@pytest.mark.parametrize("outcome", ["success", "errored"])
def test_the_loop_closes_its_service_with_the_runs_outcome(tmp_path, monkeypatch, outcome):
    record: list[str] = []
    made = loop.default_service
    monkeypatch.setattr(loop, "default_service", lambda *a, **k: _ClosedWith(made(*a, **k), record))
    config = TrainConfig(model="tiny", env="qa", dataset="test", num_rollouts=4, num_groups=2, steps=1,
                         max_tokens=8, log_root=str(tmp_path), name="close")
    if outcome == "errored":  # the run fails after the service exists: its first step cannot sample
        monkeypatch.setattr(loop, "one_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            loop.run_training(config, log=lambda *_: None)
    else:
        loop.run_training(config, log=lambda *_: None)
    assert record == [outcome]
