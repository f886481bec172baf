"""What one gradient-accumulation chunk of datums needs from the model, computed two ways.

:class:`SharedPrefixScoring` (every model the in-process engine runs) goes through
:class:`~rlrunbook.engines.shared_prefix.SharedPrefixScorer`: the sampler's own forward, each
distinct prefix once, the output layer only at asked positions. :class:`PaddedScoring` is the plain
transformers pass over right-padded datums, for models that forward does not cover (and the
reference the first is tested against). Both return :class:`ChunkScores` with the same meaning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rlrunbook.backend import sharding
from rlrunbook.engines.decoder import Decoder, Numerics
from rlrunbook.engines.filters import SamplingFilters, apply_filters
from rlrunbook.engines.kept_products import KeptProducts
from rlrunbook.engines.layouts import take_rows
from rlrunbook.engines.scoring import gather_logprobs
from rlrunbook.engines.shared_prefix import SharedPrefixScorer
from rlrunbook.regularizers import token_entropy
from rlrunbook.tokens import pad_batch


class ScoredItem(Protocol):
    """A datum as the trainer holds it: ``input_tokens`` (L), ``targets`` and ``mask`` ``[L]``."""

    input_tokens: list[int]
    targets: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class ChunkScores:
    """Scores of a chunk. ``seen`` positions are those the loss reads (``item.mask``), concatenated datum
    by datum; ``per_datum`` are the logprobs of every target position, returned to the caller."""

    per_datum: list[torch.Tensor]  # [L_i] float32, detached
    seen_logprobs: torch.Tensor  # (N,) T = 1, differentiable
    seen_sampling_logprobs: torch.Tensor  # (N,) under the sampler's transform, detached
    seen_entropy: torch.Tensor | None  # (N,) differentiable, when asked for
    seen_reference: torch.Tensor | None  # (N,) the reference (base) model, no grad, when asked for
    anchor: torch.Tensor  # a differentiable scalar of the pass (0 * it keeps an empty chunk's graph)


class ChunkScoring(Protocol):
    def score(self, chunk: Sequence[ScoredItem], filters: SamplingFilters, with_entropy: bool,
              with_reference: bool, recompute: bool | None = None, last: bool = False) -> ChunkScores: ...


class SharedPrefixScoring:
    """Scores through the shared-prefix decoder pass (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, numerics: Numerics | str, recompute_layers: bool = False,
                 reference: torch.nn.Module | None = None, kept_source: object = None):
        self.scorer = SharedPrefixScorer(Decoder(model, numerics))
        # The sampling engine whose ``kept`` products of its last calls (engines/kept_products.py) a training pass
        # over those tokens reads while the adapter still holds the weights they were computed with.
        self.kept_source = kept_source
        self.kept_tokens = 0  # tokens of the last training pass whose kept outputs were read, not computed
        self.recompute_layers = recompute_layers  # activation checkpointing per decoder layer
        # The KL reference: a model of its own (full-parameter training), else this model with its adapter disabled.
        self.reference = None if reference is None else SharedPrefixScorer(Decoder(reference, numerics))

    @property
    def has_reference(self) -> bool:
        """Whether a KL reference can be scored: a reference model, or an adapter to switch off."""
        return self.reference is not None or hasattr(self.scorer.decoder.model, "disable_adapter")

    def score(self, chunk, filters, with_entropy, with_reference, recompute: bool | None = None,
              last: bool = False) -> ChunkScores:
        """The chunk's scores; for a sharded model, one pass of its outer unit (see backend/sharding.py).
        ``recompute``: activation checkpointing for this pass (default: ``recompute_layers``). ``last``: the last
        pass of a ``forward_backward``: the kept products it reads are freed as it reads them (its backward's
        memory then takes their place; a later pass over these tokens computes them)."""
        recompute = self.recompute_layers if recompute is None else recompute
        return sharding.outer_call(self.scorer.decoder.model, self._score, chunk, filters, with_entropy,
                                   with_reference, recompute, last)

    def idle_pass(self, pad_token_id: int, with_reference: bool) -> torch.Tensor:
        """A pass over two padding tokens whose value is 0 (with the weights' graph), reading the reference too
        when the other passes do: what a rank with fewer micro-batches runs so that a sharded model's
        collectives match on every rank."""
        def run() -> torch.Tensor:
            hidden = self.scorer.run([[pad_token_id, pad_token_id]], recompute_layers=self.recompute_layers).hidden
            rows = torch.zeros(1, dtype=torch.long, device=hidden.device)
            targets = torch.full((1,), pad_token_id, dtype=torch.long, device=hidden.device)
            if with_reference:
                self._reference_logprobs([[pad_token_id, pad_token_id]], rows, targets)
            return self.scorer.score(hidden, rows, targets).logprobs.sum() * 0.0

        return sharding.outer_call(self.scorer.decoder.model, run)

    def _reference_logprobs(self, sequences: Sequence[Sequence[int]], rows: torch.Tensor,
                            targets: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.reference is not None:
                def run() -> torch.Tensor:
                    base = self.reference.run(sequences)
                    return self.reference.score(base.hidden, rows, targets).logprobs

                return sharding.outer_call(self.reference.decoder.model, run)
            with self.scorer.decoder.model.disable_adapter():
                base = self.scorer.run(sequences)
                return self.scorer.score(base.hidden, rows, targets).logprobs

    def _kept(self, recompute: bool) -> KeptProducts | None:
        """The engine's kept products, where a training pass without recomputation may read them: their weights are
        the adapter's now, bit for bit."""
        kept = getattr(self.kept_source, "kept", None)
        if kept is None or recompute or not torch.is_grad_enabled():
            return None
        live = {name: p.detach() for name, p in self.scorer.decoder.model.named_parameters() if p.requires_grad}
        return kept if kept.matches(live) else None

    def drop_kept(self) -> None:
        """The weights moved: the engine's kept products can no longer be read; their memory is freed."""
        drop = getattr(self.kept_source, "drop_kept", None)
        if drop is not None:
            drop()

    def _score(self, chunk, filters, with_entropy, with_reference, recompute: bool, last: bool) -> ChunkScores:
        run = self.scorer.run([item.input_tokens for item in chunk], recompute_layers=recompute,
                              kept=self._kept(recompute), release_kept=last)
        self.kept_tokens = self.scorer.kept_tokens
        pairs: dict[tuple[int, int], int] = {}  # (hidden row, target) -> index: each distinct pair once
        seen: list[int] = []  # pair index of every position the loss reads, datum by datum
        for i, item in enumerate(chunk):
            targets = item.targets.tolist()
            for t in item.mask.nonzero().flatten().tolist():
                seen.append(pairs.setdefault((run.flat[i][t], targets[t]), len(pairs)))
        device = run.hidden.device
        rows = torch.tensor([row for row, _ in pairs], dtype=torch.long, device=device)
        targets = torch.tensor([target for _, target in pairs], dtype=torch.long, device=device)
        scores = self.scorer.score(run.hidden, rows, targets, filters, with_entropy, run.logits)
        seen_index = torch.tensor(seen, dtype=torch.long, device=device)
        per_datum = [torch.zeros(len(item.input_tokens)) for item in chunk]
        values = scores.logprobs.detach().float().cpu()
        cursor = 0
        for i, item in enumerate(chunk):
            positions = item.mask.nonzero().flatten()
            per_datum[i][positions] = values[torch.tensor(seen[cursor:cursor + len(positions)], dtype=torch.long)]
            cursor += len(positions)
        self._fill_others(run, chunk, per_datum)
        reference = None
        if with_reference:
            reference = take_rows(self._reference_logprobs([item.input_tokens for item in chunk], rows, targets),
                                  seen_index)
        return ChunkScores(per_datum, take_rows(scores.logprobs, seen_index), take_rows(scores.sampling_logprobs, seen_index),
                           None if scores.entropy is None else take_rows(scores.entropy, seen_index), reference,
                           run.hidden.sum() * 0.0 if run.hidden.requires_grad else run.hidden.new_zeros(()))

    def _fill_others(self, run, chunk, per_datum) -> None:
        """Logprobs of the positions the loss does not read (prompts), without gradient, each pair once."""
        wanted: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i, item in enumerate(chunk):
            for t in (~item.mask).nonzero().flatten().tolist():
                wanted.setdefault((run.flat[i][t], int(item.targets[t])), []).append((i, t))
        if not wanted:
            return
        device = run.hidden.device
        keys = list(wanted)
        with torch.no_grad():
            values = self.scorer.score(run.hidden.detach(), torch.tensor([k[0] for k in keys], device=device),
                                       torch.tensor([k[1] for k in keys], device=device)).logprobs.float().cpu()
        for key, value in zip(keys, values.tolist(), strict=True):
            for i, t in wanted[key]:
                per_datum[i][t] = value


class PaddedScoring:
    """Scores through the model's own forward over a right-padded batch (every target position)."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int):
        self.model = model
        self.pad_token_id = pad_token_id

    def _logits(self, chunk) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(self.model.parameters()).device
        batch = pad_batch([item.input_tokens for item in chunk], self.pad_token_id, side="right")
        width = batch.input_ids.shape[1]
        targets = torch.stack([torch.nn.functional.pad(item.targets, (0, width - len(item.targets)))
                               for item in chunk]).to(device)  # [B, L]
        logits = self.model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                            position_ids=batch.position_ids.to(device)).logits  # [B, L, V]
        return logits, targets

    def score(self, chunk, filters, with_entropy, with_reference, recompute: bool | None = None,
              last: bool = False) -> ChunkScores:
        """``recompute`` and ``last`` are accepted for the protocol: transformers' forward keeps every activation
        and reads no kept products."""
        width = max(len(item.input_tokens) for item in chunk)
        seen = torch.stack([torch.nn.functional.pad(item.mask, (0, width - len(item.mask)), value=False)
                            for item in chunk])  # [B, L]
        reference = None
        if with_reference:  # first, so its logits are freed before the policy's graph is built
            with torch.no_grad(), self.model.disable_adapter():
                ref_logits, ref_targets = self._logits(chunk)
                reference = gather_logprobs(ref_logits, ref_targets)[seen.to(ref_logits.device)]
                del ref_logits
        logits, targets = self._logits(chunk)
        seen = seen.to(logits.device)
        lp = gather_logprobs(logits, targets)  # [B, L]
        per_datum = [lp[row, : len(item.targets)].detach().float().cpu() for row, item in enumerate(chunk)]
        picked = targets[seen][:, None]
        with torch.no_grad():
            transformed = logits[seen].float()
            transformed = transformed if filters.greedy else apply_filters(transformed, filters)
            sampling = torch.log_softmax(transformed, dim=-1).gather(-1, picked).squeeze(-1)
        entropy = token_entropy(logits[seen]) if with_entropy else None
        return ChunkScores(per_datum, lp[seen], sampling, entropy, reference, lp.sum() * 0.0)
