"""GraphMeta: typed, frozen graph-level metadata that survives deepcopy and pickling with the GraphModule."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle

import pytest
import torch
from torch import fx, nn

import coreai_opt
from coreai_opt.config import QuantizerConfig
from coreai_opt.graph.graph_meta import (
    GraphMeta,
    InputSpec,
    OutputLeaf,
    get_graph_meta,
    require_graph_meta,
    set_graph_meta,
)


def _prepared() -> tuple[fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    x = torch.randn(16, 4)
    prepared = coreai_opt.prepare(model, QuantizerConfig.presets.w8a8(), (x[:2],))
    coreai_opt.calibrate(prepared, [x], progress=False)
    return prepared, x


def test_graph_meta_survives_deepcopy_and_convert() -> None:
    prepared, x = _prepared()
    meta = get_graph_meta(prepared)
    assert meta == GraphMeta("fx", ("input",), False, False, (InputSpec("input", "float32", (2, 4)),),
                             QuantizerConfig.presets.w8a8().to_dict(), None, (OutputLeaf("", "Tensor"),))
    other = copy.deepcopy(prepared)
    assert isinstance(other.meta["coreai_opt"], GraphMeta) and get_graph_meta(other) == meta
    with torch.no_grad():
        assert torch.equal(other(x), prepared(x))
    converted = coreai_opt.convert(prepared)
    assert get_graph_meta(converted) == dataclasses.replace(meta, converted=True)
    assert not get_graph_meta(prepared).converted


def test_graph_meta_pickles_alone_and_with_the_prepared_model() -> None:
    """pickle / ``torch.save`` of the metadata itself, and of the whole prepared model (a ``SavableGraphModule``)."""
    prepared, x = _prepared()
    meta = get_graph_meta(prepared)
    buffer = io.BytesIO()
    torch.save({"meta": meta}, buffer)
    buffer.seek(0)
    assert pickle.loads(pickle.dumps(meta)) == meta
    assert torch.load(buffer, weights_only=False)["meta"] == meta
    loaded = pickle.loads(pickle.dumps(prepared))
    assert isinstance(loaded.meta["coreai_opt"], GraphMeta) and get_graph_meta(loaded) == meta
    with torch.no_grad():
        assert torch.equal(loaded(x), prepared(x))


def test_graph_meta_is_frozen_and_reads_like_the_old_dict() -> None:
    prepared, _ = _prepared()
    meta = get_graph_meta(prepared)
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.converted = True  # type: ignore[misc]
    assert meta["capture"] == "fx" and meta["config"] == meta.config
    with pytest.raises(KeyError):
        meta["calibrated"]


def test_a_legacy_dict_reads_as_graph_meta() -> None:
    gm = fx.symbolic_trace(nn.Linear(2, 2))
    gm.meta["coreai_opt"] = {"capture": "export", "converted": True, "input_names": ["x"], "qat": False,
                             "input_specs": [{"name": "x", "dtype": "float32", "shape": [1, 2]}], "config": {}}
    assert get_graph_meta(gm) == GraphMeta("export", ("x",), True, False, (InputSpec("x", "float32", (1, 2)),), {})


def test_missing_graph_meta_names_the_step_that_makes_it() -> None:
    gm = fx.symbolic_trace(nn.Linear(2, 2))
    assert get_graph_meta(gm) is None and get_graph_meta(nn.Linear(2, 2)) is None
    with pytest.raises(TypeError, match=r"convert expects a model returned by coreai_opt.prepare\(...\), got "
                                        r"Linear"):
        require_graph_meta(gm, "convert")
    with pytest.raises(TypeError, match="needs a GraphMeta, got dict"):
        set_graph_meta(gm, {"capture": "fx"})  # type: ignore[arg-type]
