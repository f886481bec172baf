"""What the local backend's training and sampling hold in memory, measured by running this project's own code.

Nothing here is a hand-written formula of what a layer keeps: the model is built from its config on the
``meta`` device (shapes and dtypes, no storage, no arithmetic), wrapped with the same LoRA adapter (or, for full
fine-tuning, with every weight trainable), and the trainer's forward and backward
(:class:`~rlrunbook.engines.shared_prefix.SharedPrefixScorer`, the pass ``forward_backward`` runs) or the
sampler's prefill and decode step run on it under :class:`LiveBytes`, which follows every tensor they create
until it is freed. So a change to the code that holds more memory is seen by
the plan at once. A trace stores and computes nothing, so what it costs is the dispatch of the pass's operators,
not their arithmetic.

What the trace does not see is counted from the shapes: the weights, the adapter, its gradients and AdamW's two
moments, the float64 copies of the frozen weights under ``exact`` numerics, and the sampler's KV caches.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rlrunbook.backend.lora import wrap_with_lora
from rlrunbook.engines.decoder import Decoder, Numerics, causal_lm
from rlrunbook.engines.shared_prefix import SharedPrefixScorer
from rlrunbook.kernels import coded_weights

GIB = 1 << 30


class LiveBytes(TorchDispatchMode):
    """Inside the block, the bytes of the tensors created there that are still alive, their peak, and all the bytes
    allocated there (``allocated``: freed or not).

    Each new storage is counted once when an operator returns it and uncounted when Python frees it (a view or
    an in-place result, whose storage is one of the operator's inputs, allocates nothing), so the peak is what
    the allocator would have had to hold for those tensors (on any device, ``meta`` included).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.allocated = 0
        self._seen: set[int] = set()

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._seen:
            return
        size = storage.nbytes()
        self._seen.add(key)
        self.live += size
        self.allocated += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output that shares an input's storage (a view, an in-place result) allocated nothing.
        inputs = {value.untyped_storage()._cdata for value in tree_flatten((args, kwargs))[0]
                  if isinstance(value, torch.Tensor)}
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.untyped_storage()._cdata not in inputs:
                self._track(value)
        return out


@dataclass(frozen=True)
class ModelBytes:
    """Bytes of a LoRA-wrapped model's parameters: ``frozen`` base weights, ``adapter`` (trainable) weights,
    the float64 copies ``exact`` numerics make of the frozen matrix-product weights (``float64_copy``), and at most
    what the short exact forms of those the CPU engine may code take beside them (``coded_copy``: 2 bytes a value,
    the longest form, for each whose rows are whole blocks; what the values allow is 0.75-2 bytes a value, or none:
    kernels/coded_weights.py)."""

    frozen: int
    adapter: int
    float64_copy: int
    coded_copy: int = 0

    @property
    def training_state(self) -> int:
        """The adapter, its gradient and AdamW's two moments (kept in the adapter's dtype)."""
        return 4 * self.adapter


def skeleton(config, dtype: torch.dtype, lora_rank: int | None, *, train_unembed: bool = True, lora_alpha: int = 32,
             train_attn: bool = True, train_mlp: bool = True) -> torch.nn.Module:
    """The model of a transformers ``config`` on the meta device, LoRA-wrapped as the local backend wraps it;
    ``lora_rank`` None: no adapter, every weight trains (full fine-tuning, see :func:`drop_gradients`)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lora_rank is None:
        return drop_gradients(model)
    return wrap_with_lora(model, rank=lora_rank, alpha=lora_alpha, seed=0, train_attn=train_attn,
                          train_mlp=train_mlp, train_unembed=train_unembed)


def drop_gradients(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every weight trainable and each weight's gradient dropped as soon as autograd stores it.

    Under FSDP2 a layer's unsharded gradient is reduce-scattered into the rank's float32 shard and freed as its
    backward ends; a trace of this model then sees what full training adds to LoRA's (the inputs of every base
    product, kept for the weight gradients) without the gradients themselves, which a plan counts from the shapes.
    """
    for param in model.parameters():
        param.requires_grad_(True)
        param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    return model


def model_bytes(model: torch.nn.Module) -> ModelBytes:
    """Parameter bytes of a LoRA-wrapped model (any device, meta included); tied weights counted once."""
    frozen = adapter = 0
    seen: set[int] = set()
    for param in model.parameters():
        key = param.untyped_storage()._cdata
        if key in seen:
            continue
        seen.add(key)
        if param.requires_grad:
            adapter += param.numel() * param.element_size()
        else:
            frozen += param.numel() * param.element_size()
    products = {id(m.weight): m.weight for m in model.modules()
                if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad}
    codable = sum(w.numel() for w in products.values() if w.dim() == 2 and w.shape[1] % coded_weights.BLOCK == 0)
    return ModelBytes(frozen, adapter, 8 * sum(w.numel() for w in products.values()), 2 * codable)


def forward_backward_peak(model: torch.nn.Module, numerics: Numerics | str, sequences: list[list[int]],
                          trained_tail: int, *, recompute_layers: bool) -> int:
    """Peak bytes of the activations and gradients of one ``forward_backward`` over ``sequences`` on a meta
    ``model`` (see :func:`skeleton`): the shared-prefix pass, the output layer at the last ``trained_tail``
    positions of every sequence, a sum of their logprobs as the loss, and the backward pass. Parameters and
    their gradients are not included (see :class:`ModelBytes`)."""
    scorer = SharedPrefixScorer(Decoder(model, numerics))
    with torch.no_grad():  # what a first pass makes once and keeps (stacked weights, float64 copies): not per pass
        scorer.run([[0, 1]])
    with LiveBytes() as live:
        run = scorer.run(sequences, recompute_layers=recompute_layers)
        pairs = sorted({(row, 0) for path in run.flat for row in path[-trained_tail - 1:-1]})
        rows = torch.tensor([row for row, _ in pairs], device="meta")
        targets = torch.zeros(len(pairs), dtype=torch.long, device="meta")
        loss = scorer.score(run.hidden, rows, targets).logprobs.sum()
        del run
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    return live.peak


@dataclass(frozen=True)
class TokenCost:
    """Training memory of a micro-batch of ``t`` distinct tokens: ``fixed + per_token * t`` bytes beyond the
    parameters and the training state."""

    fixed: int
    per_token: int
    recompute_layers: bool

    def bytes(self, tokens: int) -> int:
        return self.fixed + self.per_token * tokens

    def tokens(self, available: int) -> int:
        """The most tokens a micro-batch may hold in ``available`` bytes (0 when not even the fixed part fits)."""
        return max(0, (available - self.fixed) // max(1, self.per_token))


# Config fields holding one entry per decoder layer, which a model indexes by the layer's number: the attention
# kind of each layer (Qwen2/3 sliding windows, Gemma's interleaving), SmolLM3's layers without rotary embedding.
PER_LAYER_FIELDS = ("layer_types", "no_rope_layers")


def with_layers(config, layers: int):
    """A copy of a transformers ``config`` with ``layers`` decoder layers, its per-layer lists
    (``PER_LAYER_FIELDS``) of ``layers`` entries too: the first ``layers`` of the config's, and past its own
    count its pattern repeated from the start (a 1-layer ``["full_attention"]`` traced with 2 layers is
    ``["full_attention"] * 2``; ``[full, sliding]`` with 3 is ``[full, sliding, full]``)."""
    import copy

    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    for name in PER_LAYER_FIELDS:
        pattern = getattr(config, name, None)
        if isinstance(pattern, (list, tuple)) and pattern:
            setattr(config, name, [pattern[i % len(pattern)] for i in range(layers)])
    return config


def token_cost(config, dtype: torch.dtype, lora_rank: int | None, numerics: Numerics | str, *, recompute_layers: bool,
               device_type: str = "cpu", **lora_targets: bool) -> TokenCost:
    """The training memory of a micro-batch of ``config``'s model as a function of its distinct tokens.

    Decoder layers are alike, so the peak is ``a + b t + L (c + d t)`` for ``L`` layers and ``t`` tokens: four
    traced passes (1 and 2 layers; one sequence, every position trained, the output layer's work at its
    largest) give ``a, b, c, d``, and the model's own layer count the rest. The two lengths are long enough
    that the attention core splits its queries into chunks (``SCORE_ELEMENTS``), where its memory is linear.
    ``lora_targets``: ``train_attn``, ``train_mlp``, ``train_unembed`` as :func:`skeleton` takes them;
    ``lora_rank`` None: full fine-tuning, every weight trained.
    """
    from rlrunbook.engines.attention import SCORE_ELEMENTS, planning_for

    key = (config.to_json_string(), str(dtype), lora_rank, numerics.name if isinstance(numerics, Numerics)
           else numerics, recompute_layers, device_type, tuple(sorted(lora_targets.items())))
    if key in _TRACED:  # the same model and settings trace to the same numbers: once per process
        return _TRACED[key]
    heads = config.num_attention_heads
    reference_tokens = 4 * max(256, int((SCORE_ELEMENTS.get(device_type, SCORE_ELEMENTS["cuda"]) / heads) ** 0.5))
    peaks = {}
    for layers in (1, 2):
        model = skeleton(with_layers(config, layers), dtype, lora_rank, **lora_targets)
        with planning_for(device_type):
            for tokens in (reference_tokens // 2, reference_tokens):
                peaks[layers, tokens] = forward_backward_peak(model, numerics, [list(range(tokens))], tokens - 1,
                                                              recompute_layers=recompute_layers)
    half, full = reference_tokens // 2, reference_tokens
    per_layer = {t: peaks[2, t] - peaks[1, t] for t in (half, full)}
    base = {t: peaks[1, t] - per_layer[t] for t in (half, full)}
    layers = config.num_hidden_layers
    slope = ((base[full] - base[half]) + layers * (per_layer[full] - per_layer[half])) / (full - half)
    per_token = max(1, int(-(-slope // 1)))
    fixed = base[full] + layers * per_layer[full] - per_token * full
    _TRACED[key] = TokenCost(max(0, int(fixed)), per_token, recompute_layers)
    return _TRACED[key]


_TRACED: dict[tuple, TokenCost] = {}


# The share of a device the local backend leaves to an in-process sampler's caches (the vLLM sampler's own
# share, ``gpu_memory_utilization``, where a managed server shares the GPU), and what it never plans to use.
SAMPLER_SHARE = 0.4
# On a GPU the caching allocator's fragmentation; on a CPU glibc, which with the allocator settings of
# scripts/test.sh keeps freed activation buffers in its heap, so the resident set can reach about twice the
# traced tensor peak (docs/scale.md).
HEADROOM = {"cuda": 0.1, "cpu": 0.5}
# Below this many tokens per micro-batch a device runs its products inefficiently, and recomputing activations
# to afford larger micro-batches pays: a GPU needs thousands of rows to fill; a CPU's GEMMs peak at ~1,000.
MIN_EFFICIENT_TOKENS = {"cuda": 8192, "cpu": 1024}
_BUDGET_STEP = 256


def headroom(device_type: str) -> float:
    """The share of a device's memory no plan uses (see ``HEADROOM``)."""
    return HEADROOM.get(device_type, HEADROOM["cuda"])


def device_memory(device: str | torch.device) -> int:
    """Total memory of ``device``: a CUDA device's, or the machine's RAM for the CPU (fixed per machine, so a
    budget derived from it is the same in every run and on resume)."""
    import os

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclass(frozen=True)
class MicroBatching:
    """How ``forward_backward`` splits its batches: ``tokens`` distinct tokens per micro-batch at most (``None``:
    one pass), ``recompute_layers`` (activation checkpointing), and why, in words for the log."""

    tokens: int | None
    recompute_layers: bool
    reason: str
    cost: TokenCost | None = None  # the traced cost the choice rests on (None where none was traced)
    # Where checkpointing was chosen because the plan's share of the device could not hold a micro-batch of the
    # efficient size without it: the cost without it, so that a micro-batch that fits in the memory free when it
    # runs skips it (recomputing gives the same bits: see needs_recompute). None: the choice holds for every pass.
    plain: TokenCost | None = None


RECOMPUTE_MARGIN = 0.1  # the share of a device's memory a pass without checkpointing leaves free


def available_now(device: str | torch.device) -> int | None:
    """Bytes free on ``device`` now (host memory: the kernel's MemAvailable; CUDA: the driver's free memory),
    less ``RECOMPUTE_MARGIN`` of the device's memory; None where unknown."""
    device = torch.device(device)
    try:
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        elif device.type == "cpu":
            line = next(line for line in Path("/proc/meminfo").read_text().splitlines()
                        if line.startswith("MemAvailable:"))
            free = int(line.split()[1]) * 1024
        else:
            return None
    except (OSError, StopIteration, RuntimeError, ValueError):
        return None
    return free - int(RECOMPUTE_MARGIN * device_memory(device))


def needs_recompute(plain: TokenCost | None, tokens: int, device: str | torch.device) -> bool:
    """Whether a micro-batch of ``tokens`` distinct tokens, planned with activation checkpointing, must keep it:
    not when its cost without (``plain``) fits in the memory free on ``device`` now. Either way the pass computes
    the same values (checkpointing recomputes a layer's forward with the same kernels), so the choice changes time
    and peak memory, never a result."""
    if plain is None:
        return True
    free = available_now(device)
    return free is None or plain.bytes(tokens) > free


def lora_layout(model: torch.nn.Module) -> dict:
    """The LoRA rank, alpha and targets of a peft-wrapped model, as :func:`skeleton` takes them."""
    config = model.peft_config["default"]
    targets = set(config.target_modules or ())
    return {"lora_rank": int(config.r), "lora_alpha": int(config.lora_alpha), "train_unembed": "lm_head" in targets,
            "train_attn": bool(targets & {"q_proj", "k_proj", "v_proj", "o_proj"}),
            "train_mlp": bool(targets & {"gate_proj", "up_proj", "down_proj"})}


def choose_micro_batching(config, dtype: torch.dtype, lora: dict, numerics: Numerics | str, *, available: int,
                          device_type: str, tokens: int | None, checkpointing: str, where: str,
                          refuse: bool = True) -> MicroBatching:
    """Micro-batching of a model of transformers ``config`` with LoRA ``lora`` (:func:`lora_layout`'s keys; a
    ``lora_rank`` of None alone: full fine-tuning) when
    ``available`` bytes are left for activations on a ``device_type`` device (``where`` says why, for the log).

    ``tokens``: the budget a user set (``0``: no limit), or ``None`` to derive it from ``available`` and the
    traced per-token cost (:func:`token_cost`). ``checkpointing``: ``on``, ``off`` or ``auto`` (off while a
    micro-batch of the device's ``MIN_EFFICIENT_TOKENS`` fits without it, or while a stated budget does), or
    ``planned`` (on, as a run's plan chose it). Checkpointing that ``auto`` or ``planned`` chose comes with the
    cost without it (``plain``): a pass that fits in the memory free when it runs skips it.
    When not even a micro-batch of 256 tokens fits: ``ConfigError`` naming the ways out, or with ``refuse=False``
    that smallest micro-batch with checkpointing (a plan that does not fit, for its caller to report).
    """
    from rlrunbook.errors import ConfigError

    layout = {key: value for key, value in lora.items() if key not in ("lora_rank", "lora_alpha")}

    def cost(recompute: bool) -> TokenCost:
        return token_cost(config, dtype, lora["lora_rank"], numerics, recompute_layers=recompute,
                          device_type=device_type, **layout)

    if tokens is not None:
        budget = tokens or None
        automatic = checkpointing == "planned" or (
            checkpointing == "auto" and budget is not None and cost(False).bytes(budget) > available)
        recompute = checkpointing == "on" or automatic
        return MicroBatching(budget, recompute, f"stated: {budget or 'no limit'} tokens ({where})", cost(recompute),
                             cost(False) if automatic else None)
    plain = cost(False)
    efficient = MIN_EFFICIENT_TOKENS.get(device_type, MIN_EFFICIENT_TOKENS["cuda"])
    if checkpointing == "off" or (checkpointing == "auto" and plain.tokens(available) >= efficient):
        chosen, recompute = plain, False
    else:
        chosen, recompute = cost(True), True
    skippable = plain if checkpointing in ("auto", "planned") and recompute else None
    budget = chosen.tokens(available) // _BUDGET_STEP * _BUDGET_STEP
    if budget < _BUDGET_STEP and not refuse:
        return MicroBatching(_BUDGET_STEP, checkpointing != "off", f"does not fit ({where})",
                             cost(checkpointing != "off"))
    if budget < _BUDGET_STEP:
        raise ConfigError(
            f"training does not fit: {where}, and a micro-batch of {_BUDGET_STEP} tokens needs "
            f"{_gib(chosen.bytes(_BUDGET_STEP))} GiB more. Use a smaller model or LoRA rank, bfloat16, "
            "TINKER_LOCAL_ACTIVATION_CHECKPOINTING=on, or a device with more memory.")
    return MicroBatching(budget, recompute, f"derived: {chosen.per_token / 1024:.0f} KiB per token"
                         f"{' with activation checkpointing' if recompute else ''} ({where})", chosen, skippable)


def plan_micro_batching(model: torch.nn.Module, *, device: str, numerics: Numerics | str, tokens: int | None,
                        checkpointing: str, sampler_share: float = SAMPLER_SHARE) -> MicroBatching:
    """Micro-batching of a loaded LoRA-wrapped ``model`` training on ``device``, for a backend that does not know
    what will be sampled: the device's memory less ``HEADROOM``, ``sampler_share`` and the model's parameters and
    training state is left for activations (see :func:`choose_micro_batching`)."""
    total = device_memory(device)
    sizes = model_bytes(model)
    name = numerics.name if isinstance(numerics, Numerics) else numerics
    float64 = sizes.float64_copy if name == "exact" else 0
    kind = torch.device(device).type
    available = int(total * (1 - headroom(kind) - sampler_share)) - sizes.frozen - sizes.training_state - float64
    dtype = next(p.dtype for p in model.parameters() if not p.requires_grad)
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    where = (f"{_gib(total)} GiB {kind} memory, {_gib(available)} GiB left for activations after the weights, "
             f"the training state and {sampler_share:.0%} for sampling")
    return choose_micro_batching(config, dtype, lora_layout(model), numerics, available=available, device_type=kind,
                                 tokens=tokens, checkpointing=checkpointing, where=where)


def plan_full_micro_batching(model: torch.nn.Module, reference: torch.nn.Module | None, *, compute_dtype: torch.dtype,
                             device: str, numerics: Numerics | str, tokens: int | None, checkpointing: str,
                             sampler_share: float = SAMPLER_SHARE) -> MicroBatching:
    """Micro-batching of a model sharded for full-parameter training (:mod:`rlrunbook.backend.sharding`) on one rank:
    the device's memory less ``HEADROOM`` and ``sampler_share``, this rank's float32 master weights, gradients and
    AdamW moments (4 x its shards' bytes) and its share of the ``reference`` copy is left for activations, traced
    with every weight trainable in ``compute_dtype``."""
    from rlrunbook.backend import sharding

    total = device_memory(device)
    held = 4 * sum(sharding.local_bytes(p) for p in sharding.sharded_parameters(model).values())
    if reference is not None:
        held += sum(sharding.local_bytes(p) for p in reference.parameters())
    kind = torch.device(device).type
    available = int(total * (1 - headroom(kind) - sampler_share)) - held
    where = (f"{_gib(total)} GiB {kind} memory, {_gib(available)} GiB left for activations after this rank's "
             f"weights, gradients and optimizer state and {sampler_share:.0%} for sampling")
    return choose_micro_batching(causal_lm(model).config, compute_dtype, {"lora_rank": None}, numerics,
                                 available=available, device_type=kind, tokens=tokens, checkpointing=checkpointing,
                                 where=where)


def _gib(size: float) -> str:
    return f"{size / GIB:.1f}"


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Keys and values of one token over every layer: ``layers x 2 x kv_heads x head_dim x bytes``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.empty(0, dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element


def sampling_transients(config, dtype: torch.dtype, numerics: Numerics | str, *, prefill_tokens: int, rows: int,
                        window: int, device_type: str = "cpu") -> tuple[int, int]:
    """Peak bytes of the in-process engine's prefill of ``prefill_tokens`` distinct prompt tokens and of one decode
    step of ``rows`` rows reading ``window`` cache columns, beyond the weights and the caches themselves.

    Traced on a 2-layer skeleton: without gradients a layer's activations are freed before the next layer runs,
    so the peak does not grow with the layer count. The draw's two ``[rows, V]`` float32 buffers (scores after
    the filters, the Gumbel noise) are added to the decode step.
    """
    from rlrunbook.engines.attention import planning_for
    from rlrunbook.engines.layouts import RowCache

    model = skeleton(with_layers(config, 2), dtype, 1)
    decoder = Decoder(model, numerics)
    scorer = SharedPrefixScorer(decoder)
    with torch.no_grad(), planning_for(device_type):
        scorer.run([[0, 1]])  # what a first pass makes once (stacked weights, float64 copies)
        with LiveBytes() as prefill:
            run = scorer.run([list(range(prefill_tokens))])
            decoder.logits(run.hidden[-1:])
            del run
        cache = RowCache(2, rows, window, decoder.num_kv_heads, decoder.head_dim, decoder.dtype,
                         torch.device("meta"))
        cache.lengths.fill_(window - 1)
        with LiveBytes() as decode:
            decoder.logits(decoder.hidden(torch.zeros(rows, dtype=torch.long, device="meta"), cache.lengths, cache))
    return prefill.peak, decode.peak + 2 * rows * config.vocab_size * 4
