"""The decoder's pass through the fused kernels, where no gradient is recorded (decode steps, prefill, scoring).

:class:`rlrunbook.engines.decoder.Decoder` computes a layer as a chain of fixed-order operations that autograd
can differentiate: about 60 operations per layer of a model with LoRA on its 7 projections (norms, products,
each adapter's four steps, the rotation, the cache writes, the residual adds). Where nothing is differentiated,
:class:`FusedPass` runs the same layer as 8 or 9 calls of :mod:`rlrunbook.kernels.fused`:

    add_rms_norm | q/k/v with LoRA | rotary | attention (cache write included) | o with LoRA | add_rms_norm |
    gate/up with LoRA | silu_mul | down with LoRA

each giving the chain's bits, so the sampler and the trainer still agree bit for bit (the trainer's pass is the
chain). It covers the fixed numerics on CPU for float32 and bfloat16 models without per-head norms (Llama,
Qwen2, Mistral); a projection group it cannot fuse (several adapters on one module, trained base weights) goes
through the chain inside the fused pass.

A decode step over a per-row cache (:class:`~rlrunbook.engines.layouts.RowCache`) makes those calls for every layer
in one (:func:`rlrunbook.kernels.fused.decode_layers`, the same calls in C, the same bits) where every group fuses:
a step of a few rows otherwise paid the Python around 9 calls per layer (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlrunbook.engines.kept_products import GroupKey, group_key
from rlrunbook.engines.lora_groups import adapter_names, adapter_weights
from rlrunbook.engines.stacked_projections import stackable, stacked_weights
from rlrunbook.kernels import fused

_UNFUSABLE = object()


def _adapter(module: torch.nn.Module, pinned) -> tuple[torch.Tensor, torch.Tensor, float] | None | object:
    """A projection's one plain LoRA adapter ``(A, B, scaling)``, ``None`` when it adds none, or ``_UNFUSABLE``."""
    if getattr(module, "base_layer", None) is None:
        return None
    names = adapter_names(module, pinned)
    if not names:
        return None
    name = names[0]
    if len(names) > 1 or name in getattr(module, "lora_variant", {}) or module.lora_B[name].bias is not None:
        return _UNFUSABLE
    a, b = adapter_weights(module, name, pinned)
    return a.detach(), b.detach(), float(module.scaling[name])


class FusedPass:
    """A :class:`~rlrunbook.engines.decoder.Decoder`'s forward pass through fused kernels (see the module docstring).

    Projection groups are prepared once per :meth:`Decoder.weights_fixed` block (one sampling call) and on every
    pass outside one.
    """

    def __init__(self, decoder):
        self.decoder = decoder
        self._groups: dict[tuple[int, ...], tuple[int, fused.LoraLinears | None]] = {}
        self._layer_sets: dict[tuple[int, ...], tuple[int, fused.DecodeLayers | None]] = {}
        self._model_fits: dict[torch.dtype, bool] = {}
        # every layer's groups' keys, in the order the pass runs them, for the layers they were taken with
        self._kept_keys: tuple[fused.DecodeLayers, list[GroupKey]] | None = None

    def applies(self, h_dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a pass on ``device`` with hidden states of ``h_dtype`` can run here now."""
        if not (self.decoder.fixed and fused.applies(h_dtype, device)):
            return False
        fits = self._model_fits.get(h_dtype)
        if fits is None:
            body = self.decoder.lm.model
            norms = [body.norm, *(n for layer in body.layers for n in (layer.input_layernorm,
                                                                        layer.post_attention_layernorm))]
            fits = self._model_fits[h_dtype] = (len(body.layers) > 0 and not hasattr(body.layers[0].self_attn, "q_norm")
                                                and all(norm.weight.dtype == h_dtype for norm in norms))
        return fits

    def group(self, modules: Sequence[torch.nn.Module]) -> fused.LoraLinears | None:
        """``modules`` prepared for :func:`rlrunbook.kernels.fused.lora_linears` (``None``: through the chain)."""
        decoder = self.decoder

        def build() -> fused.LoraLinears | None:
            bases = [getattr(m, "base_layer", m) for m in modules]
            if not stackable(bases):
                return None
            sources = [decoder.pinned] if decoder.row_adapters is None else decoder.row_adapters.slots
            slots = [[_adapter(m, source) for m in modules] for source in sources]
            if any(a is _UNFUSABLE for adapters in slots for a in adapters):
                return None
            weight, bias = stacked_weights(bases)
            # the base weights' short exact form, where they have one (read by the products in their place)
            short = decoder.coded_forms.of(weight, owner=bases[0].weight) if decoder.coded_weights else None
            return fused.LoraLinears.prepare(weight, bias, [b.out_features for b in bases], *slots, coded=short)

        return decoder.per_call(self._groups, modules, build)

    def _layer_groups(self, index: int) -> tuple[tuple[torch.nn.Module, ...], ...]:
        """Layer ``index``'s projection groups in the order its pass runs them: q/k/v, o, gate/up, down."""
        layer = self.decoder.lm.model.layers[index]
        attn, mlp = layer.self_attn, layer.mlp
        return (attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)

    def layers(self) -> fused.DecodeLayers | None:
        """Every layer prepared for :func:`rlrunbook.kernels.fused.decode_layers` (``None``: some group goes through
        the chain, or the layers are not shaped as that call needs), per :meth:`group`'s lifetime."""
        decoder = self.decoder
        body = decoder.lm.model

        def build() -> fused.DecodeLayers | None:
            plans = []
            for index, layer in enumerate(body.layers):
                groups = [self.group(modules) for modules in self._layer_groups(index)]
                if any(group is None for group in groups):
                    return None
                after = body.layers[index + 1].input_layernorm if index + 1 < len(body.layers) else body.norm
                post = layer.post_attention_layernorm
                plans.append(fused.LayerPlan(*groups, (post.weight, post.variance_epsilon),
                                             (after.weight, after.variance_epsilon), layer.self_attn.scaling))
            return fused.DecodeLayers.prepare(plans, decoder.num_heads, decoder.num_kv_heads, decoder.head_dim)

        return decoder.per_call(self._layer_sets, (body,), build)

    def _kept_outputs(self, layers: fused.DecodeLayers, rows: int,
                    dtype: torch.dtype) -> list[torch.Tensor | None] | None:
        """Where a pass through :func:`~rlrunbook.kernels.fused.decode_layers` keeps each group's outputs,
        asked of the decoder's kept products group by group in the order :meth:`linears` would ask (``None``: not
        keeping)."""
        keeping = self.decoder.keeping
        if keeping is None:
            return None
        if self._kept_keys is None or self._kept_keys[0] is not layers:  # once per preparation, not per step
            self._kept_keys = (layers, [group_key(modules) for index in range(len(layers.plans))
                                        for modules in self._layer_groups(index)])
        widths = layers.group_widths
        return [keeping.buffer(key, rows, widths[at % 4], dtype) for at, key in enumerate(self._kept_keys[1])]

    def linears(self, modules: Sequence[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
        """The projections' outputs side by side, ``[N, sum of out_features]``."""
        group = self.group(modules)
        if group is not None:
            rows, keeping = self.decoder.row_adapters, self.decoder.keeping
            base = (None if keeping is None
                    else keeping.buffer(group_key(modules), x.shape[0], group.weight.shape[0], x.dtype))
            return fused.lora_linears(x, group, None if rows is None else rows.bounds, base)
        outputs = self.decoder.linears(modules, x)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    def _attend(self, index: int, qkv: torch.Tensor, layout, scale: float) -> torch.Tensor:
        decoder = self.decoder
        heads, kv_heads, dim = decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
        packed = getattr(layout, "attend_packed", None)
        if packed is not None:
            return packed(index, qkv, heads, kv_heads, dim, scale)
        n = qkv.shape[0]
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        return layout.attend(index, q.view(n, heads, dim), k.view(n, kv_heads, dim), v.view(n, kv_heads, dim),
                             scale, decoder.attention_core)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, layout) -> torch.Tensor:
        """Final-norm hidden states ``[N, E]``, bitwise those of the decoder's chain (see ``Decoder.hidden``). Where
        the decoder is :attr:`~rlrunbook.engines.decoder.Decoder.keeping` products, the pass's projection outputs are
        kept as one pass of it (:mod:`rlrunbook.engines.kept_products`)."""
        keeping = self.decoder.keeping
        if keeping is None:
            return self._hidden(ids, positions, layout)
        keeping.begin()  # a pass that raises is never ended: the next begin() drops what it kept
        hidden = self._hidden(ids, positions, layout)
        keeping.end()
        return hidden

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, layout) -> torch.Tensor:
        decoder = self.decoder
        body = decoder.lm.model
        h = body.embed_tokens(ids)
        cos, sin = decoder._rope.lookup(positions, h.dtype, getattr(layout, "position_bound", None))
        layers = body.layers
        first = layers[0].input_layernorm
        x = fused.rms_norm(h, first.weight, first.variance_epsilon)
        all_layers = getattr(layout, "decode_layers", None)  # a decode step over a per-row cache: one call
        prepared = None if all_layers is None else self.layers()
        if prepared is not None and prepared.dtype == h.dtype:
            rows = decoder.row_adapters
            return all_layers(h, x, prepared, cos, sin, None if rows is None else rows.bounds,
                              self._kept_outputs(prepared, h.shape[0], h.dtype))
        for index, layer in enumerate(layers):
            qkv_group, o_group, gate_up_group, down_group = self._layer_groups(index)
            qkv = self.linears(qkv_group, x)
            fused.rotary_(qkv, decoder.num_heads + decoder.num_kv_heads, decoder.head_dim, cos, sin)
            out = self.linears(o_group, self._attend(index, qkv, layout, layer.self_attn.scaling))
            norm = layer.post_attention_layernorm
            h, x = fused.add_rms_norm(h, out, norm.weight, norm.variance_epsilon)
            act = fused.silu_mul(self.linears(gate_up_group, x))
            norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else body.norm
            h, x = fused.add_rms_norm(h, self.linears(down_group, act), norm.weight, norm.variance_epsilon)
        return x
