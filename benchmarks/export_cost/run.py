"""Time ``export_onnx`` against torch's float export of the same model, rounds interleaved; write the table.

Issue 29 asks ``export_onnx`` to take at most 1.5x a float dynamo export, median and worst. The float export a ratio
is taken against must make the same shapes dynamic: a symbolic axis costs torch's exporter most of its time
(symbolic shape arithmetic in ``torch.export`` and ``run_decompositions``), so comparing our dynamic batch and
sequence with a float export that fixes the sequence inflates the ratio. Here the float export's
``dynamic_shapes`` are read from our file (:func:`benchmarks.common.onnx_utils.same_axes`: every input dimension our
file names is a ``torch.export.Dim`` of that name in the float export, so shared names stay shared).

Per model: the corpus pipeline's calibration batches (:class:`benchmarks.corpus.runner.RunOptions`), ours =
``QuantizerConfig.presets.w8a8()`` -> calibrate -> convert; one untimed ``export_onnx`` (warm-up, and the file
whose axes the float export copies); then ``--rounds`` rounds, each timing the float export then ours. The ratio
is the median of the per-round ratios, its spread their minimum and maximum. One row per model goes to
``rows.jsonl`` (the latest row of a model wins in the table).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.onnx_utils import same_axes
from benchmarks.common.results_file import append_row, read_rows, write_part
from benchmarks.common.study import BENCHMARKS, quiet_libraries

__all__ = ["EXPORT_GOAL", "configure", "export_cost", "main", "write_table"]

FOLDER = BENCHMARKS / "export_cost"
#: Issue 29: export_onnx <= 1.5x the float export, median and worst.
EXPORT_GOAL = 1.5


def configure(parser: argparse.ArgumentParser) -> None:
    """The study's options (module docstring)."""
    parser.add_argument("--models", nargs="*", default=None, help="corpus model names (default: all 40)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per model")
    parser.add_argument("--rows", type=Path, default=FOLDER / "rows.jsonl", help="the rows file (appended)")
    parser.add_argument("--output", type=Path, default=FOLDER / "RESULTS.md", help="markdown page")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/coreai_opt_export_cost"), help="the files")
    parser.add_argument("--table", action="store_true", help="only rewrite the page from the rows file")


def _float_export(model: Any, example: Sequence[Any], names: Sequence[str], axes: tuple[dict[int, Any], ...],
                  path: Path) -> None:
    import torch

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, tuple(example), str(path), dynamo=True, external_data=False, verbose=False,
                          input_names=list(names), dynamic_shapes=axes)


def export_cost(name: str, work: Path, rounds: int) -> dict[str, Any]:
    """One row for corpus model ``name`` (module docstring); a failing stage is recorded, never raised."""
    import torch

    import coreai_opt as co
    from benchmarks.corpus.models import corpus_entry
    from benchmarks.corpus.runner import RunOptions

    entry, options = corpus_entry(name), RunOptions()
    work.mkdir(parents=True, exist_ok=True)
    row: dict[str, Any] = {"name": name}
    try:
        torch.manual_seed(options.seed)
        model = entry.build().eval()
        gen = torch.Generator().manual_seed(options.seed + 1)
        calib = [entry.inputs(gen, options.calib_batch) for _ in range(options.calib_batches)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), calib[0])
            co.calibrate(prepared, calib, progress=False)
            converted = co.convert(prepared)
            ours = co.export_onnx(converted, calib[0], work / "ours.onnx", input_names=list(entry.input_names))
        axes = same_axes(ours)
        row["axes"] = [sorted(str(d) for d in a) for a in axes]
        seconds: dict[str, list[float]] = {"float": [], "ours": []}
        for _ in range(rounds):
            start = time.perf_counter()
            _float_export(model, calib[0], entry.input_names, axes, work / "float.onnx")
            seconds["float"].append(time.perf_counter() - start)
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                co.export_onnx(converted, calib[0], work / "ours.onnx", input_names=list(entry.input_names))
            seconds["ours"].append(time.perf_counter() - start)
        ratios = [o / f for o, f in zip(seconds["ours"], seconds["float"], strict=True)]
        row.update(seconds=seconds, ratio=statistics.median(ratios), spread=[min(ratios), max(ratios)])
    except Exception as exc:  # noqa: BLE001 (a row records any failure)
        row["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return row


def write_table(rows: dict[str, dict[str, Any]], output: Path) -> None:
    """The page: one line per model, then the median and worst ratio against :data:`EXPORT_GOAL`."""
    lines = ["| model | float export s (median) | export_onnx s (median) | ratio (min–max) |", "|---|---|---|---|"]
    ratios = []
    for name, row in sorted(rows.items()):
        if "ratio" not in row:
            lines.append(f"| {name} | - | - | {row.get('failed', 'not run')} |")
            continue
        ratios.append(row["ratio"])
        lo, hi = row["spread"]
        lines.append(f"| {name} | {statistics.median(row['seconds']['float']):.1f} | "
                     f"{statistics.median(row['seconds']['ours']):.1f} | {row['ratio']:.2f} ({lo:.2f}–{hi:.2f}) |")
    summary = "no model measured" if not ratios else (
        f"{len(ratios)} models: ratio median {statistics.median(ratios):.2f}, worst {max(ratios):.2f} "
        f"(goal <= {EXPORT_GOAL}: {'met' if max(ratios) <= EXPORT_GOAL else 'not met'})")
    body = "\n".join(["# export_onnx over a float export with the same dynamic axes (issue 29)", "",
                      f"**{summary}**", "", *lines])
    write_part(output, "table", body)


def main(args: argparse.Namespace) -> int:
    """Measure the chosen models (appending to ``--rows``), then rewrite ``--output``."""
    from benchmarks.corpus.models import CORPUS

    names = list(args.models or CORPUS)
    unknown = [n for n in names if n not in CORPUS]
    if unknown:
        print(f"unknown models {unknown}; known: {', '.join(CORPUS)}")
        return 2
    if not args.table:
        quiet_libraries()
        for name in names:
            row = export_cost(name, args.work_dir / name, args.rounds)
            append_row(args.rows, row)
            print(f"{name}: {row.get('ratio', row.get('failed'))}", flush=True)
    write_table({row["name"]: row for row in read_rows(args.rows)}, args.output)  # latest row wins
    return 0
