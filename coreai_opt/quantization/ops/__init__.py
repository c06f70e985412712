"""The ``torch.library`` custom ops of fake quantization: eager kernel, fake kernel, STE autograd, ONNX translation.

``coreai_opt::quantize_dequantize`` (:mod:`~coreai_opt.quantization.ops.quantize_dequantize_op`, static qparams)
and ``coreai_opt::dynamic_quantize_dequantize`` (:mod:`~coreai_opt.quantization.ops.dynamic_quantize_op`,
per-tensor uint8 qparams from each tensor). The int8-compute op of ``MatMulNBits`` lives with its feature in
:mod:`coreai_opt.quantization.matmul_nbits`.
"""
