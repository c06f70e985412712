"""Measure the placement audit model by model (resumable) and write ``benchmarks/audit/RESULTS.md``.

``python -m benchmarks.run audit --models hf-bert timm-resnet18 --label before`` measures those models and appends
one row each to ``rows.jsonl``; ``--set corpus|extra|all`` picks a whole set, ``--table`` only rewrites the page.
The page shows the latest row of every model and, per label, the median and worst latency ratio of the models that
label measured (so a "before" and an "after" run can be compared on the same models).

Per model: the corpus pipeline's calibration and evaluation batches (:class:`benchmarks.corpus.runner.RunOptions`),
ours = ``QuantizerConfig.presets.w8a8()`` → calibrate → convert → ``export_onnx``; peer = float dynamo export with
the same dynamic axes as our file (batch, and the sequence of token models: a file fixed to one sequence length
folds its shape arithmetic away, which ours cannot) → ``quant_pre_process`` → ``quantize_static`` (QDQ,
per-channel, U8S8, MinMax) on the same batches. Each file's
optimized graph (``ORT_ENABLE_ALL``, 1 thread) is read by :func:`benchmarks.audit.census.census`. Latency: batch 1,
1 thread, the two files timed in alternation (:func:`benchmarks.common.latency.measure`, :data:`RUNS_PER_ROUND` runs
per file and round); each round's time of a file is the fastest of its runs (machine load only ever adds time, so the
minimum is the run least disturbed by it), the ratio is the median of the per-round ratios ours / peer and its spread
their 25th–75th percentile; ``ours_ms`` / ``peer_ms`` are the medians of the per-round times. SQNR of each file's
output against the float model on the evaluation batches.

A model whose float output does not depend on its input (:func:`benchmarks.corpus.runner.input_dependence` below
:data:`DEGENERATE`: hf MobileNetV2, MobileViTV2 and EfficientNet, whose N(0, 0.02²) convolutions hand each
BatchNorm a signal far smaller than its randomized constants) ranks no quantizer: both files only reproduce one
constant vector. Its BatchNorm statistics are then measured on data
(:func:`coreai_opt.reference_models.batchnorm_statistics_from_data`, on batches of their own seed) before anything
is measured, and the row keeps the dependence before and after (``input_dependence``, flag ``BN from data``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common.results_file import append_row, read_rows, write_part
from benchmarks.common.study import BENCHMARKS, quiet_libraries
from benchmarks.corpus.models import CorpusModel

__all__ = ["DEGENERATE", "LATENCY_MARGIN", "SQNR_MARGIN_DB", "audit_model", "configure", "main", "write_table"]

FOLDER = BENCHMARKS / "audit"
LATENCY_MARGIN = 1.03  # issue 29: no model slower than 1.03x quantize_static
SQNR_MARGIN_DB = 0.5  # issue 29: SQNR >= the peer's - 0.5 dB
DEGENERATE = 1e-3  # input_dependence below which the float output is one constant for every input
RUNS_PER_ROUND = 10  # runs of each file per round; the round's time is the fastest


def _entries() -> dict[str, tuple[str, CorpusModel]]:
    from benchmarks.audit.models import EXTRA
    from benchmarks.corpus.models import CORPUS

    return {**{n: ("corpus", e) for n, e in CORPUS.items()}, **{n: ("extra", e) for n, e in EXTRA.items()}}


def configure(parser: argparse.ArgumentParser) -> None:
    """The study's options (module docstring)."""
    parser.add_argument("--models", nargs="*", default=None, help="model names (corpus or benchmarks/audit/models)")
    parser.add_argument("--set", choices=("corpus", "extra", "all"), default=None, help="a whole set of models")
    parser.add_argument("--label", default="run", help="label stored with each row (e.g. before / after)")
    parser.add_argument("--rounds", type=int, default=60, help="interleaved latency rounds per model")
    parser.add_argument("--rows", type=Path, default=FOLDER / "rows.jsonl", help="the rows file (appended)")
    parser.add_argument("--output", type=Path, default=FOLDER / "RESULTS.md", help="markdown page")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/coreai_opt_audit"),
                        help="keeps each model's ONNX files and optimized graphs")
    parser.add_argument("--table", action="store_true", help="only rewrite the page from the rows file")


def _round_times(samples: tuple[float, ...], runs_per_round: int) -> list[float]:
    """Each round's time: the fastest of its ``runs_per_round`` runs (module docstring)."""
    return [min(samples[r * runs_per_round:(r + 1) * runs_per_round]) for r in range(len(samples) // runs_per_round)]


def _per_round_ratios(ours: tuple[float, ...], peer: tuple[float, ...], runs_per_round: int) -> list[float]:
    return [a / b for a, b in zip(_round_times(ours, runs_per_round), _round_times(peer, runs_per_round), strict=True)]


def audit_model(name: str, family: str, entry: CorpusModel, work: Path, rounds: int) -> dict[str, Any]:
    """One row of the audit for ``entry`` (module docstring); a failing stage is recorded, never raised."""
    import torch

    import coreai_opt as co
    from benchmarks.audit.census import census
    from benchmarks.common.latency import measure
    from benchmarks.common.onnx_utils import same_axes, session
    from benchmarks.corpus.runner import (
        RunOptions,
        eager_outputs,
        export_float,
        input_dependence,
        quantize_static_peer,
        run_onnx,
        sqnr_db,
    )

    work.mkdir(parents=True, exist_ok=True)
    row: dict[str, Any] = {"name": name, "set": family, "seconds": {}}
    options = RunOptions()
    stage, start = "build", time.perf_counter()
    try:
        torch.manual_seed(options.seed)
        model = entry.build().eval()
        gen = torch.Generator().manual_seed(options.seed + 1)
        calib = [entry.inputs(gen, options.calib_batch) for _ in range(options.calib_batches)]
        evals = [entry.inputs(gen, options.eval_batch) for _ in range(options.eval_batches)]
        reference = eager_outputs(model, evals)
        row["input_dependence"] = [input_dependence(reference)]
        if row["input_dependence"][0] < DEGENERATE:
            from coreai_opt.reference_models import batchnorm_statistics_from_data

            statistics_gen = torch.Generator().manual_seed(options.seed + 2)
            batchnorm_statistics_from_data(model, [entry.inputs(statistics_gen, options.calib_batch)
                                                   for _ in range(options.calib_batches)], seed=options.seed)
            reference = eager_outputs(model, evals)
            row["input_dependence"].append(input_dependence(reference))
        names = entry.input_names
        files = {"ours": work / "ours.onnx", "peer": work / "peer.onnx"}
        stage = "ours"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), calib[0])
            co.calibrate(prepared, calib, progress=False)
            t = time.perf_counter()
            converted = co.convert(prepared)
            co.export_onnx(converted, calib[0], files["ours"], input_names=list(names))
            row["seconds"]["export"] = time.perf_counter() - t
        stage = "peer"
        t = time.perf_counter()
        export_float(model, calib[0], names, work / "float.onnx", same_axes(files["ours"]))
        row["seconds"]["float_export"] = time.perf_counter() - t
        quantize_static_peer(work / "float.onnx", names, calib, files["peer"])
        try:
            run_onnx(files["peer"], names, evals[:1])
        except Exception as exc:  # noqa: BLE001 - torch's float export with our axes computes garbage there
            # (T5 / MPNet relative position buckets under a symbolic sequence: a Gather index of -2**63 + 24);
            # both files are measured with a dynamic batch only (the peer's file then needs it; ours is exported
            # again with the same axes so that both graphs fold the same shape computations), and the row says so
            row["peer_axes"] = f"batch only: with our axes its file fails ({type(exc).__name__}: " \
                               f"{' '.join(str(exc).split())[:120]})"
            export_float(model, calib[0], names, work / "float.onnx")
            quantize_static_peer(work / "float.onnx", names, calib, files["peer"])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                co.export_onnx(converted, calib[0], files["ours"], input_names=list(names),
                               dynamic_shapes={name: {0: "batch"} for name in names})
        stage = "measure"
        for key, path in files.items():
            row[f"sqnr_{key}"] = sqnr_db(reference, run_onnx(path, names, evals))
            optimized = work / f"{key}.opt.onnx"
            session(path, threads=1, optimized_path=optimized)
            import onnx

            row[f"census_{key}"] = dataclasses.asdict(census(onnx.load(str(optimized))))
        runs = RUNS_PER_ROUND
        timing = measure(files, [t[:1].numpy() for t in evals[0]], threads=1, rounds=rounds, runs_per_round=runs)
        ratios = _per_round_ratios(timing["ours"].samples, timing["peer"].samples, runs)
        row["latency"] = {"ours_ms": statistics.median(_round_times(timing["ours"].samples, runs)),
                          "peer_ms": statistics.median(_round_times(timing["peer"].samples, runs)),
                          "ratio": statistics.median(ratios),
                          "p25": float(np.percentile(ratios, 25)), "p75": float(np.percentile(ratios, 75)),
                          "rounds": rounds, "runs_per_round": runs, "statistic": "fastest of the round's runs"}
    except Exception as exc:  # noqa: BLE001 - a failing stage is a measurement of this model, not a crash of the run
        row["failed"] = f"{stage}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    row["seconds"]["total"] = time.perf_counter() - start
    return row


def _latest(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in rows}


def _flags(row: dict[str, Any]) -> list[str]:
    flags = []
    lat, ours, peer = row.get("latency"), row.get("census_ours"), row.get("census_peer")
    if lat and lat["ratio"] > LATENCY_MARGIN:
        flags.append("slower")
    if ours and peer and ours["integer_compute"] < peer["integer_compute"]:
        flags.append("fewer int conv/matmul")
    if row.get("sqnr_ours") is not None and row.get("sqnr_peer") is not None \
            and row["sqnr_ours"] < row["sqnr_peer"] - SQNR_MARGIN_DB:
        flags.append("SQNR")
    if row.get("peer_axes"):
        flags.append("both: batch axis only")
    dependence = row.get("input_dependence", [1.0])
    if len(dependence) > 1:
        flags.append(f"BN from data (input dependence {dependence[0]:.0e} → {dependence[-1]:.2f})")
    if dependence[-1] < DEGENERATE:
        flags.append(f"degenerate output (input dependence {dependence[-1]:.0e})")
    return flags


def _diff(ours: dict[str, int], peer: dict[str, int]) -> str:
    parts = [f"{op} {ours.get(op, 0) - peer.get(op, 0):+d}" for op in sorted(set(ours) | set(peer))
             if ours.get(op, 0) != peer.get(op, 0)]
    return ", ".join(parts) or "="


def _summary(rows: list[dict[str, Any]], label: str) -> str:
    measured = [r for r in rows if r.get("latency")]
    if not measured:
        return f"| {label} | 0 | – | – | – |"
    ratios = sorted((r["latency"]["ratio"], r["name"]) for r in measured)
    slower = sum(x > LATENCY_MARGIN for x, _ in ratios)
    return (f"| {label} | {len(measured)} | {statistics.median(x for x, _ in ratios):.3f} | "
            f"{ratios[-1][0]:.3f} ({ratios[-1][1]}) | {slower} |")


def write_table(rows: list[dict[str, Any]], path: Path) -> None:
    """Write the table block of the page: per-label summary, then the latest row of every model (module docstring)."""
    latest = _latest(rows)
    lines = ["# Placement audit: ours vs onnxruntime quantize_static (issue 29)", "",
             "Generated by `python -m benchmarks.run audit` (module docstring of `benchmarks/audit/run.py`): w8a8 "
             "preset vs `quantize_static` (QDQ, per-channel, U8S8, MinMax) on the same calibration batches. Counts "
             "are of onnxruntime's optimized graph (ORT_ENABLE_ALL, CPU, 1 thread); *float between* = float ops on "
             "a path from a dequantize back to a quantize (`benchmarks/audit/census.py`). Latency: batch 1, 1 thread, "
             "ours and the peer interleaved round by round; ratio = median of the per-round ratios, spread = their "
             "25th–75th percentile. Rows with `runs_per_round` take each round's fastest run (labels from "
             "`best-of-10` on); older rows took the median of all runs.", "",
             "## Latency ratio ours / quantize_static by run label", "",
             "| label and set | models | median | worst | slower than 1.03× |", "|---|---|---|---|---|"]
    labels = list(dict.fromkeys(r.get("label", "run") for r in rows))
    for label in labels:
        by_name = _latest([r for r in rows if r.get("label", "run") == label])
        for subset in ("corpus", "extra"):
            chosen = [r for r in by_name.values() if r["set"] == subset]
            if chosen:
                lines.append(_summary(chosen, f"{label}, {subset}"))
        lines.append(_summary(list(by_name.values()), f"{label}, all"))
    lines += ["", "## Per model (latest row)", "",
              "| model | set | label | int kernels ours / peer | Q / DQ left ours / peer | float between ours / peer | "
              "float between, ours − peer by op | latency ms ours / peer | ratio (p25–p75) | SQNR dB ours / peer | "
              "flags |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in sorted(latest.items(), key=lambda kv: (kv[1]["set"], kv[0])):
        if r.get("failed"):
            lines.append(f"| {name} | {r['set']} | {r.get('label', 'run')} | failed: {r['failed']} "
                         "| | | | | | | |")
            continue
        o, p, lat = r["census_ours"], r["census_peer"], r["latency"]
        lines.append(
            f"| {name} | {r['set']} | {r.get('label', 'run')} "
            f"| {o['integer_compute']}+{o['other_integer']} / {p['integer_compute']}+{p['other_integer']} "
            f"| {o['quantize']}/{o['dequantize']} / {p['quantize']}/{p['dequantize']} "
            f"| {sum(o['float_between'].values())} / {sum(p['float_between'].values())} "
            f"| {_diff(o['float_between'], p['float_between'])} "
            f"| {lat['ours_ms']:.3f} / {lat['peer_ms']:.3f} | {lat['ratio']:.3f} ({lat['p25']:.2f}–{lat['p75']:.2f}) "
            f"| {r['sqnr_ours']:.1f} / {r['sqnr_peer']:.1f} | {', '.join(_flags(r))} |")
    lines += ["", "Integer kernels are written conv/matmul + others (QLinearAdd, QLinearConcat, ...)."]
    write_part(path, "audit", "\n".join(lines))  # text outside the block (findings by hand) is kept


def main(args: argparse.Namespace) -> int:
    """Measure the chosen models (appending to ``--rows``), then rewrite ``--output``; 0 unless a name is unknown."""
    entries = _entries()
    names = list(args.models or [])
    if args.set:
        names += [n for n, (s, _) in entries.items() if args.set in (s, "all")]
    unknown = [n for n in names if n not in entries]
    if unknown:
        print(f"unknown models {unknown}; known: {', '.join(entries)}")
        return 2
    if not args.table:
        quiet_libraries()
        for name in names:
            family, entry = entries[name]
            row = audit_model(name, family, entry, args.work_dir / name, args.rounds)
            row["label"] = args.label
            append_row(args.rows, row)
            ratio = f"ratio {row['latency']['ratio']:.3f}" if row.get("latency") else row.get("failed", "")
            print(f"{name}: {ratio} SQNR {row.get('sqnr_ours')} / {row.get('sqnr_peer')} "
                  f"({row['seconds']['total']:.0f} s)", flush=True)
    write_table(read_rows(args.rows), args.output)
    return 0
