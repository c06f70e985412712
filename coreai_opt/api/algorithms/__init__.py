"""Algorithms around prepare → calibrate → convert: SmoothQuant, AWQ, calibration search, sensitivity, auto.

Each is an entry point of its own (``smooth_quant``, ``awq``, ``search_calibration``, ``sensitivity``,
``auto_quantize``), re-exported from :mod:`coreai_opt`.
"""
