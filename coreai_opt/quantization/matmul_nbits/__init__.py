"""Weight-only linears as onnxruntime's ``MatMulNBits``: weight packing and int8-compute emulation.

* :mod:`~coreai_opt.quantization.matmul_nbits.packing`: a quantized weight as ``MatMulNBits`` inputs;
* :mod:`~coreai_opt.quantization.matmul_nbits.int8_compute` and
  :mod:`~coreai_opt.quantization.matmul_nbits.int8_compute_op`: eager emulation of ``accuracy_level=4``
  (per-row, per-block int8 activations), the op ``coreai_opt::int8_compute_quantize`` and its module.

The ``matmul_compute`` spec field (``float`` / ``int8`` -> accuracy level) and the block-size rule a spec checks
are spec-level knowledge: :mod:`coreai_opt.quantization.spec.matmul_compute`. The graph and export sides of the
feature are the pass :mod:`coreai_opt.passes.int8_compute_inputs`, the rule
:mod:`coreai_opt.onnx.rewrite.rules.write_matmul_nbits` and the verify bound
:mod:`coreai_opt.onnx.verify.int8_compute_steps`.
"""
