"""Command-line interface ``coreai-opt``: ``demo``, ``quantize`` and ``inspect`` subcommands.

The entry point is :func:`coreai_opt.cli.main.main`. Subcommand modules import torch lazily so that
``coreai-opt --help`` answers instantly.
"""
