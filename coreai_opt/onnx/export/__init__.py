"""``export_onnx`` and what it needs: capture routes, opset choice, dynamic axes, weight folding, atomic saving.

The entry point is :mod:`~coreai_opt.onnx.export.export_onnx`; the rewrite rules it applies after the trace are
:mod:`coreai_opt.onnx.rewrite`.
"""
