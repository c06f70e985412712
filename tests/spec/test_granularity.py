from __future__ import annotations

import pytest
import torch

from coreai_opt.quantization.spec import PerBlock, PerChannel, PerTensor, QuantizationScheme, granularity_from_dict


def test_qparam_shape_follows_onnx_conventions() -> None:
    shape = (6, 4, 8)
    assert PerTensor().qparam_shape(shape) == ()
    assert PerChannel(0).qparam_shape(shape) == (6,)
    assert PerChannel(2).qparam_shape(shape) == (8,)
    assert PerBlock(axis=2, block_size=4).qparam_shape(shape) == (6, 4, 2)
    assert PerBlock(axis=0, block_size=3).qparam_shape(shape) == (2, 4, 8)


def test_qparam_shape_normalises_negative_axes() -> None:
    shape = (6, 4, 8)
    assert PerChannel(-1).qparam_shape(shape) == (8,)
    assert PerChannel(-3).qparam_shape(shape) == (6,)
    assert PerBlock(axis=-1, block_size=2).qparam_shape(shape) == (6, 4, 4)
    assert PerChannel(-2).onnx_axis(3) == 1
    assert PerBlock(axis=-1, block_size=2).onnx_axis(3) == 2


def test_qparam_shape_raises_when_axis_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"axis=3 is out of range for a tensor of rank 3"):
        PerChannel(3).qparam_shape((2, 3, 4))
    with pytest.raises(ValueError, match=r"axis=-4"):
        PerBlock(axis=-4, block_size=1).qparam_shape((2, 3, 4))


def test_per_block_raises_naming_sizes_when_block_size_does_not_divide() -> None:
    with pytest.raises(ValueError, match=r"block_size=3 does not divide dimension 1 of size 8.*e\.g\. 1"):
        PerBlock(axis=1, block_size=3).qparam_shape((2, 8))
    with pytest.raises(ValueError, match="block_size=3"):
        PerBlock(axis=1, block_size=3).to_rows(torch.zeros(2, 8))


def test_per_block_rejects_non_positive_block_size() -> None:
    with pytest.raises(ValueError, match="positive int"):
        PerBlock(axis=0, block_size=0)


def test_to_rows_groups_elements_sharing_a_qparam() -> None:
    x = torch.arange(24.0).reshape(2, 3, 4)
    assert PerTensor().to_rows(x).shape == (1, 24)
    rows = PerChannel(1).to_rows(x)
    assert rows.shape == (3, 8)
    assert rows[1].tolist() == [4.0, 5.0, 6.0, 7.0, 16.0, 17.0, 18.0, 19.0]
    blocks = PerBlock(axis=2, block_size=2).to_rows(x)
    assert blocks.shape == (12, 2)
    assert blocks[:3].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    blocks0 = PerBlock(axis=0, block_size=2).to_rows(x)
    assert blocks0.shape == (12, 2)
    assert blocks0[0].tolist() == [0.0, 12.0]


@pytest.mark.parametrize("granularity", [PerTensor(), PerChannel(1), PerChannel(-1), PerBlock(2, 2), PerBlock(0, 2)])
def test_from_rows_and_expand_round_trip_the_row_max(granularity) -> None:  # noqa: ANN001
    x = torch.randn(2, 3, 4)
    row_max = granularity.to_rows(x).amax(dim=1)
    qparam = granularity.from_rows(row_max, x.shape)
    assert tuple(qparam.shape) == granularity.qparam_shape(x.shape)
    expanded = torch.broadcast_to(granularity.expand(qparam, x), x.shape)
    # Every element is <= the max of its own group, and each group's max is attained.
    assert bool((x <= expanded).all())
    assert int((x == expanded).sum()) == row_max.numel()


def test_granularity_dict_round_trip() -> None:
    for g in (PerTensor(), PerChannel(-1), PerBlock(axis=1, block_size=16)):
        assert granularity_from_dict(g.to_dict()) == g
    assert PerBlock(1, 16).to_dict() == {"type": "per_block", "axis": 1, "block_size": 16}
    assert hash(PerChannel(0)) == hash(PerChannel(0))


def test_granularity_from_dict_names_unknown_type_and_keys() -> None:
    with pytest.raises(ValueError, match="'per_row'.*per_block, per_channel, per_tensor"):
        granularity_from_dict({"type": "per_row"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['block_size'\]"):
        granularity_from_dict({"type": "per_channel", "axis": 0, "block_size": 4})
    with pytest.raises(ValueError, match="'type' key"):
        granularity_from_dict({"axis": 0})


def test_quantization_scheme_accepts_string_values() -> None:
    assert QuantizationScheme("symmetric_with_clipping") is QuantizationScheme.SYMMETRIC_WITH_CLIPPING
    with pytest.raises(ValueError):
        QuantizationScheme("affine")
