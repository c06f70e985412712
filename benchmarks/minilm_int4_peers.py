"""onnxruntime's own 4-bit weight quantizers on MiniLM, on the same sentences as :mod:`benchmarks.minilm_int4`.

``MatMulNBitsQuantizer`` with its DEFAULT (round-to-nearest, symmetric or asymmetric) and HQQ algorithms on the
fp32 export; embeddings stay float (it quantizes MatMul only), so compare with the ``embeddings float`` rows.
Executed by onnxruntime (MatMulNBits with fp32 compute, accuracy level 0).

Usage: ``python -m benchmarks.minilm_int4_peers [--output PATH] [--blocks 32,128]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import onnx

from benchmarks import minilm_harness as H
from benchmarks import minilm_peers as peers


def ort_int4(float_path: Path, out_path: Path, algorithm: str, block: int, symmetric: bool) -> Path:
    """Quantize the MatMul weights of ``float_path`` with onnxruntime's ``MatMulNBitsQuantizer``."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    if algorithm == "rtn":
        config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=symmetric, accuracy_level=0)
    else:
        config = HQQWeightOnlyQuantConfig(block_size=block)
    quantizer = MatMulNBitsQuantizer(onnx.load(str(float_path)), block_size=block, is_symmetric=symmetric,
                                     algo_config=config)
    quantizer.process()
    quantizer.model.save_model_to_file(str(out_path), use_external_data_format=False)
    return out_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--blocks", default="32,128")
    args = parser.parse_args()
    model, tokenizer = H.load_minilm()
    calib = H.encode(tokenizer, H.read_sentences("calibration"))
    evaluation = H.encode(tokenizer, H.read_sentences("eval"))
    reference = H.torch_embed(model, evaluation)
    example = (calib.input_ids[:2], calib.attention_mask[:2])
    lines = ["| peer | block | mean cos | min cos | top-5 | build s |", "|---|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fp32 = peers.export_float(model, example, work / "fp32.onnx")
        for block in (int(b) for b in args.blocks.split(",")):
            for name, algorithm, symmetric in (("ORT RTN sym", "rtn", True), ("ORT RTN asym", "rtn", False),
                                               ("ORT HQQ", "hqq", False)):
                start = time.perf_counter()
                path = ort_int4(fp32, work / f"{algorithm}{symmetric}{block}.onnx", algorithm, block, symmetric)
                build = time.perf_counter() - start
                m = H.compare(reference, H.ort_embed(path, evaluation))
                print(json.dumps({"peer": name, "block": block, "mean_cos": m.mean_cosine, "min_cos": m.min_cosine,
                                  "top5": m.topk_agreement, "build_s": build}), flush=True)
                lines.append(f"| {name} | {block} | {m.mean_cosine:.4f} | {m.min_cosine:.4f} | "
                             f"{m.topk_agreement:.3f} | {build:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output is not None:
        args.output.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
