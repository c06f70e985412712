"""``python -m benchmarks.run verify PART``: verify_onnx on the corpus (issue 28), one part of RESULTS.md per PART.

* ``mutations``: single defects on :data:`~benchmarks.verify.corpus_verify.MUTATION_MODELS` (w8a8);
* ``clean``: every clean corpus export (``--presets``, default w8a8), with token agreement on decoders;
* ``cost``: verify time with / without the per-quantizer comparison on five zoo models, interleaved rounds.

Each measurement is also appended to ``<work-dir>/<part>.jsonl`` as it is made; the ``clean`` and ``mutations``
parts reuse the rows already in their work dir's log (several runs with ``--models`` subsets can share the models,
and a last run over all of them writes the whole table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.common.results_file import write_part
from benchmarks.common.study import BENCHMARKS, quiet_libraries

__all__ = ["configure", "run"]

DEFAULT_OUTPUT = BENCHMARKS / "verify" / "RESULTS.md"


def configure(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m benchmarks.run verify``."""
    parser.add_argument("part", choices=("mutations", "clean", "cost"))
    parser.add_argument("--models", nargs="*", default=None, help="corpus models (default: the part's own list)")
    parser.add_argument("--presets", nargs="+", default=["w8a8"], help="clean part: presets to export")
    parser.add_argument("--rounds", type=int, default=10, help="cost part: interleaved rounds")
    parser.add_argument("--work-dir", type=Path, default=None, help="ONNX files and jsonl logs (default: temp dir)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)


def _mutations(args: argparse.Namespace, work: Path) -> str:
    from benchmarks.corpus.runner import RunOptions
    from benchmarks.verify.corpus_verify import (
        MUTATION_MODELS,
        append_jsonl,
        export_corpus_model,
        models_of,
        mutation_outcomes,
    )
    from benchmarks.verify.mutations import MUTATIONS, DefectOutcome

    options = RunOptions(eval_batches=2)
    log = work / "mutations.jsonl"
    done: dict[str, dict[str, DefectOutcome]] = {}
    for line in log.read_text(encoding="utf-8").splitlines() if log.exists() else []:
        record = json.loads(line)
        model = record.pop("model")
        done.setdefault(model, {})[record["defect"]] = DefectOutcome(**record)
    columns: dict[str, dict[str, DefectOutcome]] = {}
    for entry in models_of(args.models or MUTATION_MODELS):
        if len(done.get(entry.name, {})) == len(MUTATIONS):  # measured by an earlier run into this work dir
            columns[entry.name] = done[entry.name]
            continue
        export = export_corpus_model(entry, "w8a8", work / entry.name, options)
        outcomes = mutation_outcomes(export, work / entry.name)
        columns[entry.name] = {o.defect: o for o in outcomes}
        for o in outcomes:
            append_jsonl(log, {"model": entry.name, **o.__dict__})
            print(f"{entry.name} {o.defect}: {o.status} change={o.output_change} first={o.first_quantizer}",
                  flush=True)
    names = list(columns)
    lines = ["## Single defects on corpus models (w8a8, 2 evaluation batches of 8)", "",
             "Cell: max |mutated - clean| of onnxruntime's output, then F (flagged) / o (ok) / MISSED (the output "
             "changed and verify_onnx said ok); `-` the file has no site for the defect; `no run` onnxruntime "
             "rejects the mutated file.", "",
             "| defect | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 1)]
    for defect in MUTATIONS:
        lines.append(f"| {defect} | " + " | ".join(columns[n][defect].cell for n in names) + " |")
    outcomes = [o for col in columns.values() for o in col.values()]
    changed = [o for o in outcomes if o.status in ("flagged", "missed")]
    named = [o for o in changed if o.status == "flagged" and o.first_quantizer is not None]
    unchanged_flagged = [o for o in outcomes if o.status == "output unchanged" and o.flagged]
    lines += ["", f"Output-changing defects: {len(changed)}; flagged: {sum(o.status == 'flagged' for o in changed)}; "
              f"flagged with the first failing quantizer named: {len(named)}; missed: "
              f"{sum(o.status == 'missed' for o in changed)}. Defects that left the output unchanged: "
              f"{sum(o.status == 'output unchanged' for o in outcomes)} (of them flagged: {len(unchanged_flagged)}); "
              f"no site: {sum(o.status == 'no site' for o in outcomes)}; no run: "
              f"{sum(o.status == 'does not run' for o in outcomes)}. Median verify time of a mutated file: "
              f"{statistics.median(o.seconds for o in outcomes if o.flagged is not None):.1f} s."]
    return "\n".join(lines)


def _clean(args: argparse.Namespace, work: Path) -> str:
    from benchmarks.verify.corpus_verify import CleanRow, append_jsonl, clean_row, models_of

    log = work / "clean.jsonl"
    done = {} if not log.exists() else {(r.name, r.preset): r for r in (
        CleanRow(**json.loads(line)) for line in log.read_text(encoding="utf-8").splitlines() if line.strip())}
    rows = []
    for preset in args.presets:
        for entry in models_of(args.models):
            if (entry.name, preset) in done:  # measured by an earlier (or a parallel) run into the same work dir
                rows.append(done[entry.name, preset])
                continue
            rows.append(clean_row(entry, preset, work / entry.name))
            append_jsonl(log, rows[-1])
            print(rows[-1], flush=True)
    lines = ["## Clean corpus exports (8 evaluation batches of 8)", "",
             "| model | family | preset | verify ok | rule | max steps / allowed | quantizers (failing) | top-1 "
             "(positions, near-tie flips) | export s | verify s |", "|" + " --- |" * 10]
    for r in rows:
        if r.error:
            lines.append(f"| {r.name} | {r.family} | {r.preset} | {r.error} | | | | | | |")
            continue
        steps = "-" if r.steps is None else f"{r.steps:.2f}"
        top1 = "-" if r.top1 is None else f"{100 * r.top1:.2f}% ({r.positions}, {r.near_tie_flips})"
        if r.flips:
            top1 += f": {r.flips}"
        failing = f"{r.quantizers} ({0 if r.failing_quantizer is None else 'first: ' + r.failing_quantizer})"
        lines.append(f"| {r.name} | {r.family} | {r.preset} | {r.ok} | {r.rule} | {steps} / {r.allowed} | {failing} "
                     f"| {top1} | {r.export_seconds:.1f} | {r.verify_seconds:.1f} |")
    for preset in args.presets:
        ran = [r for r in rows if r.preset == preset and r.error is None]
        lines.append(f"\n{preset}: verify ok on {sum(bool(r.ok) for r in ran)}/{len(ran)} clean exports "
                     f"({sum(r.preset == preset and r.error is not None for r in rows)} did not export).")
    return "\n".join(lines)


def _cost(args: argparse.Namespace, work: Path) -> str:
    from benchmarks.verify.cost import measure_cost

    rows = measure_cost(args.rounds)
    lines = ["## Cost of the per-quantizer comparison (zoo, w8a8, 4 batches of 16)", "",
             f"{rows[0].rounds} interleaved rounds; ratio = verify_onnx(check_quantizers=True) / (False), per round.",
             "", "| model | s with | s without | ratio median (p25-p75) |", "| --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.name} | {r.seconds_with:.2f} | {r.seconds_without:.2f} | {r.ratio:.2f} "
                     f"({r.ratio_p25:.2f}-{r.ratio_p75:.2f}) |")
    total_with, total_without = sum(r.seconds_with for r in rows), sum(r.seconds_without for r in rows)
    lines.append(f"\nSum of medians: {total_with:.2f} s / {total_without:.2f} s = {total_with / total_without:.2f}x.")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run one part and write its block of RESULTS.md."""
    quiet_libraries()
    from benchmarks.common.torchvision_ops import declare_torchvision_ops

    declare_torchvision_ops()
    part = {"mutations": _mutations, "clean": _clean, "cost": _cost}[args.part]
    with tempfile.TemporaryDirectory(prefix="verify_study_") as tmp:
        work = args.work_dir or Path(tmp)
        text = part(args, work)
    write_part(args.output, args.part, text)
    print(text)
    return 0
