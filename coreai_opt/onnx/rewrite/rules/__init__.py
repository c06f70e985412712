"""The ONNX rewrite rules, one rule per file; :mod:`coreai_opt.onnx.rewrite` runs them in order."""
