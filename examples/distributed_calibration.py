"""Data-parallel calibration: every rank calibrates on its shard, statistics merge, rank 0 exports ONNX.

Run on CPU with two processes (gloo)::

    torchrun --nproc_per_node=2 examples/distributed_calibration.py [--activation-range percentile] [--out DIR]

Without torchrun it runs as a single process and writes the same ONNX file, byte for byte: the script pins torch to
one thread (``TORCH_THREADS``), as torchrun does for each rank with ``OMP_NUM_THREADS=1``. Without that pin the
float training would differ with the thread count (20 of 29 initializers did). The steps:

1. ``init_process_group("gloo", timeout=...)``: the timeout bounds every wait if a rank dies.
2. Rank 0 trains the float model and saves it once (``save_on_main``); every rank loads the same weights.
3. Each rank takes every ``world_size``-th calibration batch and runs ``co.calibrate`` (``sync="auto"``
   merges the statistics across ranks before the qparams are committed; only rank 0 shows progress).
4. ``check_synchronized`` proves every parameter and buffer (all scales and zero points) is bitwise equal
   on all ranks, then rank 0 alone writes the ONNX file (``run_on_main``) and checks it in onnxruntime.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import coreai_opt as co
from coreai_opt.api.distributed import (
    check_synchronized,
    get_rank,
    get_world_size,
    is_main_process,
    run_on_main,
    save_on_main,
)
from coreai_opt.datasets import load_digits_split, train_classifier
from coreai_opt.reference_models import DigitsCNN

SEED = 0
BATCH_SIZE = 32
CALIBRATION_BATCHES = 16
# torchrun starts every rank with OMP_NUM_THREADS=1; the same single thread in a plain run keeps the float training
# (and so the ONNX file) identical however the script is started.
TORCH_THREADS = 1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--activation-range", default="minmax", choices=["minmax", "moving_average", "percentile", "mse", "entropy"]
    )
    parser.add_argument("--out", type=Path, default=Path("example_outputs"))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any rank may wait for the others")
    parser.add_argument("--epochs", type=int, default=4)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(TORCH_THREADS)
    if "RANK" in os.environ and not dist.is_initialized():  # started by torchrun
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = get_rank(), get_world_size()
    args.out.mkdir(parents=True, exist_ok=True)

    # 1. The same float weights on every rank: trained once on rank 0, loaded everywhere.
    split = load_digits_split(seed=SEED)
    checkpoint = args.out / "digits_float.pt"

    def train_and_save(path: Path) -> None:
        torch.manual_seed(SEED)  # the initial weights, too, must not depend on how the process was started
        model = train_classifier(DigitsCNN(), split, epochs=args.epochs, lr=1e-2, seed=SEED)
        torch.save(model.state_dict(), path)

    save_on_main(train_and_save, checkpoint)
    model = DigitsCNN()
    model.load_state_dict(torch.load(checkpoint, weights_only=True))
    model.eval()

    # 2. Shard the calibration set by rank and calibrate; statistics are merged across ranks.
    batches = [split.x_train[i : i + BATCH_SIZE] for i in range(0, CALIBRATION_BATCHES * BATCH_SIZE, BATCH_SIZE)]
    shard = batches[rank::world]
    example_inputs = (split.x_train[:BATCH_SIZE],)
    config = co.QuantizerConfig.presets.w8a8(activation_range=args.activation_range)
    prepared = co.prepare(model, config, example_inputs)
    co.calibrate(prepared, shard)  # sync="auto"
    converted = co.convert(prepared)

    # 3. Every parameter and buffer (scales, zero points, statistics) is identical on every rank.
    compared = check_synchronized(converted)
    print(
        f"[rank {rank}/{world}] calibrated on {len(shard)} of {len(batches)} batches; "
        f"{compared} tensors identical across ranks",
        flush=True,
    )

    # 4. One file, written by rank 0; the other ranks wait for it (and would see its failure).
    path = args.out / f"digits_dp_{args.activation_range}.onnx"
    run_on_main(co.export_onnx, converted, example_inputs, path)
    if is_main_process():
        report = co.verify_onnx(converted, path, split.x_test)
        print(report)
        print(f"wrote {path}")
        if not report.ok:
            raise SystemExit("onnxruntime disagrees with the eager quantized model")

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
