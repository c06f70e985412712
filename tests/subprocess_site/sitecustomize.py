"""Test fixture for CLI subprocesses: declare torchvision's op schemas before anything imports it.

The test environment's torchvision 0.28.0 wheel cannot load its C++ ops beside torch 2.13.0+cpu, and transformers
imports torchvision lazily, so a ``coreai-opt quantize ./my-bert`` subprocess would fail where a user with a
matching torchvision succeeds. ``tests/test_examples.py`` puts this directory on the subprocess's ``PYTHONPATH``
(with the repository root, for :mod:`benchmarks.common.torchvision_ops`). Never installed; test setup only.
"""

from benchmarks.common.torchvision_ops import declare_torchvision_ops

declare_torchvision_ops()
