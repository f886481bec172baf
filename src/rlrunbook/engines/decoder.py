"""One forward pass of a decoder-only transformer, shared by the sampler and the trainer.

The sampler's cached one-token decode steps and the trainer's full-sequence pass call the same
functions on the same modules of the (possibly LoRA-wrapped) transformers model, so the two can
only differ where a kernel's order of summation does; the default numerics leave no such kernel (below).

Tokens are laid out flat (``[N]`` ids with their ``[N]`` positions): the projections, norms and MLP
see every token as one row of one matrix, and attention is left to a :class:`KeyValueLayout`, which
knows which earlier tokens each token may read: a shared prompt computed once (prefix sharing), a
per-row KV cache (decoding), or a pool of cached prefixes. Under ``exact`` and ``native`` numerics every
row-wise operation is computed with at least two rows (a single row may take a different matrix-vector
kernel that rounds differently).

Numerics (``Numerics``):

- ``invariant`` (default): every sum that reaches a logprob in an order fixed by the code, in the
  model's dtype with float32 accumulation (:mod:`rlrunbook.kernels`: the products with base weights and
  LoRA factors, RMSNorm's statistics, the rotary tables, SiLU's exponential, the attention core, the
  output layer and its log-sum-exp). A token's numbers then depend on its own tokens and the weights
  only, whatever the batch, the layout of its keys, the thread count or the CPU's libraries: the
  sampler's decode step and the trainer's pass agree bit for bit, on CPU and CUDA. Float64 models use
  PyTorch's kernels (their rounding step is far below any gate).
- ``exact``: every matrix product, RMSNorm statistic and the attention core accumulated in float64 and
  rounded once to the model's dtype: a reference that needs no fixed order, at 8 bytes per weight and
  float64 speed.
- ``native``: the model's dtype and PyTorch's kernels (SDPA), as transformers computes (the reference
  the other two are measured against).

Projections that read the same input (q/k/v, gate/up) with frozen base weights run as one product over
their stacked weights (:mod:`rlrunbook.engines.stacked_projections`; each output column is the same sum, so the
same bits). Inside :meth:`Decoder.weights_fixed` (one sampling call) a float32 model on CPU under
``native`` numerics also adds the LoRA updates of each group with stacked factors
(:mod:`rlrunbook.engines.lora_groups`, equal to fp32 rounding).

Supported: the Llama, Qwen2, Qwen3 and Mistral families (RMSNorm, rotary positions with a static
frequency table, grouped-query attention, gated MLP), plain or with peft LoRA adapters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rlrunbook.engines.attention import device_kind
from rlrunbook.engines.coded_forms import coded_forms
from rlrunbook.engines.float64_weights import float64_weights
from rlrunbook.engines.fused_pass import FusedPass
from rlrunbook.engines.kept_products import GroupKey, KeptProducts, group_key
from rlrunbook.engines.lora_groups import (
    GroupFactors,
    adapter_names,
    adapter_weights,
    add_group_updates,
    group_factors,
)
from rlrunbook.engines.pinned_adapter import PinnedAdapter, RowAdapters
from rlrunbook.engines.sharded_layers import is_sharded, through
from rlrunbook.engines.stacked_projections import stackable, stacked_weights
from rlrunbook.errors import ConfigError
from rlrunbook.kernels import ops as fixed
from rlrunbook.kernels.coded_weights import FEW_ROWS, CodedWeight, gemm_nt_coded

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
NUMERICS = ("invariant", "exact", "native")
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FIXED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # computed by the fixed-order kernels


def quantised_weights(model: torch.nn.Module) -> str | None:
    """The first linear layer of ``model`` whose weight is not in a dtype ``F.linear`` computes with, described
    (``None``: there is none).

    Quantised layers (bitsandbytes' ``Linear4bit`` with packed uint8 weights, ``Linear8bitLt`` with int8, float8
    weights) subclass ``nn.Linear`` but hold weights that only their own ``forward`` can use.
    """
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        quantised = isinstance(weight, torch.Tensor) and weight.dtype not in _COMPUTE_DTYPES
        if isinstance(module, torch.nn.Linear) and quantised:
            return f"{name} ({type(module).__name__}, {str(weight.dtype).removeprefix('torch.')} weight)"
    return None


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why :class:`Decoder` cannot run ``model`` (``None`` when it can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types) or (
            getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)):
        return "sliding-window attention is not implemented"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in _STATIC_ROPE_TYPES:
        return f"rope_type {rope!r} changes its frequencies with the sequence length"
    quantised = quantised_weights(model)
    if quantised is not None:
        return (f"its base weights are quantised (first: {quantised}), and this engine computes with floating-point "
                "weights (transformers generate samples on the same quantised weights; the trainer scores them "
                "with transformers' forward)")
    return None


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers ``*ForCausalLM`` of ``model`` (inside a peft wrapper, if any)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class KeyValueLayout(Protocol):
    """Where each layer's keys and values go and which of them each flat token attends to."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               core: str) -> torch.Tensor:
        """Store this layer's ``k``, ``v`` (``[N, Hkv, D]``) and attend with ``q`` (``[N, H, D]``) → ``[N, H*D]``
        through attention ``core`` (see :func:`rlrunbook.engines.attention.attend`)."""


@dataclass(frozen=True)
class Numerics:
    """How a forward pass rounds; see the module docstring."""

    name: str = "invariant"

    def __post_init__(self) -> None:
        if self.name not in NUMERICS:
            raise ConfigError(f"numerics {self.name!r} must be one of {NUMERICS} "
                              "(TINKER_LOCAL_NUMERICS; 'invariant' is the default).")

    @property
    def float64_matmuls(self) -> bool:
        return self.name == "exact"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions applied to ``[..., D]`` ``x`` with ``cos``, ``sin`` broadcast to it, as transformers does."""
    return x * cos + _rotate_half(x) * sin


def fixed_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm under fixed numerics: the mean of squares as a fixed-order sum, then transformers' elementwise steps
    (``x * rsqrt(mean + eps)`` in float32, rounded to ``x``'s dtype, times ``weight``)."""
    x32 = x.float()
    mean = fixed.row_sumsq(x32)[..., None] / x.shape[-1]
    return weight * (x32 * torch.rsqrt(mean + eps)).to(x.dtype)


def layer_kernels(device: torch.device) -> bool:
    """Whether a fixed-numerics pass on ``device`` computes its norms, rotations and LoRA additions as single kernels
    (:func:`rlrunbook.kernels.ops.layer_kernels`: on CUDA, and in a memory plan for CUDA), rather than as the chain of
    operations the C kernels compute (and fuse where no gradient is recorded, :mod:`rlrunbook.engines.fused_pass`)."""
    if device.type == "meta":
        return device_kind(device) == "cuda"
    return fixed.layer_kernels(device)


def lora_added_applies(result: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a fixed-numerics pass adds a LoRA update (second factor ``b`` ``[N, r]``) to its base ``result`` in one
    kernel (:func:`rlrunbook.kernels.ops.lora_added_applies`: on CUDA; on CPU up to rank ``SMALL_K``, float32 and
    bfloat16), rather than as a product then :func:`rlrunbook.kernels.ops.add_scaled`; a memory plan on the meta
    device answers for the device it plans."""
    if result.dtype not in (torch.float32, torch.bfloat16) or b.dtype not in (torch.float32, torch.bfloat16):
        return False
    if result.device.type == "meta":
        kind = device_kind(result.device)
        return kind == "cuda" or (kind == "cpu" and b.shape[1] <= fixed.SMALL_K)
    return fixed.lora_added_applies(result.device, b.shape[1])


def gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's ``silu(gate) * up`` under fixed numerics (silu from the fixed-order sigmoid): the op that keeps
    only gate and up, one kernel each way (:func:`rlrunbook.kernels.ops.silu_mul`)."""
    return fixed.silu_mul(gate, up)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rotate(x, cos, sin)`` for ``[N, H, D]`` ``x`` and ``[N, D]`` ``cos``, ``sin`` under fixed numerics: one kernel
    where :func:`layer_kernels` says so, one C pass each way with the chain's bits on CPU, else the chain."""
    if (layer_kernels(x.device) and cos.dtype == x.dtype) or fixed.rotation_applies(x, cos):
        return fixed.rotary(x, cos, sin)
    return rotate(x, cos[:, None, :], sin[:, None, :])


def _at_least_two_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a ``[M, ...]`` input, computed with ``M >= 2`` rows (see the module docstring)."""
    if x.shape[0] != 1:
        return fn(x)
    return fn(torch.cat([x, x]))[:1]


@dataclass
class _GroupPlan:
    """How :meth:`Decoder.linears` computes one group of projections."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: list[int]
    bases: list[torch.nn.Linear]
    factors: GroupFactors | None


class Decoder:
    """The forward pass of a supported causal LM (plain or LoRA-wrapped), module by module.

    ``model`` is read at call time, so adapter weights changed in place (an optimizer step, a
    sampler snapshot) and peft's ``disable_adapter()`` take effect on the next call.
    """

    def __init__(self, model: torch.nn.Module, numerics: Numerics | str = "invariant"):
        reason = unsupported_reason(causal_lm(model))
        if reason is not None:
            raise ConfigError(f"the in-process engine cannot run this model: {reason}. "
                              "Use TINKER_LOCAL_SAMPLER=generate (transformers generate, any causal LM) or vllm.")
        self.model = model
        self.numerics = numerics if isinstance(numerics, Numerics) else Numerics(numerics)
        config = causal_lm(model).config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.vocab_size = config.vocab_size
        self._float64 = float64_weights(model)  # one cache per model: the sampler's and the trainer's decoders share it
        self.coded_forms = coded_forms(model)  # the same: frozen float32 weights' short exact forms (coded_weights)
        weight = self.lm.model.embed_tokens.weight
        # The dtype passes compute in, fixed here: full-parameter training may keep float32 master weights
        # (sharded, backend/sharding.py) and gather them in this dtype for each pass.
        self._dtype = weight.dtype
        # The fixed-order kernels: invariant numerics on a float32, bfloat16 or float16 model (CPU, CUDA, or the
        # meta device of a memory plan).
        self.fixed = self.numerics.name == "invariant" and weight.dtype in _FIXED_DTYPES
        self.attention_core = "fixed" if self.fixed else "float64" if self.numerics.name == "exact" else "sdpa"
        if self.fixed and getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"invariant numerics compute SiLU MLPs; this model's hidden_act is "
                              f"{config.hidden_act!r}. Use TINKER_LOCAL_NUMERICS=native or exact.")
        self._rope = None
        if self.fixed:
            rotary = self.lm.model.rotary_emb
            self._rope = fixed.RopeTable(rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0))
        # Grouped LoRA updates (inside weights_fixed): only where the sampler may round differently from the
        # trainer (native numerics of a float32 CPU model); not under CUDA graphs (a replay would not see
        # factors rebuilt for new weights).
        self.grouped_adapters = (weight.device.type == "cpu" and weight.dtype == torch.float32
                                 and self.numerics.name == "native")
        self._plans: dict[tuple[int, ...], tuple[int, _GroupPlan | None]] = {}  # per weights_fixed epoch
        self._epoch = 0
        self._fixed_depth = 0
        # Where set (a sampling engine's call), LoRA factors and whether the adapter is on are read from these
        # engine-owned copies, not from the modules the trainer updates (engines/pinned_adapter.py).
        self.pinned: PinnedAdapter | None = None
        # Where set (a decode step of several samplers' rows), each row's LoRA factors come from its slot's pinned
        # copies instead (engines/pinned_adapter.py RowAdapters); passes that compute no gradient only.
        self.row_adapters: RowAdapters | None = None
        # Where set (a sampling call of the CPU engine), passes through the fused kernels keep their projections'
        # outputs in it; where known_products is set (the trainer's pass over tokens a sampling call kept), linears()
        # reads a group's outputs from it instead of computing them (engines/kept_products.py).
        self.keeping: KeptProducts | None = None
        self.known_products: Mapping[GroupKey, torch.Tensor] | None = None
        self._fused = FusedPass(self)

    # Passes that record no gradient go through the fused kernels (engines/fused_pass.py) where they apply;
    # False: always the chain of operations the trainer differentiates (the same bits, more operations).
    use_fused = True
    # Where no gradient is recorded, the fused kernels' base products and the output layer's of a few rows read a
    # frozen float32 weight from its short exact form where it has one (kernels/coded_weights.py: fewer bytes from
    # memory, the same values); False: always from the float32 weight (the same bits). Set per engine
    # (HFSamplingEngine's coded_weights, TINKER_LOCAL_CODED_WEIGHTS).
    coded_weights = True

    def adapter_state(self) -> tuple:
        """What decides which adapters a pass adds, for caches keyed by it (captured graphs)."""
        if self.row_adapters is not None:  # which row takes which slot is data (a graph input), not state
            return ("rows", self.row_adapters.state())
        if self.pinned is not None:  # a graph reads the buffers of the pinned copy it was captured over
            return ("pinned", id(self.pinned), self.pinned.enabled)
        lora = next((m for m in self.model.modules() if hasattr(m, "lora_A")), None)
        return ("live", lora is not None and bool(lora.disable_adapters))

    @property
    def lm(self) -> torch.nn.Module:
        """The transformers ``*ForCausalLM`` (inside the peft wrapper, if any)."""
        return causal_lm(self.model)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (its weights' when the decoder was made)."""
        return self._dtype

    # -- matrix products -------------------------------------------------------------------------
    def _frozen_float64(self, weight: torch.Tensor) -> torch.Tensor:
        """The float64 copy of a frozen base weight, made once per model (:mod:`rlrunbook.engines.float64_weights`)."""
        return self._float64.of(weight)

    def _product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` as these numerics compute it (``out_dtype``: the result's dtype,
        by default ``x``'s)."""
        if self.fixed:
            return fixed.linear(x, weight, bias, out_dtype)
        if not self.numerics.float64_matmuls:
            out = F.linear(x, weight, bias)
            return out if out_dtype is None else out.to(out_dtype)
        weight = self._frozen_float64(weight) if not weight.requires_grad else weight.double()
        bias = None if bias is None else bias.double()
        return F.linear(x.double(), weight, bias).to(out_dtype or x.dtype)

    def linear(self, module: torch.nn.Module, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``module(x)`` for an ``nn.Linear`` or a peft LoRA ``Linear`` (active adapters applied as peft does);
        ``out_dtype``: the base product's result dtype (default ``x``'s)."""
        base = getattr(module, "base_layer", None)
        if base is None:
            if not isinstance(module, torch.nn.Linear):
                raise ConfigError(f"{type(module).__name__} is not a linear layer this engine can run; "
                                  "use TINKER_LOCAL_SAMPLER=generate or vllm.")
            return self._product(x, module.weight, module.bias, out_dtype)
        return self._with_adapters(module, self.linear(base, x, out_dtype), x)

    def linears(self, modules: Sequence[torch.nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
        """``[self.linear(m, x) for m in modules]`` for projections reading the same ``x``.

        Where their base weights are frozen (LoRA) the base products run as one product over the
        stacked weights (:mod:`rlrunbook.engines.stacked_projections`); float64 (``exact``) products and trained
        base weights go module by module. Inside :meth:`weights_fixed`, a float32 model on CPU computing
        no gradient adds the group's LoRA updates with stacked factors (:mod:`rlrunbook.engines.lora_groups`).
        Where :attr:`known_products` holds the group's outputs for these rows and :meth:`reads_known_outputs` holds,
        they are read, not computed: the pass then computes only each adapter's first product (which its backward
        keeps), and the backward is the computing pass's.
        """
        plan = self._group_plan(modules)
        if plan is None:
            return [self.linear(m, x) for m in modules]
        known = (self.known_products.get(group_key(modules))
                 if self.known_products is not None and self.reads_known_outputs(modules, x) else None)
        if known is not None and known.shape[0] == x.shape[0]:
            # the group's base product's backward (the value, which it never reads, is the outputs'); then each
            # adapter's, its value the known output
            outputs = fixed.split_columns(fixed.linear_known(x, plan.weight, plan.bias, known), plan.sizes)
            return [o if m is base else self._adapters_added(m, o, x, self.pinned, o)
                    for m, base, o in zip(modules, plan.bases, outputs)]
        base = self._product(x, plan.weight, plan.bias)
        outputs = fixed.split_columns(base, plan.sizes)
        if plan.factors is not None and not torch.is_grad_enabled():
            add_group_updates(outputs, x, plan.factors)
            return list(outputs)
        return [o if m is base else self._with_adapters(m, o, x)
                for m, base, o in zip(modules, plan.bases, outputs)]

    @contextmanager
    def weights_fixed(self) -> Iterator[None]:
        """A block in which the model's weights and adapter state do not change (one sampling call).

        Inside it each projection group's stacked weights and LoRA factors are looked up once, on first
        use, instead of on every pass (the look-up checks every module of the group: Python work that a
        decode step would otherwise pay for every group of every layer), and on a float32 CPU model the
        LoRA updates are computed group by group (:mod:`rlrunbook.engines.lora_groups`). Changing weights
        inside the block is not seen by it.
        """
        if self._fixed_depth == 0:
            self._epoch += 1
        self._fixed_depth += 1
        try:
            yield
        finally:
            self._fixed_depth -= 1

    def _factor_source(self) -> tuple:
        """Where the LoRA factors of a pass come from now: the live modules, one pinned copy, or several."""
        if self.row_adapters is not None:
            return tuple(map(id, self.row_adapters.slots))
        return (id(self.pinned),)

    def per_call(self, cache: dict, modules: Sequence[torch.nn.Module], build: Callable[[], object]):
        """``build()`` for a projection group, kept in ``cache`` for the rest of the current :meth:`weights_fixed`
        block (one sampling call; per source of LoRA factors: one call may prefill each sampler's prompts with its
        own adapter, then decode their rows together); outside a block it is built on every use."""
        key = (tuple(map(id, modules)), self._factor_source())
        if self._fixed_depth:
            epoch, value = cache.get(key, (None, None))
            if epoch == self._epoch:
                return value
        value = build()
        if self._fixed_depth:
            cache[key] = (self._epoch, value)
        return value

    def _group_plan(self, modules: Sequence[torch.nn.Module]) -> _GroupPlan | None:
        """The stacked weights (and, inside :meth:`weights_fixed`, LoRA factors) of a group; ``None``:
        go module by module."""
        def build() -> _GroupPlan | None:
            bases = [getattr(m, "base_layer", m) for m in modules]
            if self.numerics.float64_matmuls or not stackable(bases):
                return None
            weight, bias = stacked_weights(bases)
            factors = (group_factors(modules, self.pinned)
                       if self.grouped_adapters and self._fixed_depth and self.row_adapters is None else None)
            return _GroupPlan(weight, bias, [b.out_features for b in bases], bases, factors)

        return self.per_call(self._plans, modules, build)

    def _with_adapters(self, module: torch.nn.Module, result: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A peft LoRA module's output from its base layer's ``result`` on input ``x``.

        With :attr:`row_adapters`, each slot's update is computed over every row and kept for that slot's rows
        only (``torch.where`` on the rows' slots: shapes that do not change as rows change slots, for captured
        graphs): a row gets its base result plus its own adapter's update, the bits it gets alone (every product
        is row-wise), whatever the other slots compute."""
        rows = self.row_adapters
        if rows is None:
            return self._adapters_added(module, result, x, self.pinned)
        if torch.is_grad_enabled() or x.shape[0] != rows.rows:
            raise RuntimeError(f"several adapters over {rows.rows} rows in a pass of {x.shape[0]} rows "
                               f"(grad {torch.is_grad_enabled()}): only a decode step computes them")
        base = result
        for index, slot in enumerate(rows.slots):
            added = self._adapters_added(module, base, x, slot)
            if added is not base:
                result = torch.where((rows.row_slot == index)[:, None], added, result)
        return result

    def _adapters_added(self, module: torch.nn.Module, result: torch.Tensor, x: torch.Tensor,
                        pinned: PinnedAdapter | None, known: torch.Tensor | None = None) -> torch.Tensor:
        """``result`` with ``module``'s adapters added as peft adds them; ``known``: the sum's value, computed before
        bit for bit, returned with the same backward (only where :meth:`reads_known_logits` or
        :meth:`reads_known_outputs` holds: at most one adapter, added by one kernel)."""
        result_dtype = result.dtype
        for name in adapter_names(module, pinned):
            if name in getattr(module, "lora_variant", {}):
                raise ConfigError(f"LoRA variant {type(module.lora_variant[name]).__name__} (DoRA, ...) "
                                  "is not supported by this engine; use plain LoRA.")
            a, b = adapter_weights(module, name, pinned)
            scaling = module.scaling[name]
            if self.numerics.float64_matmuls:
                delta = F.linear(F.linear(x.double(), a.double()), b.double()) * scaling
                result = (result.double() + delta).to(result_dtype)
            elif self.fixed and a.dtype == b.dtype and lora_added_applies(result, b):  # the second product, the sum
                xa = (fixed.linear_float32(x, a)  # x read as float32 by the layer kernels
                      if layer_kernels(x.device) and a.dtype == torch.float32 and x.dtype != a.dtype
                      else fixed.linear(x.to(a.dtype), a))
                result = fixed.lora_added(result, xa, b, scaling, known)  # one kernel
            elif self.fixed:  # peft's order of operations, each product in fixed order
                delta = fixed.linear(fixed.linear(x.to(a.dtype), a), b)
                result = fixed.add_scaled(result, delta, scaling).to(result_dtype)
            else:  # peft: x cast to the adapter's dtype, result + lora_B(lora_A(x)) * scaling, cast back
                delta = F.linear(F.linear(x.to(a.dtype), a), b) * scaling
                result = (result + delta).to(result_dtype)
        return result

    # -- the pieces of a layer --------------------------------------------------------------------
    def _norm(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm: fp32 statistics (float64 for a float64 model, and under ``exact`` numerics),
        weight applied in the input dtype.

        Under ``exact`` the mean of squares is a float64 sum rounded once, like the products: on CUDA the
        reduction's thread layout follows the number of rows (a 2-row decode step and a 500-row training pass
        add a row's squares in different orders), which in float32 can move the rounded result by an ulp.
        """
        if self.fixed:
            if layer_kernels(x.device) and norm.weight.dtype == x.dtype:
                return fixed.rms_norm(x, norm.weight, norm.variance_epsilon)
            return fixed_norm(x, norm.weight, norm.variance_epsilon)
        stats_dtype = torch.float64 if self.numerics.float64_matmuls else torch.promote_types(x.dtype, torch.float32)
        x32 = x.to(stats_dtype)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * x32.to(x.dtype)

    def _attention(self, index: int, layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, layout: KeyValueLayout) -> torch.Tensor:
        attn = layer.self_attn
        n = x.shape[0]
        q, k, v = self.linears((attn.q_proj, attn.k_proj, attn.v_proj), x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
            q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
        if self.fixed:
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        else:
            cos, sin = cos[:, None, :], sin[:, None, :]  # [N, 1, D]
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = layout.attend(index, q, k, v, attn.scaling, self.attention_core)  # [N, H*D]
        return self.linears((attn.o_proj,), out)[0]

    def _mlp(self, mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linears((mlp.gate_proj, mlp.up_proj), x)
        act = gated(gate, up) if self.fixed else mlp.act_fn(gate) * up
        return self.linears((mlp.down_proj,), act)[0]

    # -- the whole pass ---------------------------------------------------------------------------
    def _layer(self, index: int, layer: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               layout: KeyValueLayout) -> torch.Tensor:
        h = h + self._attention(index, layer, self._norm(layer.input_layernorm, h), cos, sin, layout)
        return h + self._mlp(layer.mlp, self._norm(layer.post_attention_layernorm, h))

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, layout: KeyValueLayout,
               recompute_layers: bool = False) -> torch.Tensor:
        """Final-norm hidden states ``[N, E]`` of flat tokens ``ids`` (``[N]``) at ``positions`` (``[N]``).

        ``recompute_layers`` (when recording gradients): each decoder layer keeps only its input for the
        backward pass and recomputes the rest there (activation checkpointing): the pass then holds
        ``layers x N x E`` values instead of every layer's activations, for one more forward in backward.
        """
        if ids.shape[0] == 1 and not self.fixed:  # one token: as two identical rows (see _at_least_two_rows)
            return self.hidden(ids.repeat(2), positions.repeat(2), _FirstOfTwo(layout), recompute_layers)[:1]
        body = self.lm.model
        # Sharded weights (full-parameter training) are gathered layer by layer through each layer's own call;
        # the fused pass reads every weight directly, so it runs only where they are all in place.
        sharded = len(body.layers) > 0 and is_sharded(body.layers[0])
        if self.use_fused and not sharded and self._fused.applies(body.embed_tokens.weight.dtype, ids.device):
            return self._fused.hidden(ids, positions, layout)
        h = body.embed_tokens(ids)  # [N, E]
        if self._rope is not None:  # a table computed once per position: the same values in any batch
            cos, sin = self._rope.lookup(positions, h.dtype, getattr(layout, "position_bound", None))  # [N, D] each
        else:
            cos, sin = body.rotary_emb(h, positions[None])  # [1, N, D] each, in h's dtype
            cos, sin = cos[0], sin[0]
        recompute = recompute_layers and torch.is_grad_enabled()
        for index, layer in enumerate(body.layers):
            if recompute:
                h = checkpoint(through, layer, self._layer, index, layer, h, cos, sin, layout, use_reentrant=False)
            else:
                h = through(layer, self._layer, index, layer, h, cos, sin, layout)
        return self._norm(body.norm, h)

    def logits(self, hidden: torch.Tensor, known: torch.Tensor | None = None) -> torch.Tensor:
        """Output-layer logits ``[M, V]`` of final hidden states ``[M, E]``, in float32 (float64 for a float64 model).

        Under fixed numerics the products accumulate in float32 and are kept in float32 (not rounded to a
        half-precision model's dtype first).

        ``known`` (``[M, V]`` float32, where :meth:`reads_known_logits`): these logits, computed before from the same
        hidden states and weights bit for bit (the sampler's kept logits, :mod:`rlrunbook.engines.kept_products`),
        returned instead of computed, with the backward of the computing pass (the output layer's and its adapter's
        gradients, which read neither the logits nor the base product).
        """
        if known is not None:
            if not self.reads_known_logits(hidden):
                raise RuntimeError("Decoder.logits: known logits for an output layer it cannot read them for "
                                   "(see Decoder.reads_known_logits)")
            head = self.lm.lm_head
            base = getattr(head, "base_layer", head)
            result = fixed.linear_known(hidden, base.weight, None, known)
            return result if base is head else self._adapters_added(head, result, hidden, self.pinned, known)
        if self.fixed:
            head = self.lm.lm_head
            base = getattr(head, "base_layer", head)
            short = self._coded_head(base, hidden)
            if short is None:
                return self.linear(head, hidden, torch.float32).float()
            result = gemm_nt_coded(hidden, short, base.bias)
            return (result if base is head else self._with_adapters(head, result, hidden)).float()
        logits = _at_least_two_rows(lambda x: self.linear(self.lm.lm_head, x), hidden)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def _coded_head(self, base: torch.nn.Module, hidden: torch.Tensor) -> CodedWeight | None:
        """The output layer's weight in its short exact form, where a product over it may read that: no gradient
        recorded, a few float32 hidden states on CPU (at most ``FEW_ROWS``), a frozen float32 weight that has one."""
        if (not self.coded_weights or torch.is_grad_enabled() or hidden.dtype != torch.float32
                or hidden.device.type != "cpu" or hidden.dim() != 2 or hidden.shape[0] > FEW_ROWS
                or hidden.stride(-1) != 1
                or not isinstance(base, torch.nn.Linear)):
            return None
        return self.coded_forms.of(base.weight)

    def _adds_in_one_kernel(self, module: torch.nn.Module, result: torch.Tensor) -> bool:
        """Whether ``module`` adds to a result like ``result`` at most one plain LoRA adapter, by one kernel
        (:meth:`_adapters_added`'s ``known`` path, whose backward a known sum then takes)."""
        if getattr(module, "base_layer", module) is module:
            return True
        names = adapter_names(module, self.pinned)
        if not names:
            return True
        if len(names) > 1 or names[0] in getattr(module, "lora_variant", {}):
            return False
        a, b = adapter_weights(module, names[0], self.pinned)
        return a.dtype == b.dtype and lora_added_applies(result, b)

    def reads_known_outputs(self, modules: Sequence[torch.nn.Module], x: torch.Tensor) -> bool:
        """Whether :meth:`linears` can read known outputs of the group ``modules`` over ``x``: fixed numerics, one
        adapter source for every row, stacked base weights of ``x``'s dtype, and each projection adding at most one
        plain LoRA adapter, by one kernel (whose backward the known value then takes; other projections compute)."""
        if not self.fixed or self.numerics.float64_matmuls or self.row_adapters is not None:
            return False
        return all(getattr(m, "base_layer", m).weight.dtype == x.dtype and self._adds_in_one_kernel(m, x)
                   for m in modules)

    def reads_known_logits(self, hidden: torch.Tensor) -> bool:
        """Whether :meth:`logits` can read known logits of ``hidden``: fixed numerics, one adapter source for every
        row, and an output layer of ``hidden``'s dtype that is a bias-free linear layer adding at most one plain LoRA
        adapter, by one kernel."""
        head = self.lm.lm_head
        base = getattr(head, "base_layer", head)
        if (not self.fixed or self.row_adapters is not None or type(base) is not torch.nn.Linear
                or base.bias is not None or base.weight.dtype != hidden.dtype):
            return False
        return self._adds_in_one_kernel(head, base.weight.new_empty(0, dtype=torch.float32))

    @property
    def head_frozen(self) -> bool:
        """Whether the output layer is a plain linear layer without bias whose weight is not trained, computed by the
        fixed-order kernels: :meth:`frozen_head_logprobs` then gives :meth:`logits`' logprobs."""
        head = self.lm.lm_head
        return (self.fixed and type(head) is torch.nn.Linear and head.bias is None
                and not head.weight.requires_grad)

    def frozen_head_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor,
                             logits: torch.Tensor | None = None) -> torch.Tensor:
        """``log_softmax_at(logits(hidden), targets)`` with the same bits, whose backward reads ``[M, E]`` floats kept
        by the forward instead of the logits (``rlrunbook.kernels.ops.frozen_head_logprobs``); needs
        :attr:`head_frozen`."""
        return fixed.frozen_head_logprobs(hidden, self.lm.lm_head.weight, targets, logits)

    def log_softmax_at(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``log_softmax(logits, -1)`` at ``targets`` (float32 ``[M, V]`` logits, ``[M]`` targets) as these numerics
        compute it: the fixed-order log-sum-exp under ``invariant``, PyTorch's otherwise."""
        if self.fixed:
            return fixed.log_softmax_at(logits, targets)
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


class _FirstOfTwo:
    """Wraps a layout for a one-token pass run as two copies of the token: only the first is real."""

    def __init__(self, layout: KeyValueLayout):
        self.layout = layout

    def attend(self, layer, q, k, v, scale, core):
        out = self.layout.attend(layer, q[:1], k[:1], v[:1], scale, core)
        return torch.cat([out, out])
