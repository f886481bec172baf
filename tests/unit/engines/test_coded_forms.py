"""The coded forms of a model's weights (engines/coded_forms.py): made once per weight, shared by the module trees over
one loaded base, made again when a weight changes."""

from __future__ import annotations

import torch

from rlrunbook.engines.coded_forms import CodedForms, coded_forms, share_coded_forms
from rlrunbook.testing.quantized import q4_1


def _weight() -> torch.Tensor:
    return q4_1(torch.randn(96, 576, generator=torch.Generator().manual_seed(0)))


def test_a_form_is_made_once_and_again_after_an_in_place_change():
    forms, weight = CodedForms(), _weight()
    first = forms.of(weight)
    assert first is not None and first.kind == "q4" and forms.of(weight) is first
    assert forms.nbytes == first.nbytes == 96 * 576 * 3 // 4
    with torch.no_grad():
        weight.add_(0.0)  # the same values, a new version: coded again
    again = forms.of(weight)
    assert again is not None and again is not first
    with torch.no_grad():
        weight[0, 0] += 1e-3  # no form holds it now
    assert forms.of(weight) is None
    assert forms.of(torch.nn.Parameter(_weight())) is None  # trained (requires grad): never coded


def test_a_stacked_view_is_kept_under_its_owner():
    """A stacked group's weight is a new view at each sampling call: its form is found under the parameter it views,
    and a view of other rows has its own."""
    forms, owner = CodedForms(), _weight()
    first = forms.of(owner[:64], owner)
    assert first is not None and forms.of(owner[:64], owner) is first
    assert forms.of(owner[:32], owner) is not first


def test_a_form_dies_with_its_weight():
    import weakref

    forms = CodedForms()
    weight = _weight()
    form = weakref.ref(forms.of(weight))
    assert form() is not None and forms.nbytes == form().nbytes
    del weight
    assert forms.of(_weight()[:48]) is not None  # the next form made drops the dead weight's
    assert form() is None


def test_module_trees_over_one_base_share_its_forms():
    """Two models whose parameters hold the same tensors (as model_host.share_weights makes them) find one form per
    weight: its bytes are held once."""
    weight = _weight()
    resident, copy = torch.nn.Linear(576, 96, bias=False), torch.nn.Linear(576, 96, bias=False)
    resident.weight.requires_grad_(False)
    copy.weight.requires_grad_(False)
    resident.weight.data = weight
    copy.weight.data = weight  # another Parameter over the same memory
    share_coded_forms(copy, resident)
    form = coded_forms(resident).of(resident.weight)
    assert form is not None and coded_forms(copy).of(copy.weight) is form
    assert coded_forms(copy) is coded_forms(resident)
