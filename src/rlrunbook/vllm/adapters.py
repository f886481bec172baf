"""Which names a vLLM server samples by: the base model, and LoRA snapshots loaded on demand.

- **Adapters by content.** A LoRA snapshot is served under a name derived from its weights
  (:class:`Adapter`), written as a peft folder and loaded once, so a sampler of step k can only
  sample step k's weights. Names are never reloaded in place: vLLM would keep prefix-cache blocks
  computed with the old weights. The ``max_loaded`` most recent stay loaded; an older one that is
  asked for again is written and loaded again.
- **The base model through a zero adapter.** vLLM 0.32's CPU LoRA kernels index the adapter slots
  with the request's slot id, and a request without an adapter has id -1, which Python indexing
  reads as the *last* slot: once an adapter with LoRA on ``lm_head`` has been served, base-model
  requests get its output-layer delta (docs/vllm.md gives the gap). So the
  base model is served by an all-zero rank-1 adapter on ``lm_head`` (it adds exactly 0), and no
  request carries id -1. Where the architecture takes no ``lm_head`` LoRA, no adapter can leave
  one behind, and the plain base name is safe.
- **A full-parameter trainer's weights replace the base model's** (:class:`FullWeights`): its server
  is its own, and before a version is first sampled its weights are written as safetensors and
  reloaded in place (vLLM's ``reload_weights``), the prefix cache dropped. A restarted server
  starts from the base model's folder again, so a version is keyed by the server's epoch too.
"""

from __future__ import annotations

import itertools
import json
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlrunbook.vllm.client import VllmServerError, lora_rank_flag
from rlrunbook.errors import ConfigError

_slots_ids = itertools.count()


@dataclass(frozen=True)
class Adapter:
    """A LoRA snapshot to sample from: ``name`` derives from its weights; ``write(folder)`` saves it (peft)."""

    name: str
    rank: int
    write: Callable[[Path], None]


@dataclass(frozen=True)
class WeightSync:
    """One replacement of a server's weights: seconds to write the file, seconds for the server to reload it (and
    drop its prefix cache), and the file's bytes."""

    write_s: float
    reload_s: float
    bytes: int


@dataclass(frozen=True)
class FullWeights:
    """Every weight of a full-parameter trainer at ``version`` (its weights_version, which every optimizer step
    and state import bumps), served under the base model's name; ``write(folder)`` saves them as safetensors
    under the checkpoint's tensor names."""

    version: int
    write: Callable[[Path], None]


def write_zero_unembed_adapter(folder: Path, vocab_rows: int, hidden: int) -> None:
    """A peft LoRA folder of rank 1 on ``lm_head`` only, all zeros: it adds exactly 0 to the logits."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 1, "lora_dropout": 0.0,
              "bias": "none", "target_modules": ["lm_head"], "fan_in_fan_out": False, "use_rslora": False}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(1, hidden),
               "base_model.model.lm_head.lora_B.weight": torch.zeros(vocab_rows, 1)},
              str(folder / "adapter_model.safetensors"))


def _refuses_unembed(error: VllmServerError) -> bool:
    return "expected target modules" in str(error) and "lm_head" in str(error)


class AdapterSlots:
    """The served names of one engine on one server (which may be shared: names carry a unique prefix).

    ``server`` provides ``client``, ``served_model``, ``epoch`` (bumped by a restart, which drops every
    loaded adapter), ``before_adapter_load(rank)``, ``adapter_loaded()``, ``alive()`` and ``explain(error)``.
    ``unembed_shape`` is ``lm_head``'s (rows, hidden): the zero adapter's shape.
    """

    def __init__(self, server, adapter_dir: Path, unembed_shape: tuple[int, int], max_loaded: int):
        self.server = server
        self.max_loaded = max_loaded
        self._dir = Path(adapter_dir)
        self._unembed_shape = unembed_shape
        self._prefix = f"rlrb{next(_slots_ids)}-{id(self) & 0xFFFFFF:06x}"
        self._loaded: OrderedDict[str, Path] = OrderedDict()
        self._loaded_epoch = -1
        self._base: tuple[int, str] | None = None  # (server epoch, the name that serves the base model)
        self._served_version: tuple[int, int] | None = None  # (server epoch, FullWeights.version) now served
        self.weight_syncs: list[WeightSync] = []
        self._lock = threading.Lock()

    def name_for(self, adapter: Adapter | FullWeights | None) -> str:
        """The name to sample ``adapter`` (``None``: the base model) by, loading it first if needed."""
        if isinstance(adapter, FullWeights):
            self._serve_weights(adapter)
            return self._base_name()
        return self._base_name() if adapter is None else self._adapter_name(adapter)

    def _serve_weights(self, weights: FullWeights) -> None:
        """Make the server's base model compute with ``weights`` (written and reloaded once per version)."""
        with self._lock:
            if self._served_version == (self.server.epoch, weights.version):
                return
            folder = self._dir / f"{self._prefix}-weights"
            partial = folder.with_name(folder.name + ".partial")
            started = time.perf_counter()
            shutil.rmtree(partial, ignore_errors=True)
            weights.write(partial)
            shutil.rmtree(folder, ignore_errors=True)
            partial.rename(folder)
            written = time.perf_counter()
            try:
                self.server.client.reload_weights(str(folder))
            except VllmServerError as error:
                raise self.server.explain(error) from None
            self._served_version = (self.server.epoch, weights.version)
            size = sum(f.stat().st_size for f in folder.iterdir())
            self.weight_syncs.append(WeightSync(written - started, time.perf_counter() - written, size))

    @property
    def weight_reloads(self) -> int:
        """How many times the server's weights were replaced."""
        return len(self.weight_syncs)

    def _base_name(self) -> str:
        with self._lock:
            if self._base is not None and self._base[0] == self.server.epoch:
                return self._base[1]
            name = f"{self._prefix}-base"
            write_zero_unembed_adapter(self._dir / name, *self._unembed_shape)
            try:
                self.server.client.load_adapter(name, str(self._dir / name))
            except VllmServerError as error:
                if not _refuses_unembed(error):
                    raise self.server.explain(error) from None
                name = self.server.served_model  # no lm_head LoRA on this architecture: slot -1 reads nothing
            self._base = (self.server.epoch, name)
            return name

    def _adapter_name(self, adapter: Adapter) -> str:
        with self._lock:
            self.server.before_adapter_load(adapter.rank)  # may restart the server (rank, schedule, memory)
            if self._loaded_epoch != self.server.epoch:  # a fresh server holds no adapter
                self._loaded.clear()
                self._loaded_epoch = self.server.epoch
            name = f"{self._prefix}-{adapter.name}"
            if name in self._loaded:
                self._loaded.move_to_end(name)
                return name
            folder = self._dir / name
            if not (folder / "adapter_model.safetensors").is_file():
                partial = folder.with_name(folder.name + ".partial")
                shutil.rmtree(partial, ignore_errors=True)
                adapter.write(partial)
                partial.rename(folder)
            try:
                self.server.client.load_adapter(name, str(folder))
            except VllmServerError as error:
                raise _explain_refusal(error, adapter.rank, self.server) from None
            self._loaded[name] = folder
            self.server.adapter_loaded()
            while len(self._loaded) > self.max_loaded:  # the oldest version goes
                old, old_folder = self._loaded.popitem(last=False)
                self.server.client.unload_adapter(old)
                shutil.rmtree(old_folder, ignore_errors=True)
            return name

    def close(self) -> None:
        """Unload this engine's names from a still running server and delete their folders."""
        with self._lock:
            names = [(n, self._loaded_epoch) for n in self._loaded]
            if self._base is not None and self._base[1] != self.server.served_model:
                names.append((self._base[1], self._base[0]))
            for name, epoch in names:
                try:
                    if epoch == self.server.epoch and self.server.alive():
                        self.server.client.unload_adapter(name)
                except VllmServerError:
                    pass  # the server is gone or going: nothing is served any more
                shutil.rmtree(self._dir / name, ignore_errors=True)
            shutil.rmtree(self._dir / f"{self._prefix}-weights", ignore_errors=True)
            self._loaded.clear()
            self._base = None
            self._served_version = None


def _explain_refusal(error: VllmServerError, rank: int, server) -> Exception:
    if "max_lora_rank" in str(error):
        return ConfigError(
            f"the vLLM server refuses this LoRA adapter of rank {rank}: it was started with a smaller "
            f"--max-lora-rank ({error}). Restart it with --max-lora-rank {lora_rank_flag(rank)} or train with a "
            "lower lora_rank; a managed server (no TINKER_LOCAL_VLLM_URL) follows the adapter's rank by itself.")
    if _refuses_unembed(error):
        return ConfigError(
            "the vLLM server serves no LoRA on the output layer (lm_head) for this model's architecture (vLLM 0.32 "
            "does for Llama, Qwen3, Mixtral and others, not for Qwen2). Train without it: "
            "create_lora_training_client(..., train_unembed=False), or `rlrunbook train ... train_unembed=false`; "
            f"or sample with TINKER_LOCAL_SAMPLER=hf. Server: {error}")
    return server.explain(error)
