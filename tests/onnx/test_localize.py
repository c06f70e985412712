"""verify_onnx on a GPT-style decoder: weight-only exports as written (our MatMulNBits) and tampered to int8 compute."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import coreai_opt
from coreai_opt.config import QuantizerConfig
from coreai_opt.onnx import export_onnx, localize_divergence, verify_onnx
from coreai_opt.reference_models import GPTStyleDecoder

VOCAB, SEQ = 128, 16


def _tiny_gpt() -> nn.Module:
    """2 causal blocks of width 64, 4 heads: logits ``[B, T, VOCAB]``."""
    return GPTStyleDecoder(VOCAB, SEQ, dim=64, depth=2, heads=4, position_std=0.1)


Exported = tuple[nn.Module, Path, list[torch.Tensor]]


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Exported]:
    cache: dict[str, Exported] = {}

    def get(preset: str, compute: str = "float") -> Exported:
        key = f"{preset}_{compute}"
        if key not in cache:
            torch.manual_seed(0)
            model = _tiny_gpt().eval()
            gen = torch.Generator().manual_seed(1)
            calib = [torch.randint(0, VOCAB, (4, SEQ), generator=gen) for _ in range(4)]
            options = {} if preset == "w8a8" else {"compute": compute}
            config = QuantizerConfig.presets.get(preset)(**options)
            prepared = coreai_opt.prepare(model, config, (calib[0],))
            coreai_opt.calibrate(prepared, calib, progress=False)
            converted = coreai_opt.convert(prepared)
            path = export_onnx(converted, (calib[0],), tmp_path_factory.mktemp(key) / f"gpt_{key}.onnx")
            cache[key] = (converted, path, [torch.randint(0, VOCAB, (8, SEQ), generator=gen) for _ in range(2)])
        return cache[key]

    return get


def _as_onnxruntime_fuses_it(path: Path, directory: Path) -> Path:
    """The file with every MatMulNBits at accuracy_level=4 and our name suffix dropped: what onnxruntime runs when
    it fuses ``DequantizeLinear -> MatMul`` itself (int8 activations the eager model does not emulate)."""
    import onnx

    proto = onnx.load(str(path))
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits":
            next(a for a in node.attribute if a.name == "accuracy_level").i = 4
            node.name = node.name.removesuffix("_int8_emulated")
    tampered = directory / "int8_fused.onnx"
    onnx.save(proto, str(tampered))
    return tampered


@pytest.mark.parametrize("preset", ["w8", "w4", "w8a16"])
def test_weight_only_decoder_export_runs_float_matmul_nbits_equal_to_eager(gpt: Callable[..., Exported],
                                                                           preset: str) -> None:
    model, path, inputs = gpt(preset)
    report = verify_onnx(model, path, inputs)
    print(f"\n{report}")
    (logits,) = report.outputs
    assert report.ok and report.fusion.integer_compute.get("MatMulNBits", 0) == 9  # 4 per block + the head
    # measured: w8 / w4 7e-7 (1.6e-7 of range), w8a16 2.1e-4 (4.8e-5 of range; its uint16 quantizers round)
    assert logits.max_abs_diff <= 1e-4 * logits.reference_range and logits.argmax_agreement in (None, 1.0)
    with torch.no_grad():
        eager = [model(x).argmax(-1) for x in inputs]
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = [torch.from_numpy(session.run(None, {"tokens": x.numpy()})[0]).argmax(-1) for x in inputs]
    assert all(torch.equal(e, g) for e, g in zip(eager, got, strict=True))  # top-1 100 %


@pytest.mark.parametrize("preset", ["w8", "w4", "w8a16"])
def test_int8_compute_decoder_verifies_ok_with_the_eager_emulation(gpt: Callable[..., Exported], preset: str) -> None:
    model, path, inputs = gpt(preset, "int8")
    report = verify_onnx(model, path, inputs)
    print(f"\n{report}")
    (logits,) = report.outputs
    # ulp differences upstream flip int8 codes; derived bound: 9 int8 steps of the LM head (9 int8-compute layers on
    # the path) per element; measured max |diff| / largest allowed: w8 0.0027 / 0.0336, w4 0.0070 / 0.0365,
    # w8a16 0.0146 / 0.0323 (0.7 % of the range; the former flat rule allowed 2 %)
    assert report.ok and logits.rule == "int8 compute" and "9 int8 step(s)" in logits.reason
    assert logits.max_abs_diff <= logits.tolerance < 0.008 * logits.reference_range


def test_weight_only_w8_decoder_run_as_onnxruntime_fuses_it_fails_verify_and_names_the_first_matmulnbits_layer(
    gpt: Callable[..., Exported], tmp_path: Path,
) -> None:
    model, path, inputs = gpt("w8")
    report = verify_onnx(model, _as_onnxruntime_fuses_it(path, tmp_path), inputs)
    print(f"\n{report}")
    (logits,) = report.outputs
    assert report.fusion.integer_compute.get("MatMulNBits", 0) >= 8  # qkv, proj, fc, out in both blocks
    # float output of a weight-only path: judged at float precision, and onnxruntime is far outside it
    assert logits.rule == "float" and logits.tolerance == pytest.approx(1e-4 * logits.reference_range + 1e-6)
    assert logits.max_abs_diff > 10 * logits.tolerance and not report.ok  # measured 0.0172 vs 0.00047
    assert "MatMulNBits" in logits.reason
    divergence = report.divergence
    assert divergence is not None and divergence.kind == "layer"
    assert (divergence.module, divergence.call) == ("blocks.0.qkv", "blocks.0.qkv call 0")  # the first linear
    assert divergence.difference > 10 * divergence.allowed
    assert divergence.reason.startswith("an op onnxruntime computes differently: MatMulNBits (accuracy_level=4")
    assert "first divergence" in str(report) and "blocks.0.qkv" in str(report)


def test_w8a16_decoder_run_as_onnxruntime_fuses_it_fails_at_the_first_quantizer_after_matmulnbits(
    gpt: Callable[..., Exported], tmp_path: Path,
) -> None:
    model, path, inputs = gpt("w8a16")
    report = verify_onnx(model, _as_onnxruntime_fuses_it(path, tmp_path), inputs)
    print(f"\n{report}")
    (logits,) = report.outputs
    assert logits.rule == "steps" and logits.max_diff_steps > logits.tolerance_steps and not report.ok
    divergence = report.divergence
    assert divergence is not None and divergence.kind == "quantizer" and divergence.module == "blocks.0.qkv"
    assert "MatMulNBits" in divergence.reason and divergence.difference > divergence.allowed
    # QuantizeLinear outputs added as graph outputs leave onnxruntime's kernels as they were
    assert divergence.fusions_unchanged


def test_w8a8_decoder_verifies_ok_and_every_quantizer_call_site_is_within_its_bound(
    gpt: Callable[[str], Exported],
) -> None:
    model, path, inputs = gpt("w8a8")
    report = verify_onnx(model, path, inputs)
    print(f"\n{report}")
    assert report.ok and report.divergence is None, str(report)
    assert "MatMulNBits" not in report.fusion.integer_compute
    assert localize_divergence(model, path, inputs[0]) is None


def test_localize_divergence_names_the_quantizer_of_a_tampered_file(gpt: Callable[[str], Exported],
                                                                     tmp_path: Path) -> None:
    """A file whose second block's fc weight is negated: the first quantizer after it must be named."""
    import onnx
    from onnx import numpy_helper

    model, path, inputs = gpt("w8a8")
    proto = onnx.load(str(path))
    weight_dq = next(n for n in proto.graph.node
                     if n.op_type == "DequantizeLinear" and "blocks_1_fc_weight_fq" in str(n.metadata_props))
    target = next(t for t in proto.graph.initializer if t.name == weight_dq.input[0])
    target.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(target), target.name))
    tampered = tmp_path / "tampered.onnx"
    onnx.save(proto, str(tampered))
    divergence = localize_divergence(model, tampered, inputs[0])
    assert divergence is not None and divergence.kind == "quantizer"
    assert divergence.module.startswith("blocks.1"), str(divergence)
    assert divergence.difference > divergence.allowed


def _int8_layers(path: Path) -> tuple[object, list[object]]:
    import onnx

    proto = onnx.load(str(path))
    return proto, [n for n in proto.graph.node if n.op_type == "MatMulNBits" and n.name.endswith("_int8_emulated")]


@pytest.mark.parametrize("preset", ["w8", "w4"])
def test_int8_compute_kernel_on_the_decoder_file_equals_the_emulation_of_its_own_input_within_accumulation(
    gpt: Callable[..., Exported], preset: str, tmp_path: Path,
) -> None:
    """Every int8-compute MatMulNBits of the file, given onnxruntime's own A: int8_compute_activation(A) @ W within
    the float32 accumulation bound, far below one code step (the kernel's quantization is bit-exact)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from coreai_opt.onnx.verify.int8_compute_steps import file_weight, input_row_steps
    from coreai_opt.quantization.matmul_nbits.int8_compute import accumulation_bound, int8_compute_activation

    _, path, inputs = gpt(preset, "int8")
    proto, layers = _int8_layers(path)
    assert len(layers) == 9
    tensors = list(dict.fromkeys(t for n in layers for t in (n.input[0], n.output[0])))
    proto.graph.output.extend(helper.make_empty_tensor_value_info(t) for t in tensors)
    onnx.save(proto, str(tmp_path / "cut.onnx"))
    session = ort.InferenceSession(str(tmp_path / "cut.onnx"), providers=["CPUExecutionProvider"])
    values = dict(zip(tensors, session.run(tensors, {"tokens": inputs[0].numpy()}), strict=True))
    for node in layers:
        block = next(a.i for a in node.attribute if a.name == "block_size")
        a, weight = torch.from_numpy(values[node.input[0]]), torch.from_numpy(file_weight(proto, node))
        codes = int8_compute_activation(a, block)
        eager = (codes @ weight.T).double().numpy()
        bound = accumulation_bound(codes, weight).numpy()
        difference = np.abs(values[node.output[0]] - eager)
        assert (difference <= bound).all(), node.name
        unit = input_row_steps(a.numpy(), block) * np.abs(weight.numpy()).max(1)
        # measured: difference <= 9.5e-7, median one-code unit >= 5.8e-4 (w8 / w4): one flipped code would show
        assert difference.max() < 0.01 * np.median(unit), node.name


def test_int8_compute_decoder_with_a_5_percent_head_scale_error_fails_naming_the_layer(
    gpt: Callable[..., Exported], tmp_path: Path,
) -> None:
    """The former flat 0.02-of-range rule passed this file; the derived bound does not."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model, path, inputs = gpt("w8", "int8")
    proto, layers = _int8_layers(path)
    head = layers[-1]
    scales = next(t for t in proto.graph.initializer if t.name == head.input[2])
    values = numpy_helper.to_array(scales).copy().reshape(VOCAB, -1)
    values[5] *= np.float32(1.05)  # one output column's weight 5 % too large
    scales.CopyFrom(numpy_helper.from_array(values.reshape(-1), scales.name))
    onnx.save(proto, str(tmp_path / "tampered.onnx"))
    report = verify_onnx(model, tmp_path / "tampered.onnx", inputs)
    print(f"\n{report}")
    (logits,) = report.outputs
    assert not report.ok and logits.rule == "int8 compute" and head.name in logits.reason
    assert logits.tolerance < logits.max_abs_diff < 0.02 * logits.reference_range  # measured 0.0349 < 0.0861
    # localize judges each layer beyond its int8 steps: the upstream layers' code flips are not divergences
    divergence = report.divergence
    assert divergence is not None and (divergence.kind, divergence.module) == ("layer", "head")
    assert localize_divergence(model, path, inputs[0]) is None  # the file as written
