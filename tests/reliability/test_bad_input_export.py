"""Bad export input: models that are not converted, dtypes onnxruntime cannot run, bad opsets and names, output
paths that cannot be written, and models whose tensors exceed the single-file limit (external data).

The 2 GB limit is simulated by lowering ``coreai_opt.onnx.export.save.SINGLE_FILE_LIMIT_BYTES``: the code path is the
one a
real >2 GB model takes, without allocating 2 GB.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import coreai_opt as co
import coreai_opt.onnx.export.save as onnx_save
from coreai_opt.quantization.spec import FakeQuantize, QuantizationSpec

from .conftest import Pipeline, ort_run


def test_export_refuses_a_prepared_model_and_says_to_convert(cnn_pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=r"the model is prepared but not converted") as info:
        co.export_onnx(cnn_pipeline.prepared, (cnn_pipeline.example,), tmp_path / "m.onnx")
    assert "call coreai_opt.convert(prepared) and export the model it returns" in str(info.value)
    assert not (tmp_path / "m.onnx").exists()


def test_export_refuses_a_float_model(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=r"Sequential has no coreai_opt quantizers: it is a float model") as info:
        co.export_onnx(nn.Sequential(nn.Linear(2, 2)), (torch.randn(1, 2),), tmp_path / "m.onnx")
    assert "coreai_opt.prepare -> coreai_opt.calibrate -> coreai_opt.convert first" in str(info.value)


def test_export_names_hand_built_quantizers_that_are_not_frozen(tmp_path) -> None:  # noqa: ANN001
    fq = FakeQuantize(QuantizationSpec(dtype="int8"))
    fq.set_name("head.input")
    with pytest.raises(ValueError, match=r"1 quantizer\(s\) are not in export mode \('head\.input'\)") as info:
        co.export_onnx(nn.Sequential(fq, nn.Linear(2, 2)), (torch.randn(1, 2),), tmp_path / "m.onnx")
    assert "call coreai_opt.convert(prepared)" in str(info.value)


def test_export_refuses_a_dtype_without_an_onnxruntime_kernel(converted_copy: torch.fx.GraphModule,
                                                              cnn_pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    """A quantizer whose dtype has no QuantizeLinear kernel (e.g. a future ``float4_e2m1`` spec) is named."""
    fq = converted_copy.get_submodule("fc_output_fq")
    fq.spec = QuantizationSpec.model_construct(**{**dict(fq.spec), "dtype": "float4_e2m1"})
    with pytest.raises(ValueError, match=r"quantizer 'fc\.output' uses dtype 'float4_e2m1', which has no onnxruntime "
                                         r"QuantizeLinear/DequantizeLinear kernel") as info:
        co.export_onnx(converted_copy, (cnn_pipeline.example,), tmp_path / "m.onnx")
    assert re.search(r"use one of int8, uint8, int16", str(info.value))
    assert not (tmp_path / "m.onnx").exists()


BAD_ARGS = [
    ({"opset": 17}, ValueError, r"opset=17 is not supported", r"pass opset=None to pick the lowest one"),
    ({"opset": 99}, ValueError, r"opset=99 is not supported; the exporter writes opsets 18\.\.23", r"opset=None"),
    ({"opset": "18"}, TypeError, r"opset must be an int or None, got '18'", r"an int or None"),
    ({"input_names": ["a", "b"]}, ValueError, r"input_names has 2 name\(s\) \['a', 'b'\] but the model has 1",
     r"pass 1 names"),
    ({"output_names": [""]}, TypeError, r"output_names must be non-empty strings, got \[''\]", r"non-empty strings"),
]


@pytest.mark.parametrize(("kwargs", "error", "names", "fix"), BAD_ARGS, ids=[str(k) for k, *_ in BAD_ARGS])
def test_export_rejects_bad_arguments_naming_them(cnn_pipeline: Pipeline, tmp_path, kwargs: dict,  # noqa: ANN001
                                                 error: type[Exception], names: str, fix: str) -> None:
    with pytest.raises(error, match=names) as info:
        co.export_onnx(cnn_pipeline.converted, (cnn_pipeline.example,), tmp_path / "m.onnx", **kwargs)
    assert re.search(fix, str(info.value))
    assert list(tmp_path.iterdir()) == []


def test_export_names_the_dtype_when_the_opset_is_too_low_for_it(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    x = torch.randn(2, 32)
    prepared = co.prepare(nn.Sequential(nn.Linear(32, 4)), co.QuantizerConfig.presets.w4(algorithm="rtn"), (x,))
    converted = co.convert(prepared)  # rtn is data-free: no calibration needed (the default gptq needs it)
    with pytest.raises(ValueError, match=r"opset=19 is too low for quantizer '0\.weight' \(dtype 'int4' with per-block "
                                         r"granularity\): it needs opset >= 21") as info:
        co.export_onnx(converted, (x,), tmp_path / "w4.onnx", opset=19)
    assert "pass opset=21 or opset=None" in str(info.value)


def test_export_wrong_example_inputs_type_is_named(cnn_pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(TypeError, match=r"example_inputs must be a tensor or a tuple of tensors .* got dict"):
        co.export_onnx(cnn_pipeline.converted, {"x": cnn_pipeline.example}, tmp_path / "m.onnx")


def test_export_to_a_missing_directory_names_it_and_creates_nothing(cnn_pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    target = tmp_path / "no" / "such" / "dir" / "m.onnx"
    with pytest.raises(FileNotFoundError, match=re.escape(f"directory {target.parent} does not exist")) as info:
        co.export_onnx(cnn_pipeline.converted, (cnn_pipeline.example,), target)
    assert "create it first (export_onnx does not create directories)" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_export_to_a_directory_path_suggests_a_file_name(cnn_pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(IsADirectoryError, match=re.escape(f"ONNX output path {tmp_path} is a directory")) as info:
        co.export_onnx(cnn_pipeline.converted, (cnn_pipeline.example,), tmp_path)
    assert re.search(r"pass a file path such as .*model\.onnx", str(info.value))


def test_export_path_of_wrong_type_is_named(cnn_pipeline: Pipeline) -> None:
    with pytest.raises(TypeError, match=r"path must be a str or os\.PathLike, got int"):
        co.export_onnx(cnn_pipeline.converted, (cnn_pipeline.example,), 3)


def test_model_over_the_single_file_limit_is_written_with_external_data(cnn_pipeline: Pipeline, tmp_path,  # noqa: ANN001
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onnx_save, "SINGLE_FILE_LIMIT_BYTES", 1000)
    path = co.export_onnx(cnn_pipeline.converted, (cnn_pipeline.example,), tmp_path / "big.onnx")
    data_file = tmp_path / "big.onnx.data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"], "no temporaries left behind"
    graph_only = onnx.load(str(path), load_external_data=False)
    external = [t for t in graph_only.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external, "large initializers moved out"
    locations = {e.value for t in external for e in t.external_data if e.key == "location"}
    assert locations == {"big.onnx.data"}, "referenced by a relative name, so the pair can be moved together"
    offsets = [int(e.value) for t in external for e in t.external_data if e.key == "offset"]
    assert all(o % onnx_save.EXTERNAL_DATA_ALIGNMENT == 0 for o in offsets)
    assert data_file.stat().st_size >= sum(int(e.value) for t in external for e in t.external_data if e.key == "length")
    # Same numbers as the single-file export of the session fixture, and the moved pair still loads.
    moved = tmp_path / "moved"
    moved.mkdir()
    path.rename(moved / "big.onnx")
    data_file.rename(moved / "big.onnx.data")
    big = ort_run(moved / "big.onnx", cnn_pipeline.example)
    single = ort_run(cnn_pipeline.onnx_path, cnn_pipeline.example)
    np.testing.assert_array_equal(big[0], single[0])
    onnx.checker.check_model(str(moved / "big.onnx"))

