from __future__ import annotations

import pytest
import torch
from onnx import TensorProto

from coreai_opt.quantization.spec import SUPPORTED_DTYPES, get_dtype_info

# name: (quant_min, quant_max, storage dtype, ONNX type, is_float, bits, min_opset)
TABLE = {
    "int8": (-128, 127, torch.int8, TensorProto.INT8, False, 8, 13),
    "uint8": (0, 255, torch.uint8, TensorProto.UINT8, False, 8, 13),
    "int16": (-32768, 32767, torch.int16, TensorProto.INT16, False, 16, 21),
    "uint16": (0, 65535, torch.uint16, TensorProto.UINT16, False, 16, 21),
    "int4": (-8, 7, torch.int8, TensorProto.INT4, False, 4, 21),
    "uint4": (0, 15, torch.uint8, TensorProto.UINT4, False, 4, 21),
    "float8_e4m3fn": (-448.0, 448.0, torch.float8_e4m3fn, TensorProto.FLOAT8E4M3FN, True, 8, 19),
    "float8_e5m2": (-57344.0, 57344.0, torch.float8_e5m2, TensorProto.FLOAT8E5M2, True, 8, 19),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_get_dtype_info_returns_table_row_when_given_name(name: str) -> None:
    info = get_dtype_info(name)
    assert (info.quant_min, info.quant_max, info.storage_dtype, info.onnx_type, info.is_float, info.bits,
            info.min_opset) == TABLE[name]
    assert info.name == name


def test_supported_dtypes_lists_the_eight_user_dtypes() -> None:
    assert set(SUPPORTED_DTYPES) == set(TABLE)
    assert "int32" not in SUPPORTED_DTYPES


@pytest.mark.parametrize(
    ("torch_dtype", "name"),
    [(torch.int8, "int8"), (torch.uint8, "uint8"), (torch.int16, "int16"), (torch.uint16, "uint16"),
     (torch.float8_e4m3fn, "float8_e4m3fn"), (torch.float8_e5m2, "float8_e5m2")],
)
def test_get_dtype_info_accepts_torch_dtypes(torch_dtype: torch.dtype, name: str) -> None:
    assert get_dtype_info(torch_dtype).name == name


def test_get_dtype_info_error_lists_valid_names_when_string_unknown() -> None:
    with pytest.raises(ValueError, match="'int9'") as err:
        get_dtype_info("int9")
    for name in TABLE:
        assert name in str(err.value)


def test_get_dtype_info_rejects_unsupported_torch_dtype() -> None:
    with pytest.raises(ValueError, match="valid dtypes are"):
        get_dtype_info(torch.float32)


def test_get_dtype_info_accepts_int32_only_when_internal_allowed() -> None:
    with pytest.raises(ValueError):
        get_dtype_info("int32")
    info = get_dtype_info("int32", allow_internal=True)
    assert (info.quant_min, info.quant_max, info.onnx_type) == (-(2**31), 2**31 - 1, TensorProto.INT32)


def test_quant_dtype_is_signed_follows_quant_min() -> None:
    assert [get_dtype_info(n).is_signed for n in TABLE] == [True, False, True, False, True, False, True, True]
