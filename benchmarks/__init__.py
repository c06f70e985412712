"""Side-by-side benchmarks of coreai_opt against onnxruntime.quantization and NNCF (``python -m benchmarks.run``)."""
