"""One resident copy of a base model's weights per ServiceClient: every training client and base-model sampler
over it has its own modules, adapter and engine, and base parameters whose data is the very same memory."""

from __future__ import annotations

import torch
from tinker import types

from rlrunbook.backend import model_host as host_module


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
                                       "weights": types.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32")})


DATA = [_datum([1, 2, 3, 4, 5, 6])]


def _base_tensors(client) -> dict[str, torch.Tensor]:
    return {name: p for name, p in client._host.model.named_parameters() if ".lora_" not in name}


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride())


def test_training_clients_share_the_base_weights_and_nothing_else(local_service, monkeypatch):
    loads = []
    real = host_module.load_resident
    monkeypatch.setattr("rlrunbook.backend.service_client.load_resident",
                        lambda *args: loads.append(args[0]) or real(*args))
    first = local_service.create_lora_training_client("tiny", rank=4, seed=0)
    second = local_service.create_lora_training_client("tiny", rank=4, seed=1)
    base_sampler = local_service.create_sampling_client(base_model="tiny")
    assert loads == ["tiny"]  # loaded once
    shared, own = _base_tensors(first), _base_tensors(second)
    assert shared.keys() == own.keys() and len(shared) > 0
    assert all(_same_memory(shared[name], own[name]) for name in shared)  # the same memory, not copies
    assert all(_same_memory(p, shared[n]) for n, p in base_sampler._host.model.named_parameters() if n in shared)
    first_lora = dict(first._host.model.named_parameters())
    second_lora = dict(second._host.model.named_parameters())
    lora_names = [name for name in first_lora if ".lora_" in name]
    assert lora_names and all(first_lora[n].data_ptr() != second_lora[n].data_ptr() for n in lora_names)
    assert first._host.engine is not second._host.engine
    # Training one client moves its adapter only: the other's output and the base weights stay bit for bit.
    before = first.forward(DATA, "cross_entropy").result()
    base_before = {name: tensor.clone() for name, tensor in shared.items()}
    second.forward_backward(DATA, "cross_entropy").result()
    second.optim_step(types.AdamParams(learning_rate=0.1)).result()
    assert second.forward(DATA, "cross_entropy").result().metrics["loss:sum"] != before.metrics["loss:sum"]
    assert first.forward(DATA, "cross_entropy").result().metrics == before.metrics
    assert all(torch.equal(shared[name], base_before[name]) for name in shared)


def test_one_more_client_holds_its_adapter_and_optimizer_only(local_service):
    first = local_service.create_lora_training_client("tiny", rank=4, seed=0)
    resident = local_service.resident_models()
    assert [r["base_model"] for r in resident] == ["tiny"]
    adapter = sum(p.numel() * p.element_size() for n, p in first._host.model.named_parameters() if p.requires_grad)
    assert first.memory_bytes() == {"adapter": adapter, "gradients": 0, "optimizer": 0}
    first.forward_backward(DATA, "cross_entropy").result()
    assert first.memory_bytes()["gradients"] == adapter
    first.optim_step(types.AdamParams(learning_rate=0.1)).result()
    held = first.memory_bytes()
    assert held["gradients"] == 0 and 2 * adapter < held["optimizer"] < 2.1 * adapter
    # The base is held once, however many clients: a second client adds no base bytes.
    local_service.create_lora_training_client("tiny", rank=4, seed=1)
    assert local_service.resident_models() == resident


def test_hosts_name_the_resident_they_share_and_only_that_one(tmp_path):
    """Hosts over one resident give one ``shared_base``; another resident of the same model, or a host with weights
    of its own, gives another (or none): what decides whether samplers may decode as one batch."""
    from rlrunbook.backend.settings import LocalSettings

    settings = LocalSettings(device="cpu", dtype=torch.float32, storage_dir=tmp_path)
    first, second = host_module.load_resident("tiny", settings), host_module.load_resident("tiny", settings)
    a, b = host_module.host_over(first, "tiny", settings), host_module.host_over(first, "tiny", settings)
    other = host_module.host_over(second, "tiny", settings)
    own = host_module.host_over(first, "tiny", settings, own_weights=True)
    assert a.shared_base == b.shared_base is not None
    assert other.shared_base not in (None, a.shared_base)
    assert own.shared_base is None
