"""One set of coded weights per model, shared by its decoders and by every module tree over the same weights.

:mod:`rlrunbook.kernels.coded_weights` keeps a frozen float32 weight in a short exact form for decode steps. A
model's forms are made on first use and kept while the model lives (the registry holds it weakly), keyed on the
weight's memory (data pointer, shape and strides), so the sampler's decoder and the trainer's, and the module trees
of several clients over one loaded base (``rlrunbook.backend.model_host.share_weights``, which shares the set with
:func:`share_coded_forms`), find one form per weight: its bytes are held once (SmolLM2-135M: 112 MB), not once
per tree. A form is used while the tensor it was made from (its owner) lives, still holds that memory and has not
been changed in place (its version counter): a weight replaced, or changed through autograd-visible operations, is
coded again; base weights are frozen, so a form is made once.
"""

from __future__ import annotations

import threading
import weakref

import torch

from rlrunbook.engines.per_model import PerModel
from rlrunbook.kernels.coded_weights import CodedWeight, codable, code_weight


class CodedForms:
    """The coded forms of one model's frozen weights (``None`` for a weight without one), made on first use."""

    def __init__(self) -> None:
        # (data pointer, shape, strides) -> (a weak reference to the tensor coded, its version and storage then, the
        # form)
        self._forms: dict[tuple, tuple[weakref.ref, int, int, CodedWeight | None]] = {}
        self._lock = threading.Lock()  # the sampler and the trainer may run on different threads

    def of(self, weight: torch.Tensor, owner: torch.Tensor | None = None) -> CodedWeight | None:
        """``weight``'s form (:func:`~rlrunbook.kernels.coded_weights.code_weight`), made once; ``owner``: a tensor
        that lives as long as the weight's memory and changes with it (the parameter a stacked view is made of;
        default ``weight``)."""
        if not codable(weight) or weight.requires_grad or weight.is_inference():
            return None
        owner = weight if owner is None else owner
        key = (weight.data_ptr(), tuple(weight.shape), weight.stride())
        with self._lock:
            entry = self._forms.get(key)
            if entry is not None:
                coded_from, version, memory, form = entry[0](), *entry[1:]
                # the tensor coded still lives, holds that memory and is unchanged: so are the values
                if (coded_from is not None and coded_from._version == version
                        and coded_from.untyped_storage().data_ptr() == memory):
                    return form
            form = code_weight(weight)
            self._forms[key] = (weakref.ref(owner), owner._version, owner.untyped_storage().data_ptr(), form)
            self._drop_dead()
            return form

    def _drop_dead(self) -> None:
        for key in [k for k, (ref, *_) in self._forms.items() if ref() is None]:
            del self._forms[key]

    @property
    def nbytes(self) -> int:
        """Bytes the forms of live weights hold."""
        with self._lock:
            self._drop_dead()
            return sum(entry[3].nbytes for entry in self._forms.values() if entry[3] is not None)


_per_model: PerModel[CodedForms] = PerModel(CodedForms)


def coded_forms(model: torch.nn.Module) -> CodedForms:
    """The one set of coded forms of ``model`` (a peft wrapper and the model inside it share it)."""
    return _per_model.of(model)


def share_coded_forms(model: torch.nn.Module, source: torch.nn.Module) -> None:
    """Let ``model`` (a module tree over ``source``'s weight tensors) use ``source``'s coded forms."""
    _per_model.share(model, source)
