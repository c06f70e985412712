"""Suite-wide settings: the reference models in tests are tiny, where one intra-op thread is fastest.

pyproject's addopts run the suite on pytest-xdist workers (``-n auto --dist loadfile``: one per physical core, a
file's tests on one worker, so module fixtures are built once). Each worker imports this file, so it keeps one torch
thread exactly as the single-process run did, and every pinned number (fingerprints, bit-exact parity) sees the
same thread count. Nothing shares state across workers: files go to ``tmp_path``, caches to
``$COREAI_OPT_CACHE`` / ``$COREAI_OPT_CACHE_DIR`` under it, gloo ranks meet on a free port
(tests/distributed/dist_harness.py) or a file in ``tmp_path``, hypothesis runs ``derandomize=True`` (no example
database), and tests/memory measures the RSS of its own subprocess. ``-n 0`` runs in-process (pdb, ``-s``).

transformers and timm import torchvision, whose CUDA-only wheel cannot load its C++ ops beside the CPU torch;
declaring the two op schemas it needs first lets both import (see benchmarks/common/torchvision_ops.py).
"""

from __future__ import annotations

import torch

from benchmarks.common.torchvision_ops import declare_torchvision_ops

torch.set_num_threads(1)
declare_torchvision_ops()
