"""The ``coreai-opt`` subcommands, one module each: ``add_parser(subparsers, parents)`` and ``run(args, console)``.

``quantize`` (a model file or a Hugging Face folder to a quantized ONNX file), ``demo`` (the shipped digits CNN end
to end) and ``inspect`` (a summary of an ONNX file's quantized nodes). The modules beside this folder in
:mod:`coreai_opt.cli` are the helpers they share.
"""
