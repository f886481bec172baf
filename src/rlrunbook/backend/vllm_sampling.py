"""The vLLM sampler inside the local backend (``TINKER_LOCAL_SAMPLER=vllm``).

One server per base model serves every host of that model in a ServiceClient: the trainer's
model and base-model samplers alike. Training stays in process; a SamplingClient's weights reach
the server as a peft adapter folder written from its snapshot and loaded under a name derived
from the weights (so "sync after each optimizer step" is: the next sampler's snapshot differs,
gets a new name, is written and loaded on its first sample call). The server is checked once
when connected (:func:`rlrunbook.vllm.checks.verify_server`).

A full-parameter trainer's host gets a managed server of its own (an external one is refused: its
weights would be overwritten), started with vLLM's weight-update routes: a sampler of version v
writes every gathered weight (compute dtype) as one safetensors file and the server reloads it in
place before its first sample of v (:class:`rlrunbook.vllm.adapters.FullWeights`). An output layer
tied to the embeddings is written under its own name too: without it, vLLM 0.32's in-place reload
leaves the tied output layer computing with other values than the embeddings it reloaded (logprob
gaps up to 0.3 after two steps of a tied copy of ``tiny-vllm``).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

import rlrunbook
from rlrunbook.backend.model_state import write_adapter
from rlrunbook.backend.model_host import ModelHost, SamplerWeights, active_weights
from rlrunbook.backend.lora import clone_adapter
from rlrunbook.backend import sharding
from rlrunbook.backend.settings import LocalSettings
from rlrunbook.engines.scoring import teacher_forced_logprobs
from rlrunbook.errors import ConfigError
from rlrunbook.vllm.adapters import Adapter, FullWeights
from rlrunbook.vllm.checks import served_base_model, verify_server
from rlrunbook.vllm.client import ExternalServer, VllmClient
from rlrunbook.vllm.engine import VllmSamplingEngine
from rlrunbook.vllm.server import ManagedServer, ServerLaunch

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MAX_DEFAULT_CONTEXT = 4096  # a larger --max-model-len only reserves KV-cache room the sampler never uses


def adapter_rank(host: ModelHost) -> int | None:
    """The LoRA rank of the host's adapter, ``None`` for a plain model."""
    configs = getattr(host.model, "peft_config", None)
    return int(configs["default"].r) if configs else None


def snapshot_adapter(host: ModelHost, weights: SamplerWeights) -> Adapter | None:
    """The adapter a SamplingClient samples from, named by a digest of its weights (``None``: the base model).

    ``write`` saves the snapshot itself (never the live adapter), so it may run while the trainer trains.
    """
    if weights.adapter is None:
        return None
    digest = hashlib.sha256()
    for name in sorted(weights.adapter):
        tensor = weights.adapter[name].detach().to("cpu").contiguous()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return Adapter(
        name=digest.hexdigest()[:24],
        rank=adapter_rank(host) or 1,
        write=lambda folder: write_adapter(host, folder, weights.adapter),
    )


def write_full_weights(model: torch.nn.Module, folder: Path) -> None:
    """Every parameter of ``model`` as it computes now (a sharded model: gathered, in the compute dtype) into
    ``folder/model.safetensors``, under the checkpoint's names; an output layer tied to the embeddings is written
    under its own name as well (see the module docstring)."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    tensors = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            raise TypeError(f"{name} is sharded: gather the weights (sharding.gather) before writing them")
        tensors[name] = param.detach().to("cpu").contiguous()
    unembed = model.get_output_embeddings()
    if unembed is not None and unembed.weight is model.get_input_embeddings().weight:
        name = next(name for name, module in model.named_modules() if module is unembed)
        tensors[f"{name}.weight"] = unembed.weight.detach().to("cpu").clone()  # its own storage: safetensors
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))


def full_weights(host: ModelHost, weights: SamplerWeights) -> FullWeights:
    """A full-parameter trainer's live weights at ``weights.version``, as the vLLM sampler serves them."""
    return FullWeights(version=weights.version, write=lambda folder: write_full_weights(host.model, folder))


def refuse_users_server(url: str) -> str:
    """Why full-parameter training cannot sample through the user's vLLM server at ``url``, and the fix."""
    return (f"full-parameter training with the vLLM sampler replaces the server's weights after every step, so it "
            f"starts a server of its own: unset TINKER_LOCAL_VLLM_URL ({url}), or sample with "
            "TINKER_LOCAL_SAMPLER=hf.")


def _checkout() -> Path | None:
    """The source checkout this package runs from (where scripts/setup-vllm.sh puts .venv-vllm), if any."""
    root = Path(rlrunbook.__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def _base_scorer(host: ModelHost) -> Callable:
    def score(sequences, filters):
        with active_weights(host, SamplerWeights.base(), None):
            return teacher_forced_logprobs(host.model, sequences, host.pad_token_id, filters=filters)

    return score


def open_engine(
    host: ModelHost, settings: LocalSettings, scratch: Path, log: Callable[[str], None] = print, *,
    weight_updates: bool = False,
) -> VllmSamplingEngine:
    """Start (managed) or reach (external) a server for ``host``'s base model, check it, and wrap it in an engine.
    ``weight_updates``: a managed server whose weights the engine replaces (a full-parameter trainer's)."""
    vllm = settings.vllm
    dtype = settings.resolved_dtype()
    if vllm.url and weight_updates:
        raise ConfigError(refuse_users_server(vllm.url))
    if vllm.url:
        server = ExternalServer(
            VllmClient(vllm.url), served_base_model(VllmClient(vllm.url), vllm.served_model).id
        )
        max_context = None
    else:
        max_context = vllm.max_model_len or min(
            host.engine.max_context or _MAX_DEFAULT_CONTEXT, _MAX_DEFAULT_CONTEXT
        )
        launch = ServerLaunch(
            command=vllm.server_command(_checkout()),
            model_folder=host.folder,
            dtype=_DTYPE_NAMES[dtype],
            device=settings.device,
            max_model_len=max_context,
            max_loras=vllm.max_loras,
            kv_cache_gb=vllm.kv_cache_gb,
            gpu_memory_utilization=vllm.gpu_memory_utilization,
            extra_args=vllm.extra_args,
            scratch=scratch / "server",
            weight_updates=weight_updates,
        )
        server = ManagedServer(
            launch,
            max_lora_rank=vllm.max_lora_rank or adapter_rank(host) or 16,
            startup_timeout_s=vllm.startup_timeout_s,
            restart_every=vllm.restart_every,
            max_memory_mb=vllm.max_memory_mb,
            log=log,
        )
        server.start()
    try:
        served = served_base_model(server.client, server.served_model)
        limits = [n for n in (max_context, served.max_model_len, host.engine.max_context) if n]
        base_model = host.model.get_base_model() if hasattr(host.model, "get_base_model") else host.model
        unembed = base_model.get_output_embeddings()  # a peft wrapper keeps in_ and out_features
        engine = VllmSamplingEngine(
            server,
            vocab_size=host.engine.vocab_size,
            max_context=min(limits, default=None),
            unembed_shape=(unembed.out_features, unembed.in_features),
            adapter_dir=vllm.adapter_dir or scratch / "adapters",
            decode_batch=host.engine.decode_batch,
            max_loaded=vllm.max_loras,
            seed=settings.seed,
            model=host.model,
            pad_token_id=host.pad_token_id,
        )
        tolerance = (
            1e-3 if dtype == torch.float32 else 1e-1
        )  # a sanity gate; parity itself is checked at 1e-4
        gap = verify_server(
            server.client,
            served,
            host.folder,
            host.engine.vocab_size,
            _base_scorer(host),
            tolerance,
            probe_model=engine.probe_name(),
        )
        log(f"[vllm] sampling with {server.client.base_url} ({served.id}; probe logprob gap {gap:.1e})")
        return engine
    except BaseException:
        if isinstance(server, ManagedServer):
            server.stop()
        raise


class VllmSamplers:
    """The vLLM engines of one ServiceClient, one per base model folder; ``close`` stops managed servers."""

    def __init__(self, settings: LocalSettings, log: Callable[[str], None] = print):
        self.settings = settings
        self.log = log
        self._engines: dict[str, VllmSamplingEngine] = {}
        self._scratch: Path | None = None

    def engine_for(self, host: ModelHost) -> VllmSamplingEngine:
        """The engine of ``host``'s base model, started and checked on first use; a full-parameter trainer's host
        gets a server of its own."""
        full = sharding.is_sharded(host.model)
        key = f"full:{id(host)}" if full else str(Path(host.folder).resolve())
        if key not in self._engines:
            if self._scratch is None:
                self._scratch = Path(tempfile.mkdtemp(prefix="rlrunbook-vllm-"))
            self._engines[key] = open_engine(
                host, self.settings, self._scratch / str(len(self._engines)), self.log, weight_updates=full
            )
        engine = self._engines[key]
        if (
            adapter_rank(host) is not None
        ):  # a LoRA model: an adapter the server refuses fails here, not at step 1
            engine.prepare(snapshot_adapter(host, SamplerWeights(adapter=clone_adapter(host.model))))
        return engine

    def close(self) -> None:
        """Unload adapters, stop managed servers, delete the scratch folder; a server that died or failed to
        start leaves its log there for a post-mortem (its path is in the error). Engines of a server reached by
        URL write nothing there: their empty scratch folder goes too."""
        engines, self._engines = list(self._engines.values()), {}
        died = False
        for engine in engines:
            engine.close()
            if isinstance(engine.server, ManagedServer):
                died |= engine.server.died()
                engine.server.stop()
        if self._scratch is not None and not died:
            left = list(self._scratch.iterdir())
            if not left or len(left) == len(engines):  # no failed start's log among them
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None
