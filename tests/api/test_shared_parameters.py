"""Post-training prepare / convert share the user's weight storage read-only; QAT copies it (issue 20)."""

from __future__ import annotations

import torch
from torch import nn

import coreai_opt as co
from coreai_opt.graph.shared_parameters import copy_sharing_parameters, is_shared, unshare_parameters


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def _prepared(model: nn.Module, qat: bool = False) -> torch.fx.GraphModule:
    x = torch.randn(4, 8)
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), (x,), qat=qat)
    if not qat:
        co.calibrate(prepared, [x], progress=False)
    return prepared


def _pointers(module: nn.Module) -> set[int]:
    return {p.data_ptr() for p in module.parameters()}


def test_ptq_prepare_and_convert_use_the_user_weight_storage_read_only() -> None:
    model = _model()
    prepared = _prepared(model)
    converted = co.convert(prepared)
    assert _pointers(prepared) == _pointers(model) == _pointers(converted)
    assert all(not p.requires_grad for p in [*prepared.parameters(), *converted.parameters()])
    assert all(p.requires_grad for p in model.parameters())  # the user's parameters keep their flags


def test_qat_prepare_copies_the_weights() -> None:
    model = _model()
    prepared = _prepared(model, qat=True)
    assert not _pointers(prepared) & _pointers(model)
    assert all(p.requires_grad for p in prepared.parameters())


def test_load_state_dict_into_a_ptq_prepared_model_leaves_the_user_model_untouched() -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prepared = _prepared(model)
    state = {k: torch.full_like(v, 0.5) if k in ("0.weight", "2.weight") else v
             for k, v in prepared.state_dict().items()}
    co.load_state_dict(prepared, state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert float(prepared.get_parameter("0.weight").min()) == 0.5 == float(prepared.get_parameter("0.weight").max())
    assert not _pointers(prepared) & _pointers(model)


def test_copy_sharing_parameters_keeps_tied_weights_tied_and_unshare_gives_own_storage() -> None:
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    copy = copy_sharing_parameters(model)
    assert copy[0].weight is copy[1].weight and copy[0].weight is not model[0].weight
    assert copy[0].weight.data_ptr() == model[0].weight.data_ptr() and is_shared(copy[0].weight)
    assert unshare_parameters(copy) == 1
    assert copy[0].weight is copy[1].weight and copy[0].weight.data_ptr() != model[0].weight.data_ptr()
    assert torch.equal(copy[0].weight, model[0].weight) and not is_shared(copy[0].weight)
