"""What runs where: which engine samples and how the trainer scores, as a run's ``backend`` section implies.

``show-config`` prints these lines under the resolved config and a training run logs them first, so a run
with 4-bit base weights says before any model loads that ``generate`` (or a vLLM server) samples it and that
the trainer scores with transformers' forward over padded datums (the in-process engine's decoder computes
with floating-point weights only; see :func:`rlrunbook.engines.decoder.unsupported_reason`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlrunbook.rl.setup.config import BackendSettings

_SAMPLERS = {
    "hf": "the in-process engine (the trainer's own forward, static KV cache, CUDA graphs on a GPU)",
    "generate": "transformers generate in process",
    "vllm": "a vLLM server",
}


def resolved_sampler(stated: BackendSettings, env: Mapping[str, str]) -> tuple[str, str]:
    """The sampler a local run uses and where that came from: ``backend.sampler``, else ``TINKER_LOCAL_SAMPLER``,
    else the default ``hf``."""
    if stated.sampler is not None:
        return stated.sampler, "backend.sampler"
    if env.get("TINKER_LOCAL_SAMPLER", "").strip():
        return env["TINKER_LOCAL_SAMPLER"].strip(), "TINKER_LOCAL_SAMPLER"
    return "hf", "default"


def placement(stated: BackendSettings, env: Mapping[str, str]) -> list[str]:
    """Lines saying which engine samples, over which base weights, and how the trainer scores."""
    if env.get("TINKER_BACKEND", "local").strip().lower() == "api":
        url = env.get("TINKER_BASE_URL", "").strip()
        where = f"the Tinker service at {url}" if url else "the hosted Tinker service"
        return [f"sampling and training: {where} (TINKER_BACKEND=api); backend.* is not used"]
    sampler, source = resolved_sampler(stated, env)
    dtype = stated.dtype or "bfloat16 on cuda, float32 on cpu"
    device = stated.device or "cuda where available, else cpu"
    base = f"4-bit NF4 (bitsandbytes), computing in {dtype}" if stated.load_in_4bit else dtype
    lines = [f"device: {device}; frozen base weights: {base}; LoRA adapters: {dtype}",
             f"sampling: {_SAMPLERS.get(sampler, sampler)} ({source}: {sampler})"]
    if stated.load_in_4bit:
        if sampler == "vllm":
            lines.append("sampling: the vLLM server loads the checkpoint's own (unquantised) weights, not the "
                         "trainer's 4-bit copy; the mismatch gate measures the gap between the two")
        lines.append("training: transformers' forward over right-padded datums (the shared-prefix decoder pass "
                     "computes with floating-point base weights only)")
    else:
        lines.append("training: the shared-prefix decoder pass (each distinct prefix once) for the Llama, Qwen2, "
                     "Qwen3 and Mistral families, transformers' forward over right-padded datums for others")
    if sampler == "hf":
        lines.append(numerics_line(stated, env))
    return lines


def numerics_line(stated: BackendSettings, env: Mapping[str, str]) -> str:
    """How sampler and trainer round: the numerics, where the setting came from, and what computes them here."""
    name = env.get("TINKER_LOCAL_NUMERICS", "").strip().lower()
    source = "TINKER_LOCAL_NUMERICS" if name else "default"
    name = name or "invariant"
    device = stated.device or env.get("TINKER_LOCAL_DEVICE", "").strip() or (
        "cuda" if torch.cuda.is_available() else "cpu")
    how = {"invariant": ("fixed-order Triton kernels" if device.startswith("cuda") else "fixed-order C kernels")
           + ": sampler and trainer agree bit for bit",
           "exact": "float64 products and attention, rounded once: 8 bytes per frozen weight",
           "native": "PyTorch's own kernels: sampler and trainer agree within the mismatch gates only"}.get(name)
    return f"numerics: {name} ({source})" + (f"; {how}" if how else "")
