"""``verify_onnx`` and its diagnostics: derived tolerances, the kernel table, fusion report and localisation.

The entry point is :mod:`~coreai_opt.onnx.verify.verify_onnx`; :mod:`~coreai_opt.onnx.verify.tolerance` derives
each output's bound from the kernels onnxruntime runs (:mod:`~coreai_opt.onnx.verify.ort_kernels`),
:mod:`~coreai_opt.onnx.verify.fusion_report` reads which layers run as integer kernels and
:mod:`~coreai_opt.onnx.verify.localize` names the first quantizer where eager and onnxruntime part.
"""
