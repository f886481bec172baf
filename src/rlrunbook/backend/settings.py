"""The local backend's knobs, read once from the environment when a ServiceClient is made.

Names follow the ``TINKER_LOCAL_*`` convention of earlier local Tinker backends, so existing run scripts keep working.
Nothing below this module reads the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlrunbook.engines.decoder import NUMERICS, Numerics
from rlrunbook.environment import env_number
from rlrunbook.errors import ConfigError
from rlrunbook.vllm.settings import VllmSettings

SAMPLERS = ("hf", "generate", "vllm")
CHECKPOINTING = ("auto", "on", "off")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def check_device(device: str, source: str = "TINKER_LOCAL_DEVICE") -> None:
    """``ConfigError`` unless ``device`` is a torch device this machine has, naming ``source`` (where the
    value came from) and the fix. Checked where the settings are made, so before any model loads: a CUDA
    device on a CPU-only torch is refused here, not by torch's ``AssertionError`` once the model is loaded."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"{source}={device!r} is not a torch device ({error}). Use cpu, cuda or cuda:N.") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ConfigError(f"{source}={device!r} needs CUDA, but this torch ({torch.__version__}, {build}) sees "
                              "no CUDA device. Unset it (the default is cuda where available, else cpu) or set it "
                              "to cpu; for a GPU, install a CUDA build of torch on a machine with a GPU.")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ConfigError(f"{source}={device!r}: this machine has {count} CUDA device(s), "
                              f"cuda:0..cuda:{count - 1}. Pick one of those.")
    elif parsed.type != "cpu":
        backend = getattr(torch.backends, parsed.type, None) or getattr(torch, parsed.type, None)
        available = getattr(backend, "is_available", None)
        if available is None or not available():
            raise ConfigError(f"{source}={device!r}: torch has no usable {parsed.type} device here. "
                              "Use cpu or cuda.")


STAND_INS_ENV = "TINKER_LOCAL_MODEL_STAND_INS"


def _env_switch(env, name: str, on: str, off: str) -> bool | None:
    """``name`` as a switch: ``1`` True, ``0`` False, unset or empty ``None``; anything else refused, saying what each
    value means (``on``, ``off``)."""
    value = env.get(name, "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        raise ConfigError(f"{name}={value!r} must be 1 ({on}) or 0 ({off}).")
    return value == "1"


def parse_stand_ins(text: str, source: str) -> tuple[tuple[str, str], ...]:
    """``"NAME=MODEL,NAME2=MODEL2"`` as pairs; ``ConfigError`` naming ``source`` for a malformed entry."""
    pairs = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, sep, model = (part.strip() for part in entry.partition("="))
        if not sep or not name or not model:
            raise ConfigError(f"{source}: {entry!r} is not NAME=MODEL (e.g. Qwen/Qwen3.5-9B=tiny, a built-in "
                              "model or a model folder standing in for the hub name).")
        pairs.append((name, model))
    return tuple(pairs)


@dataclass(frozen=True)
class LocalSettings:
    """Everything the local backend needs to know that is not an API argument.

    Attributes:
        device: torch device for model, sampling and training (``TINKER_LOCAL_DEVICE``;
            default ``cuda`` when available, else ``cpu``).
        dtype: parameter dtype (``TINKER_LOCAL_DTYPE``: float32 | bfloat16 | float16; default
            bfloat16 on CUDA, float32 on CPU, where bf16 matmuls are slow and parity is loose).
        seed: default seed for LoRA initialisation and unseeded sampling (``TINKER_LOCAL_SEED``, 0).
        grad_accum_chunks: forward_backward splits its batch into at least this many chunks, one
            backward each, so peak memory falls while the summed gradient is unchanged
            (``TINKER_LOCAL_GRAD_ACCUM_STEPS``, 1).
        micro_batch_tokens: most distinct tokens one forward/backward pass of ``forward_backward`` computes
            (``TINKER_LOCAL_MICRO_BATCH_TOKENS``): ``None`` (``auto``, the default) derives it from the
            device's memory and the model's traced per-token cost (rlrunbook.backend.memory); ``0`` = no limit.
        activation_checkpointing: whether decoder layers recompute their activations in backward
            (``TINKER_LOCAL_ACTIVATION_CHECKPOINTING``: ``auto`` (default: where the memory needs it), ``on``,
            ``off``). With ``auto``, a pass that checkpointing was planned for skips it when its cost without
            fits in the memory free as it runs (the same values either way: backend/memory.needs_recompute).
        planned_recompute: with ``activation_checkpointing`` ``auto``, checkpointing as a run's memory plan
            chose it (``rlrunbook train`` sets it from its plan), skipped as ``auto`` skips it.
        lora_alpha: LoRA alpha (``TINKER_LOCAL_LORA_ALPHA``, 32: scale 1 at the SDK's default rank 32).
        sampler: sampling engine (``TINKER_LOCAL_SAMPLER``): ``hf`` (default: this project's in-process
            engine over the transformers weights, the trainer's own forward, for the Llama, Qwen2,
            Qwen3 and Mistral families), ``generate`` (transformers ``generate``, any causal LM) or ``vllm``
            (a vLLM server, configured by ``vllm``; the in-process engine then only validates requests,
            draws seeds and scores prompts).
        numerics: how sampler and trainer round (``TINKER_LOCAL_NUMERICS``): ``invariant`` (default:
            every sum that reaches a logprob in an order fixed by the code, in the working precision:
            bitwise sampler-trainer agreement on CPU and CUDA), ``exact`` (float64 products and attention,
            a reference; slower, 8 bytes per frozen weight) or ``native`` (PyTorch's own kernels, as
            transformers computes; for comparison). See rlrunbook.engines.decoder and rlrunbook.kernels.
        cuda_graphs: capture the decode step as CUDA graphs on a CUDA device (``TINKER_LOCAL_CUDA_GRAPHS``:
            1 | 0; default 1).
        prefix_cache_tokens: most tokens whose keys/values the engine keeps for reuse by later calls under
            the same weights, e.g. a debate's next round (``TINKER_LOCAL_PREFIX_CACHE_TOKENS``, 65536; 0 = off).
        coded_weights: where a frozen float32 base weight has a short exact form (the values of a quantized
            checkpoint, or bfloat16 values), the CPU engine keeps it too and decode steps read it instead: the same
            bits, fewer bytes from memory per step, up to 2 more bytes per coded weight held (the built-in
            SmolLM2-135M: 112 MB) (``TINKER_LOCAL_CODED_WEIGHTS``: 1 | 0; default 1). See
            rlrunbook.kernels.coded_weights.
        kept_products_mb: most megabytes of projection outputs a CPU sampling call keeps for the trainer's pass over
            the tokens it sampled, which then reads them instead of computing them while the weights are still the
            sampled ones (on-policy, before the next ``optim_step``): the same bits, about 40% less arithmetic
            in a LoRA ``forward_backward`` (``TINKER_LOCAL_KEPT_PRODUCTS_MB``, 4096; 0 = off). A token keeps
            every layer's base output columns and the logits it was drawn from (SmolLM2-135M: 622 + 197 KB in
            float32); tokens past the budget are
            computed by the trainer as usual; none are kept while sampling runs concurrently with training
            (``concurrent_sampling``). See rlrunbook.engines.kept_products.
        storage_dir: where ``tinker://`` checkpoints live (``TINKER_LOCAL_STORAGE``;
            default ``$RLRUNBOOK_CACHE_DIR/tinker`` or ``~/.cache/rlrunbook/tinker``).
        max_batch_rows: most sequences per generate call (``TINKER_LOCAL_MAX_BATCH_ROWS``, 256).
        batch_window_ms: how long a sampling call the worker is about to start waits for more requests of the same
            client and settings to join its batch (``TINKER_LOCAL_BATCH_WINDOW_MS``, 2; ``rlrunbook serve``: 20,
            as requests sent at once arrive over HTTP a few milliseconds apart). It changes no result: under the default
            numerics (and ``exact``) a row's numbers do not depend on its batch.
        zero_advantage_batches: what ``forward_backward`` does with an advantage-based loss on a batch
            whose advantages are all 0 (``TINKER_LOCAL_ZERO_ADVANTAGE_BATCHES``): ``error`` (default,
            NoLearningSignalError: a silent no-op step is a bug in this project's loop) or ``accept``
            (computed like the hosted service does: loss and gradient 0; what unmodified cookbook
            recipes need, whose loops send such batches when every group's rewards tie).
        load_in_4bit: load frozen base weights 4-bit NF4 (bitsandbytes, CUDA only; set by a run's
            ``backend.load_in_4bit``).
        vllm: the vLLM sampler's server: managed or external, restarts, limits (``TINKER_LOCAL_VLLM_*``;
            see :class:`rlrunbook.vllm.settings.VllmSettings`).
        concurrent_sampling: sampling clients of the in-process engine run their calls on a second worker
            thread, on their own pinned snapshot, so they do not wait behind ``forward_backward`` and
            ``optim_step`` (``TINKER_LOCAL_CONCURRENT_SAMPLING``: 1 | 0; default 0, every call on one
            worker in submission order). Set by ``train --off-policy K`` with K > 0. See backend/futures.py.
        sampler_threads: with ``concurrent_sampling`` on CPU, the intra-op threads of the sampling worker; the
            training worker gets the rest of the process's, so the two never oversubscribe the cores
            (``TINKER_LOCAL_SAMPLER_THREADS``; default 0: half, at least 1). Fixed for the service's life:
            a thread count changes how reductions are split, so it must not follow timing.
        timeline: a file to which each worker call's start and end are appended, one JSON line each
            (``TINKER_LOCAL_TIMELINE``; default none). See :mod:`rlrunbook.backend.timeline`.
        sample_log: a file to which every sample request's seed, prompt and sampled tokens and logprobs are
            appended, one JSON line each (``TINKER_LOCAL_SAMPLE_LOG``; default none). See
            :mod:`rlrunbook.backend.sample_log`.
        model_stand_ins: base-model names served by another model, as ``(name, model)`` pairs
            (``TINKER_LOCAL_MODEL_STAND_INS=NAME=MODEL,...``; MODEL a built-in name or a model folder): code that
            hard-codes a hub model runs offline on a local one. Clients keep the name they asked for.
    """

    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    dtype: torch.dtype | None = None
    seed: int = 0
    grad_accum_chunks: int = 1
    micro_batch_tokens: int | None = None
    activation_checkpointing: str = "auto"
    planned_recompute: bool = False
    lora_alpha: int = 32
    sampler: str = "hf"
    numerics: str = "invariant"
    cuda_graphs: bool = True
    prefix_cache_tokens: int = 65536
    kept_products_mb: int = 4096
    coded_weights: bool = True
    storage_dir: Path | None = None
    max_batch_rows: int = 256
    batch_window_ms: int = 2
    zero_advantage_batches: str = "error"
    load_in_4bit: bool = False
    vllm: VllmSettings = field(default_factory=VllmSettings)
    concurrent_sampling: bool = False
    sampler_threads: int = 0
    timeline: Path | None = None
    sample_log: Path | None = None
    model_stand_ins: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        check_device(self.device, "the local backend's device (TINKER_LOCAL_DEVICE, backend.device or --device)")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"sampler {self.sampler!r} must be one of {SAMPLERS} (TINKER_LOCAL_SAMPLER).")
        if self.numerics not in NUMERICS:
            raise ConfigError(f"numerics {self.numerics!r} must be one of {NUMERICS} (TINKER_LOCAL_NUMERICS).")
        if self.load_in_4bit and self.sampler == "hf":
            raise ConfigError("4-bit base weights (backend.load_in_4bit) with the in-process sampler (sampler 'hf', "
                              "the default): its decoder computes with floating-point weights only. Set "
                              "TINKER_LOCAL_SAMPLER=generate (or backend.sampler: generate), or vllm.")
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ConfigError(f"activation_checkpointing={self.activation_checkpointing!r} must be one of "
                              f"{CHECKPOINTING} (TINKER_LOCAL_ACTIVATION_CHECKPOINTING).")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 0:
            raise ConfigError(f"micro_batch_tokens={self.micro_batch_tokens} must be >= 0 (0: no limit) "
                              "(TINKER_LOCAL_MICRO_BATCH_TOKENS; 'auto' derives it from the device's memory).")
        if self.zero_advantage_batches not in ("error", "accept"):
            raise ConfigError(f"zero_advantage_batches={self.zero_advantage_batches!r} must be 'error' or 'accept'.")

    def model_for(self, base_model: str) -> str:
        """The model that serves ``base_model``: its stand-in if one was named, else itself."""
        return dict(self.model_stand_ins).get(base_model, base_model)

    def worker_threads(self) -> tuple[int | None, int | None]:
        """Intra-op threads of the (training, sampling) workers: ``(None, None)`` (torch's own count) unless
        sampling runs concurrently on CPU, where the process's threads are split between the two."""
        if not self.concurrent_sampling or not self.device.startswith("cpu"):
            return None, None
        total = torch.get_num_threads()
        sampler = min(max(1, total - 1), self.sampler_threads or max(1, total // 2))
        return max(1, total - sampler), sampler

    def decoder_numerics(self) -> Numerics:
        """How the in-process engine and the trainer round (both get the same)."""
        return Numerics(self.numerics)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        return torch.bfloat16 if self.device.startswith("cuda") else torch.float32

    def resolved_storage_dir(self) -> Path:
        if self.storage_dir is not None:
            return self.storage_dir
        cache = os.environ.get("RLRUNBOOK_CACHE_DIR")
        root = Path(cache) if cache else Path.home() / ".cache" / "rlrunbook"
        return root / "tinker"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> LocalSettings:
        """Read the ``TINKER_LOCAL_*`` variables; invalid values raise ``ConfigError``."""
        env = dict(os.environ if env is None else env)
        kwargs: dict[str, object] = {}
        if env.get("TINKER_LOCAL_DEVICE"):
            check_device(env["TINKER_LOCAL_DEVICE"], "TINKER_LOCAL_DEVICE")
            kwargs["device"] = env["TINKER_LOCAL_DEVICE"]
        if env.get("TINKER_LOCAL_DTYPE"):
            name = env["TINKER_LOCAL_DTYPE"].lower()
            if name not in _DTYPES:
                raise ConfigError(f"TINKER_LOCAL_DTYPE={name!r} is not one of {sorted(_DTYPES)}.")
            kwargs["dtype"] = _DTYPES[name]
        sampler = env.get("TINKER_LOCAL_SAMPLER", "hf") or "hf"
        if sampler not in SAMPLERS:
            raise ConfigError(f"TINKER_LOCAL_SAMPLER={sampler!r} must be one of {SAMPLERS}.")
        zero = env.get("TINKER_LOCAL_ZERO_ADVANTAGE_BATCHES", "").strip().lower() or "error"
        if zero not in ("error", "accept"):
            raise ConfigError(f"TINKER_LOCAL_ZERO_ADVANTAGE_BATCHES={zero!r} must be 'error' or 'accept'.")
        kwargs["zero_advantage_batches"] = zero
        if env.get("TINKER_LOCAL_NUMERICS"):
            kwargs["numerics"] = env["TINKER_LOCAL_NUMERICS"].strip().lower()
        for field_name, name, on, off in (
                ("cuda_graphs", "TINKER_LOCAL_CUDA_GRAPHS", "capture", "no graphs"),
                ("coded_weights", "TINKER_LOCAL_CODED_WEIGHTS",
                 "decode reads a frozen weight's short exact form where it has one", "always the float32 weights"),
                ("concurrent_sampling", "TINKER_LOCAL_CONCURRENT_SAMPLING",
                 "a second worker samples while the trainer trains", "one worker, submission order")):
            switch = _env_switch(env, name, on, off)
            if switch is not None:
                kwargs[field_name] = switch
        tokens = env.get("TINKER_LOCAL_MICRO_BATCH_TOKENS", "").strip().lower()
        if tokens and tokens != "auto":
            kwargs["micro_batch_tokens"] = env_number(env, "TINKER_LOCAL_MICRO_BATCH_TOKENS", 0, 0, int)
        checkpointing = env.get("TINKER_LOCAL_ACTIVATION_CHECKPOINTING", "").strip().lower()
        if checkpointing:
            kwargs["activation_checkpointing"] = checkpointing
        if env.get("TINKER_LOCAL_STORAGE"):
            kwargs["storage_dir"] = Path(env["TINKER_LOCAL_STORAGE"])
        if env.get(STAND_INS_ENV, "").strip():
            kwargs["model_stand_ins"] = parse_stand_ins(env[STAND_INS_ENV], STAND_INS_ENV)
        if env.get("TINKER_LOCAL_TIMELINE", "").strip():
            kwargs["timeline"] = Path(env["TINKER_LOCAL_TIMELINE"].strip())
        if env.get("TINKER_LOCAL_SAMPLE_LOG", "").strip():
            kwargs["sample_log"] = Path(env["TINKER_LOCAL_SAMPLE_LOG"].strip())
        return cls(
            seed=env_number(env, "TINKER_LOCAL_SEED", 0, 0, int),
            grad_accum_chunks=env_number(env, "TINKER_LOCAL_GRAD_ACCUM_STEPS", 1, 1, int),
            lora_alpha=env_number(env, "TINKER_LOCAL_LORA_ALPHA", 32, 1, int),
            max_batch_rows=env_number(env, "TINKER_LOCAL_MAX_BATCH_ROWS", 256, 1, int),
            batch_window_ms=env_number(env, "TINKER_LOCAL_BATCH_WINDOW_MS", 2, 0, int),
            prefix_cache_tokens=env_number(env, "TINKER_LOCAL_PREFIX_CACHE_TOKENS", 65536, 0, int),
            kept_products_mb=env_number(env, "TINKER_LOCAL_KEPT_PRODUCTS_MB", 4096, 0, int),
            sampler_threads=env_number(env, "TINKER_LOCAL_SAMPLER_THREADS", 0, 0, int),
            sampler=sampler,
            vllm=VllmSettings.from_env(env),
            **kwargs,  # type: ignore[arg-type]
        )
