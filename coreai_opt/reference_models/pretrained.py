"""Trained weights shipped with the package: the digits CNN that ``coreai-opt demo`` quantizes.

Float training is not reproducible across CPUs: oneDNN and MKL choose their convolution and matmul kernels by
instruction set (and block by cache size), so the same seeded run sums in another order, and six epochs of SGD turn
last-bit differences into different networks. The demo's seed-0, six-epoch run gave 98.89 % test accuracy here,
99.11 % on an Intel machine and 99.56 % on this machine with ``ATEN_CPU_CAPABILITY=default
ONEDNN_MAX_CPU_ISA=AVX2``. The weights below were trained once (``coreai-opt demo --train --save-weights FILE``,
seed 0, 6 epochs, lr 1e-2, on AMD EPYC with the default kernels; 98.89 % on the 450 test digits) and are loaded
bit for bit on every machine; their sha256 is checked at load, so a damaged or edited file is an error and never a
silently different network.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from coreai_opt.errors import CoreaiOptFileNotFoundError, CoreaiOptRuntimeError
from coreai_opt.reference_models.conv_nets import DigitsCNN

__all__ = ["DIGITS_CNN_WEIGHTS", "DIGITS_CNN_SHA256", "sha256_of", "load_digits_cnn"]

#: The state dict of ``DigitsCNN()`` (``torch.save`` format, read with ``weights_only=True``).
DIGITS_CNN_WEIGHTS = Path(__file__).with_name("digits_cnn.pt")
#: sha256 of :data:`DIGITS_CNN_WEIGHTS`' bytes.
DIGITS_CNN_SHA256 = "e9bc915eaa8f5af2ffeb832f51a6730b1ec545539b83d0902956e9f0550cd20b"


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_digits_cnn(path: Path = DIGITS_CNN_WEIGHTS, sha256: str = DIGITS_CNN_SHA256) -> DigitsCNN:
    """Build ``DigitsCNN()`` in eval mode with the shipped trained weights, after checking the file's sha256.

    Args:
        path: The weights file (default: the one installed with the package).
        sha256: The hex sha256 the file must have.

    Returns:
        The trained network, in eval mode.

    Raises:
        CoreaiOptFileNotFoundError: The file is missing (a package built without its data files).
        CoreaiOptRuntimeError: The file's sha256 differs from ``sha256`` (a damaged or edited file).
    """
    path = Path(path)
    if not path.is_file():
        raise CoreaiOptFileNotFoundError(
            f"the trained digits CNN weights {path} are missing: the package was installed without its data "
            "files; reinstall it (pip install --force-reinstall coreai-opt-qdq) or train instead "
            "(coreai-opt demo --train)"
        )
    actual = sha256_of(path)
    if actual != sha256:
        raise CoreaiOptRuntimeError(
            f"the trained digits CNN weights {path} have sha256 {actual}, expected {sha256}: the file is damaged "
            "or was edited; reinstall the package (pip install --force-reinstall coreai-opt-qdq) or train instead "
            "(coreai-opt demo --train)"
        )
    model = DigitsCNN()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()
