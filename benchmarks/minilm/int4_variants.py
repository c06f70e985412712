"""Every 4-bit MiniLM ONNX file of the issue-18 table: how each one is built (ours and the peers).

A :class:`Variant` names a row and a builder ``(Inputs, out_path) -> Path``. :func:`variants` lists them in the
order they are built (fast and most wanted first, so a run cut short still has the core rows).

* **ours**: ``co.prepare(model, QuantizerConfig.presets.w4(block_size=b), capture="export") -> co.calibrate ->
  co.convert -> co.export_onnx`` (default options); "embeddings float" adds ``.set_op_kind("embedding", None)``.
* **ORT**: ``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`` on the fp32 export with the
  DEFAULT (round to nearest; ``accuracy_level`` left at onnxruntime's default unless the row says otherwise), HQQ
  and GPTQ (vendored INC code, calibrated on the same sentences) algorithm configs.
* **NNCF**: ``nncf.compress_weights`` on the fp32 ONNX model (NNCF 3.4's ONNX backend), ``INT4_ASYM``,
  ``group_size=b``, ``ratio=1``, ``all_layers=True`` (no int8 backup for the last linear), AWQ and scale
  estimation on the calibration sentences (batch 1), ``Gather`` ignored (embeddings float: NNCF's blocked
  int4 ``Gather`` does not load in onnxruntime 1.32, ``/work/shared/reference/int4-anchors.md``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx
from torch import Tensor, nn

from benchmarks.minilm import ours, peers

__all__ = ["FLOAT_OPSET", "Inputs", "Variant", "export_float", "ort_matmul_nbits", "variants"]

#: Opset of the fp32 export the peers start from (21: NNCF writes int4 ``DequantizeLinear``).
FLOAT_OPSET = 21


@dataclass(frozen=True)
class Inputs:
    """What every builder may use: the fp32 model, its example inputs, calibration batches, the fp32 file."""

    model: nn.Module
    example: tuple[Tensor, Tensor]
    calibration: Sequence[tuple[Tensor, Tensor]]
    fp32_path: Path


@dataclass(frozen=True)
class Variant:
    """One row: ``key`` (file stem and results key), display ``name``, ``block`` and its ``build`` function."""

    key: str
    name: str
    block: int | None
    build: Callable[[Inputs, Path], Path]
    note: str = ""


def export_float(model: nn.Module, example: tuple[Tensor, Tensor], path: Path) -> Path:
    """Export the float embedder (dynamo, opset :data:`FLOAT_OPSET`, dynamic batch) into one file."""
    return peers.export_float(model, example, path, opset=FLOAT_OPSET)


def _ours(block: int, float_embeddings: bool, compute: str = "float") -> Callable[[Inputs, Path], Path]:
    def build(inputs: Inputs, out: Path) -> Path:
        from coreai_opt.config import QuantizerConfig

        config = QuantizerConfig.presets.w4(block_size=block, compute=compute)
        if float_embeddings:
            config = config.set_op_kind("embedding", None)
        prepared = ours.prepare_calibrate(inputs.model, config, inputs.example, inputs.calibration)
        return ours.export(prepared, inputs.example, out)[1]

    return build


class _Reader:
    """onnxruntime ``CalibrationDataReader`` over the calibration sentences, one per item (GPTQ iterates it)."""

    def __init__(self, batches: Sequence[tuple[Tensor, Tensor]]) -> None:
        self._items = _single_items(batches)
        self._index = 0

    def get_next(self) -> dict | None:
        if self._index >= len(self._items):
            return None
        self._index += 1
        return self._items[self._index - 1]

    def rewind(self) -> None:
        self._index = 0

    def __iter__(self) -> Iterator[dict]:
        return iter(self._items)


def _single_items(batches: Sequence[tuple[Tensor, Tensor]]) -> list[dict]:
    """The calibration batches as one ``{"input_ids", "attention_mask"}`` feed per sentence (batch 1)."""
    return [{"input_ids": i[k : k + 1].numpy(), "attention_mask": m[k : k + 1].numpy()}
            for i, m in batches for k in range(i.shape[0])]


def ort_matmul_nbits(algorithm: str, block: int, symmetric: bool, accuracy_level: int | None = None,
                     ) -> Callable[[Inputs, Path], Path]:
    """A builder quantizing the fp32 file's MatMul weights with onnxruntime's ``MatMulNBitsQuantizer``."""

    def build(inputs: Inputs, out: Path) -> Path:
        from onnxruntime.quantization import matmul_nbits_quantizer as mnq

        if algorithm == "rtn":
            config = mnq.DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=symmetric,
                                                      accuracy_level=accuracy_level)
        elif algorithm == "hqq":
            config = mnq.HQQWeightOnlyQuantConfig(block_size=block)
        elif algorithm == "gptq":
            config = mnq.GPTQWeightOnlyQuantConfig(calibration_data_reader=_Reader(inputs.calibration),
                                                   block_size=block)
        else:
            raise ValueError(f"unknown onnxruntime algorithm {algorithm!r}")
        quantizer = mnq.MatMulNBitsQuantizer(onnx.load(str(inputs.fp32_path)), block_size=block,
                                             is_symmetric=symmetric, accuracy_level=accuracy_level,
                                             algo_config=config)
        quantizer.process()
        quantizer.model.save_model_to_file(str(out), use_external_data_format=False)
        return out

    return build


def _nncf(block: int, mode: str = "INT4_ASYM") -> Callable[[Inputs, Path], Path]:
    def build(inputs: Inputs, out: Path) -> Path:
        import nncf

        logging.getLogger("nncf").setLevel(logging.ERROR)
        items = _single_items(inputs.calibration)
        compressed = nncf.compress_weights(
            onnx.load(str(inputs.fp32_path)), mode=getattr(nncf.CompressWeightsMode, mode), ratio=1.0,
            group_size=block, all_layers=True, ignored_scope=nncf.IgnoredScope(types=["Gather"]),
            dataset=nncf.Dataset(items), subset_size=len(items), awq=True, scale_estimation=True)
        onnx.save(compressed, str(out))
        return out

    return build


def variants(blocks: Sequence[int]) -> list[Variant]:
    """Every row for ``blocks``, in build order (the fp32 export is built separately, first)."""
    fast, ours_rows, slow = [], [], []
    for b in blocks:
        fast += [
            Variant(f"ort_rtn_sym_b{b}", "ORT DEFAULT (RTN) sym", b, ort_matmul_nbits("rtn", b, True)),
            Variant(f"ort_rtn_asym_b{b}", "ORT DEFAULT (RTN) asym", b, ort_matmul_nbits("rtn", b, False)),
            Variant(f"ort_rtn_asym_acc4_b{b}", "ORT DEFAULT (RTN) asym, accuracy_level=4", b,
                    ort_matmul_nbits("rtn", b, False, accuracy_level=4)),
            Variant(f"nncf_asym_awq_se_b{b}", "NNCF INT4_ASYM + AWQ + scale estimation", b, _nncf(b)),
        ]
        ours_rows += [
            Variant(f"ours_w4_embfloat_b{b}", "ours w4, embeddings float", b, _ours(b, True)),
            Variant(f"ours_w4_b{b}", "ours w4 as shipped (int4 embeddings)", b, _ours(b, False)),
        ]
        slow += [Variant(f"ort_hqq_b{b}", "ORT HQQ", b, ort_matmul_nbits("hqq", b, False))]
    slow += [Variant(f"ours_w4_int8compute_embfloat_b{b}", "ours w4(compute=\"int8\"), embeddings float", b,
                     _ours(b, True, compute="int8")) for b in blocks]
    slow += [Variant(f"ort_gptq_sym_b{b}", "ORT GPTQ sym", b, ort_matmul_nbits("gptq", b, True)) for b in blocks]
    slow += [Variant(f"ort_gptq_asym_b{b}", "ORT GPTQ asym", b, ort_matmul_nbits("gptq", b, False)) for b in blocks]
    return fast + ours_rows + slow
