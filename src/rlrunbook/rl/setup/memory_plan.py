"""A run's memory, planned before any model loads: what sampling and training hold at their peaks on the device.

From the config alone (the model's architecture from :func:`rlrunbook.models.shapes.model_shape`, no weights):

- **resident** all along: the frozen weights, the LoRA adapter and AdamW's two moments (and under ``exact``
  numerics the float64 copy of the frozen matrix-product weights);
- **sampling** (the in-process engine): the decode KV cache of ``rows x capacity`` positions (kept between calls,
  so it stays during training too), the prefix pool of prompt keys and values, and the larger of one prefill's
  and one decode step's activations (traced on the meta device, :mod:`rlrunbook.backend.memory`); a vLLM server
  instead takes its ``gpu_memory_utilization`` share of a GPU, or lives in its own process on a CPU;
- **training**: the adapter's gradient and one micro-batch's activations, the micro-batch sized so that the peak
  fits (traced per-token cost), with activation checkpointing where a micro-batch would otherwise be too small.

Full-parameter training (``finetune: full``) is planned per rank of a torchrun launch of ``world_size`` ranks:
sharded float32 weights, gradients and moments instead of the frozen weights and the adapter, the layers FSDP2
gathers, and the rank's share of the step's rows (:mod:`rlrunbook.rl.setup.full_plan`).

Memory grows linearly: the KV cache with rows x tokens, a micro-batch's activations with its tokens (the attention
core keeps no tokens x tokens scores: :mod:`rlrunbook.engines.attention`), and a larger batch only adds
micro-batches. :func:`check_fits` refuses a config whose plan does not fit, naming the knob that fixes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rlrunbook.errors import ConfigError
from rlrunbook.rl.setup import full_plan
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.full_plan import FullShards

GIB = 1 << 30
ASSUMED_PROMPT_TOKENS = 512  # when data.max_prompt_tokens does not state the longest prompt
DEBATE_ROUNDS = 3


@dataclass(frozen=True)
class MemoryPlan:
    """Predicted bytes of a run's sampling and training peaks on one device (see the module docstring)."""

    device: str
    total: int
    model: str
    sampler: str
    weights: int
    training_state: int  # adapter + its gradient + AdamW's two moments (full: the rank's float32 shards of those)
    float64_copy: int
    kv_cache: int
    prefix_pool: int
    sampling_activations: int
    vllm_share: int
    micro_batch_tokens: int | None
    recompute_layers: bool
    training_activations: int
    batch_tokens: int
    shape: str
    notes: list[str] = field(default_factory=list)
    # off_policy K > 0: sampling and training run at once, and K + 2 more adapter copies are held (the
    # engine's pinned copy and the snapshots of the batches in flight); 0: one after the other.
    concurrent_snapshots: int = 0
    chunks: int = 1  # backend.grad_accum_steps: the batch is first cut into this many parts by count
    full: FullShards | None = None  # finetune full: one rank's parts (weights: its reference shard); None: LoRA
    # The base products one step's sampling calls keep for its training pass (CPU engine; engines/kept_products.py),
    # held from sampling until that pass reads them (its last micro-batch frees them layer by layer: counted as held
    # through the whole pass, an upper bound).
    kept_products: int = 0
    # The short exact forms of frozen float32 weights the CPU engine reads in decode steps (kernels/coded_weights.py),
    # at most 2 bytes a value (the values decide: 0.75-2 bytes, or none): an upper bound, held all along.
    coded_weights: int = 0

    @property
    def usable(self) -> int:
        from rlrunbook.backend.memory import headroom

        return int(self.total * (1 - headroom(self.device.split(" ")[0])))

    @property
    def gradient(self) -> int:
        """The trained weights' gradient, held while training: the adapter's, or the rank's float32 shard."""
        return self.full.gradients if self.full else self.training_state // 4

    @property
    def snapshot(self) -> int:
        """One copy of the weights sampling reads: the adapter, or (full) every weight gathered."""
        return self.full.sampling_copy if self.full else self.training_state // 4

    @property
    def resident(self) -> int:
        """Held from the first step to the last: weights, the adapter and its optimizer state, sampler caches."""
        state = self.training_state - self.gradient if self.full else self.training_state * 3 // 4
        return (self.weights + self.float64_copy + self.coded_weights + state + self.kv_cache + self.prefix_pool
                + self.vllm_share + self.kept_products)

    @property
    def sampling_peak(self) -> int:
        return self.resident + self.sampling_activations + (self.full.sampling_copy if self.full else 0)

    @property
    def training_peak(self) -> int:
        return self.resident + self.gradient + self.training_activations + (self.full.gathered if self.full else 0)

    @property
    def peak(self) -> int:
        """The most the run holds at once: the larger phase's peak, or both phases together when they overlap."""
        if not self.concurrent_snapshots:
            return max(self.sampling_peak, self.training_peak)
        return self.training_peak + self.sampling_activations + self.concurrent_snapshots * self.snapshot

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable

    @property
    def micro_batches(self) -> int:
        """How many micro-batches ``forward_backward`` makes of the planned batch: each of the ``chunks`` parts
        (near-equal by count, here by tokens) split by the token budget."""
        per_chunk = -(-self.batch_tokens // self.chunks)
        return self.chunks * (1 if not self.micro_batch_tokens else -(-per_chunk // self.micro_batch_tokens))


def kept_row_bytes(shape, dtype) -> int:
    """Bytes a token's kept base products take (:mod:`rlrunbook.engines.kept_products`): every layer's q, k, v, o,
    gate, up and down output columns, and the float32 logits a token was drawn from."""
    head_dim = getattr(shape, "head_dim", None) or shape.hidden_size // shape.num_attention_heads
    kv_heads = getattr(shape, "num_key_value_heads", None) or shape.num_attention_heads
    columns = (shape.num_attention_heads + 2 * kv_heads) * head_dim + 2 * shape.hidden_size + 2 * shape.intermediate_size
    return shape.num_hidden_layers * columns * dtype.itemsize + shape.vocab_size * 4


def parse_size(text: str, what: str = "device memory") -> int:
    """``80GiB``, ``80GB``, ``24 GiB``, ``512MiB`` or a number of bytes, as bytes (GB read as GiB, as GPUs are sold);
    ``ConfigError`` naming ``what`` for anything else."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ConfigError(f"{what} {text!r} is not a size: write it like 80GiB, 24GB or 512MiB.")
    number, unit = float(match.group(1)), (match.group(2) or "").upper().rstrip("B").rstrip("I")
    size = int(number * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit])
    if size <= 0:
        raise ConfigError(f"{what} {text!r} must be more than 0 bytes: write it like 80GiB.")
    return size


def _step_shape(config: TrainConfig) -> tuple[int, int, int, list[str]]:
    """(longest prompt, distinct prompt tokens of one sampling call, distinct tokens of one training batch), and
    the assumptions they rest on."""
    notes = []
    prompt = config.data.max_prompt_tokens
    if prompt is None:
        prompt = ASSUMED_PROMPT_TOKENS
        notes.append(f"prompts assumed to be at most {prompt} tokens (state data.max_prompt_tokens to plan for "
                     "the real length)")
    turns = config.max_tokens
    if config.mode == "debate":  # round r's prompt holds the earlier rounds' two turns
        longest = prompt + 2 * (DEBATE_ROUNDS - 1) * turns
        return longest, config.num_rollouts * longest, config.num_rollouts * (longest + turns), notes
    return prompt, config.num_groups * prompt, config.num_groups * prompt + config.num_rollouts * turns, notes


def plan_memory(config: TrainConfig, device_memory: int | None = None, world_size: int = 1) -> MemoryPlan:
    """The memory plan of a local-backend run of ``config`` (``device_memory``: the device's size in bytes, for a
    plan made elsewhere than on the device; default: this machine's device). A model the trainer runs through
    transformers' forward over padded datums (``engines.decoder.unsupported_reason``: sliding-window attention,
    ...) gets no traced training cost, as in the backend: a note says its activations are not planned.

    ``world_size``: the ranks of a torchrun launch. A full fine-tune is planned for one of them
    (:mod:`rlrunbook.rl.setup.full_plan`); a LoRA plan does not depend on it. ``ConfigError`` below 1."""
    import torch

    from rlrunbook.backend import memory
    from rlrunbook.engines.hf import PREFILL_TOKENS, capacity_bucket
    from rlrunbook.models.shapes import model_shape
    from rlrunbook.rl.setup.conditional_options import settle
    from rlrunbook.rl.setup.service import local_settings

    # lora_rank, train_unembed: null until they apply (the defaults of the options that apply, nothing else checked:
    # scripts plan shapes that no run would validate, such as one row per group)
    config = config.with_values(settle(config))
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be at least 1: the number of torchrun processes "
                          "(--nproc-per-node), 1 for a plain process.")
    full = config.finetune == "full"
    if device_memory is None:  # this machine's device: it must exist
        settings = local_settings(config.backend)
        device_type = torch.device(settings.device).type
        total = memory.device_memory(settings.device)
    else:  # a plan for another machine: the stated device need not exist here
        settings = local_settings(config.backend.model_copy(update={"device": None}))
        device_type = torch.device(config.backend.device or settings.device).type
        total = device_memory
    dtype = settings.dtype or (torch.bfloat16 if device_type == "cuda" else torch.float32)
    shape, source = model_shape(config.model)
    shards = None
    if full:  # every weight trains, sharded; this rank samples and trains its share of the groups
        lora: dict = {"lora_rank": None}
        skeleton = memory.skeleton(shape, dtype, None)
        shards = full_plan.full_shards(skeleton, dtype, world_size, reference=config.loss.kl_coef > 0,
                                       groups=config.num_groups)
        weights, training_state, float64 = shards.reference, shards.state, 0
        config = full_plan.rank_share(config, world_size)
    else:
        lora = {"lora_rank": config.lora_rank, "lora_alpha": settings.lora_alpha,
                "train_unembed": config.train_unembed, "train_attn": True, "train_mlp": True}
        skeleton = memory.skeleton(shape, dtype, config.lora_rank, train_unembed=config.train_unembed)
        sizes = memory.model_bytes(skeleton)
        float64 = sizes.float64_copy if settings.numerics == "exact" else 0
        weights, training_state = sizes.frozen, sizes.training_state
    if config.backend.load_in_4bit:  # NF4 in the layers: half a byte per weight and a float32 scale per 64
        quantised = sum(module.weight.numel() for name, module in skeleton.named_modules()
                        if isinstance(module, torch.nn.Linear) and ".layers." in name and not module.weight.requires_grad)
        weights = weights - quantised * dtype.itemsize + quantised * 9 // 16
    longest, prompt_tokens, batch_tokens, notes = _step_shape(config)
    if shards is not None and shards.reference and settings.numerics == "exact":
        notes.append("exact numerics: the float64 copies of the KL reference's weights are not planned")
    rows = min(config.num_rollouts, settings.max_batch_rows)
    kv = kv_cache = pool = activations = vllm_share = kept = coded = 0
    sampler = settings.sampler
    max_context = getattr(shape, "max_position_embeddings", None)
    if sampler == "hf":
        kv = memory.kv_bytes_per_token(shape, dtype)
        capacity = capacity_bucket(longest + config.max_tokens, max_context)
        row_bucket = max(2, 1 << (rows - 1).bit_length())
        kv_cache = row_bucket * capacity * kv
        absorbed = min(settings.prefix_cache_tokens, rows * config.max_tokens)
        pool = max(prompt_tokens, min(settings.prefix_cache_tokens, prompt_tokens + absorbed)) * kv
        prefill, decode = memory.sampling_transients(shape, dtype, settings.decoder_numerics(),
                                                     prefill_tokens=min(prompt_tokens, PREFILL_TOKENS),
                                                     rows=row_bucket, window=capacity, device_type=device_type)
        activations = max(prefill, decode)
        if device_type == "cpu" and not full and settings.numerics == "invariant" and dtype == torch.float32:
            coded = sizes.coded_copy if settings.coded_weights else 0  # where the engine codes them (an upper bound)
        if (device_type == "cpu" and not full and config.off_policy == 0 and settings.numerics == "invariant"
                and dtype in (torch.float32, torch.bfloat16)):  # where the engine keeps them
            calls = DEBATE_ROUNDS if config.mode == "debate" else 1  # sampling calls under one snapshot
            kept = min(settings.kept_products_mb << 20,
                       calls * (prompt_tokens + row_bucket * config.max_tokens) * kept_row_bytes(shape, dtype))
        shape_text = (f"{rows} rows per sampling call, KV cache {row_bucket} x {capacity} positions "
                      f"({kv / 1024:.1f} KiB per token), prompts <= {longest} tokens, {config.max_tokens} new")
    elif sampler == "vllm":
        if device_type == "cuda" and not settings.vllm.url:
            vllm_share = int(total * settings.vllm.gpu_memory_utilization)
        shape_text = (f"a vLLM server samples ({settings.vllm.gpu_memory_utilization:.0%} of the GPU)"
                      if vllm_share else "a vLLM server samples in its own process")
    else:
        shape_text = "transformers generate samples (its dynamic cache is not planned)"
        notes.append("TINKER_LOCAL_SAMPLER=generate: the sampling side is not planned")
    plan = MemoryPlan(
        device=f"{device_type} ({total / GIB:.1f} GiB{', stated' if device_memory is not None else ''})",
        total=total, model=f"{config.model} ({source})", sampler=sampler, weights=weights,
        training_state=training_state, float64_copy=float64, kv_cache=kv_cache, prefix_pool=pool,
        sampling_activations=activations, vllm_share=vllm_share, micro_batch_tokens=None, recompute_layers=False,
        kept_products=kept, coded_weights=coded,
        training_activations=0, batch_tokens=batch_tokens, shape=shape_text, notes=notes,
        concurrent_snapshots=config.off_policy + 2 if config.off_policy > 0 else 0,
        chunks=max(1, min(settings.grad_accum_chunks, config.num_rollouts)), full=shards)
    available = plan.usable - plan.resident - plan.gradient - (shards.gathered if shards else 0)
    if plan.concurrent_snapshots:  # a micro-batch trains while the sampler holds its activations and snapshots
        available -= plan.sampling_activations + plan.concurrent_snapshots * plan.snapshot
    where = (f"{total / GIB:.1f} GiB {device_type} memory, {available / GIB:.1f} GiB left for a micro-batch "
             "after the weights, the training state and the sampler's caches")
    from dataclasses import replace

    from rlrunbook.engines.decoder import unsupported_reason

    reason = unsupported_reason(skeleton)
    if reason is not None:  # the trainer runs transformers' own forward over padded datums, as the backend does
        notes.append(f"training runs transformers' forward over padded datums ({reason}): its activations are not "
                     "planned")
        return replace(plan, micro_batch_tokens=settings.micro_batch_tokens or None)
    batching = memory.choose_micro_batching(
        shape, dtype, lora, settings.decoder_numerics(), available=max(0, available), device_type=device_type,
        tokens=settings.micro_batch_tokens, checkpointing=settings.activation_checkpointing, where=where,
        refuse=False)
    tokens = min(batch_tokens, batching.tokens or batch_tokens)
    return replace(plan, micro_batch_tokens=batching.tokens, recompute_layers=batching.recompute_layers,
                   training_activations=batching.cost.bytes(tokens))


def format_plan(plan: MemoryPlan) -> list[str]:
    """The plan as lines for a terminal or a log (sizes in GiB)."""
    def gib(size: int) -> str:
        return f"{size / GIB:.2f} GiB"

    lines = [f"device: {plan.device}; usable {gib(plan.usable)}; model: {plan.model}"]
    if plan.full:  # one rank's parts, and how the state is sharded
        lines += full_plan.header_lines(plan.full)
        gathered, gradient = full_plan.sampling_part(plan.full), full_plan.training_part(plan.full)
    else:
        lines.append(f"resident: weights {gib(plan.weights)}, adapter + AdamW {gib(plan.training_state * 3 // 4)}"
                     + (f", float64 copy (exact) {gib(plan.float64_copy)}" if plan.float64_copy else "")
                     + (f", coded weights <= {gib(plan.coded_weights)}" if plan.coded_weights else ""))
        gathered, gradient = "", f"gradient {gib(plan.training_state // 4)}"
    if plan.sampler == "hf":
        lines.append(f"sampling: {plan.shape}; {gathered}KV cache {gib(plan.kv_cache)}, prefix pool "
                     f"{gib(plan.prefix_pool)}, prefill/decode activations {gib(plan.sampling_activations)}"
                     + (f", kept products {gib(plan.kept_products)}" if plan.kept_products else "")
                     + f"; peak {gib(plan.sampling_peak)}")
    else:
        lines.append(f"sampling: {plan.shape}" + (f" ({gib(plan.vllm_share)})" if plan.vllm_share else "")
                     + (f"; {gathered.rstrip(', ')}" if gathered else ""))
    batching = (f"{plan.micro_batch_tokens} tokens" if plan.micro_batch_tokens else "no limit")
    lines.append(f"training: batch ~{plan.batch_tokens} distinct tokens in {plan.micro_batches} micro-batch(es) of "
                 f"{batching}{', activation checkpointing' if plan.recompute_layers else ''}; {gradient}, "
                 f"activations {gib(plan.training_activations)}; peak {gib(plan.training_peak)}")
    lines.append(("fits" if plan.fits else "DOES NOT FIT") + f": peak {gib(plan.peak)} of {gib(plan.usable)} usable"
                 + (" (sampling and training at once: --off-policy)" if plan.concurrent_snapshots else ""))
    lines += [f"note: {note}" for note in plan.notes]
    return lines


def check_fits(plan: MemoryPlan) -> None:
    """``ConfigError`` naming the largest consumer's knob when ``plan`` does not fit its device."""
    if plan.fits:
        return
    peak = plan.peak
    consumers = full_plan.consumers(plan.full, kv_cache=plan.kv_cache, prefix_pool=plan.prefix_pool,
                                    activations=plan.training_activations,
                                    vllm_share=plan.vllm_share) if plan.full else {
        "the decode KV cache": (plan.kv_cache, "fewer rows per sampling call (-n, or TINKER_LOCAL_MAX_BATCH_ROWS) "
                                              "or shorter sequences (--max-tokens, data.max_prompt_tokens), or "
                                              "backend.sampler=vllm"),
        "the prefix pool": (plan.prefix_pool, "a smaller TINKER_LOCAL_PREFIX_CACHE_TOKENS"),
        "the kept products": (plan.kept_products, "a smaller TINKER_LOCAL_KEPT_PRODUCTS_MB (0: none)"),
        "the coded weights": (plan.coded_weights, "TINKER_LOCAL_CODED_WEIGHTS=0"),
        "the weights": (plan.weights + plan.float64_copy, "backend.load_in_4bit (CUDA), bfloat16, a smaller model, "
                                                          "or numerics other than exact"),
        "a micro-batch's activations": (plan.training_activations, "a smaller backend.micro_batch_tokens, or "
                                                                   "backend.activation_checkpointing=on"),
        "the adapter and its optimizer": (plan.training_state, "a smaller --lora-rank"),
        "the vLLM server's share": (plan.vllm_share, "a smaller TINKER_LOCAL_VLLM_GPU_MEMORY_UTILIZATION"),
    }
    name, (size, fix) = max(consumers.items(), key=lambda item: item[1][0])
    ranks = f" with {plan.full.world_size} rank(s) (a full fine-tune, planned per rank)" if plan.full else ""
    same = f" and --world-size {plan.full.world_size}" if plan.full else ""
    raise ConfigError(f"this run does not fit on {plan.device}{ranks}: its planned peak is {peak / GIB:.1f} GiB of "
                      f"{plan.usable / GIB:.1f} GiB usable, and the largest part is {name} ({size / GIB:.1f} GiB). "
                      f"Fix: {fix}. The whole plan: `rlrunbook show-config --memory-plan` with the same "
                      f"arguments{same}.")
