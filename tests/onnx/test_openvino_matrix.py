"""The zoo exports in OpenVINO CPU (float32 inference precision) against eager, through verify_onnx(runtime=...).

Every preset of ``QuantizerConfig.presets.names()`` plus ``w8a8_dynamic``. Each cell must verify ok against the
tolerance derived from onnxruntime's kernels (and a classifier must agree on top-1 for >= 99.9 % of the inputs,
near ties not counted). The cells OpenVINO 2026.4 gets wrong are xfail(strict=True) with the measured cause;
docs/openvino.md has the measurements and the minimal graphs. Measured (55 cells, Dec 6): 53 ok, the 2 xfails below
(fp8 cells: OpenVINO's float16 double rounding). Two former xfails verify ok on today's files: conv1d_groupnorm fp8
(8.75 steps, 11 allowed; 19 of 13 on the export first measured) and torch_transformer w8a8_dynamic (max |diff|
0.0028, the dynamic-scale ulp of docs/openvino.md defect 6, within the bound verify gives a float output behind
float layers, 0.02 of the range, where it used to apply a float-precision bound of 0.000226).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import coreai_opt
from coreai_opt.onnx import export_onnx, verify_onnx
from tests.zoo import PRESETS as ZOO_PRESETS
from tests.zoo import ZOO, build, preset_config

#: Every preset of ``QuantizerConfig.presets.names()`` and the transformer preset ``w8a8_dynamic``.
PRESETS = (*ZOO_PRESETS, "w8a8_dynamic")
_FLOAT8 = ("OpenVINO converts float32 to float8e4m3fn through float16 (double rounding: a value within a float16 "
           "ulp of a float8 midpoint lands on it and rounds to even; onnxruntime and eager round once; onnxruntime "
           "with that float16 step written in returns OpenVINO's output bit for bit), docs/openvino.md defect 4: ")
#: Cells OpenVINO 2026.4 computes differently for a measured cause no export rule or runner setting fixes.
XFAIL: dict[tuple[str, str], str] = {
    ("resnet18", "fp8"): _FLOAT8 + "10.5 steps within 29 allowed, but top-1 79.7 % (12 near-tie flips, 98.4 % decided)",
    ("conv_transpose_decoder", "fp8"): _FLOAT8 + "16.5 steps, 7 allowed",
}
#: Cells that do not exist: w8a8_dynamic quantizes linears only and this model has none (export_onnx refuses a
#: float model with a clear error).
NOT_APPLICABLE: frozenset[tuple[str, str]] = frozenset({("conv_transpose_decoder", "w8a8_dynamic")})
CELLS = [
    pytest.param(name, preset, marks=pytest.mark.xfail(strict=True, reason=XFAIL[name, preset]))
    if (name, preset) in XFAIL else (name, preset)
    for name in ZOO for preset in PRESETS if (name, preset) not in NOT_APPLICABLE
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "preset"), CELLS)
def test_openvino_cpu_agrees_with_eager_within_the_derived_tolerance(name: str, preset: str, tmp_path: Path) -> None:
    model, example, batches = build(name)
    prepared = coreai_opt.prepare(model, preset_config(preset, model), example)
    coreai_opt.calibrate(prepared, batches, progress=False)
    converted = coreai_opt.convert(prepared)
    path = export_onnx(converted, example, tmp_path / f"{name}_{preset}.onnx")
    torch.manual_seed(123)
    report = verify_onnx(converted, path, [ZOO[name].make_input(16) for _ in range(4)], runtime="openvino")
    print(f"\n{report}")
    assert report.runtime == "openvino" and report.num_samples == 64
    for output in report.outputs:  # top-1 agreement, not counting near ties (random-init zoo logits are close)
        if output.argmax_agreement is not None:
            decided = output.argmax_agreement + output.argmax_flips_within_tolerance / report.num_samples
            assert decided >= 0.999, str(report)
    assert report.ok, str(report)


def test_verify_onnx_rejects_an_unknown_runtime(tmp_path: Path) -> None:
    from coreai_opt.onnx.verify.runtimes import open_runner

    with pytest.raises(ValueError, match="runtime must be one of"):
        open_runner(tmp_path / "x.onnx", "tensorrt")
