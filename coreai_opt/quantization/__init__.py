"""Tensor-level quantization; knows nothing about graphs.

Rooms: :mod:`~coreai_opt.quantization.spec` (``QuantizationSpec``, dtypes, granularities, qparams calculators,
the registry), :mod:`~coreai_opt.quantization.ranges` (range calculators), :mod:`~coreai_opt.quantization.rounding`
(weight rounding), :mod:`~coreai_opt.quantization.fake_quantize` (the inserted modules),
:mod:`~coreai_opt.quantization.ops` (``torch.library`` ops), :mod:`~coreai_opt.quantization.matmul_nbits`
(weight-only linears) and :mod:`~coreai_opt.quantization.collectives` (cross-rank merges).
"""
