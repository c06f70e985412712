"""Run the sweep in chunks, resumably, one child process per model with a time budget; write the table.

``python -m benchmarks.run sweep --chunk 0/2 --budget 600`` runs chunk 0 of 2 of
:func:`benchmarks.sweep.catalog.sweep_entries`: the chunks are balanced by each model's wall time in the study's
earlier rows (:func:`chunk_names`), so two loops end together. It runs the entries that have no row in
``<out>/rows.jsonl`` yet, each in its own process (forked from the chunk's parent, which imported the libraries once:
:mod:`benchmarks.sweep.forked`; a crash or a hang costs one row), and rewrites ``<out>/RESULTS.md`` from every
row so far (``--out`` defaults to ``benchmarks/sweep/``, the study's folder).
A row records the stage our pipeline reached (prepare → calibrate → convert → export → verify), the error class
(exception type and message with numbers masked), SQNR against float of our file and of ``quantize_static``'s,
the integer kernels onnxruntime runs in each, and the seconds spent.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import re
import signal
import sys
import time
import traceback
from pathlib import Path

__all__ = ["chunk_names", "error_class", "expected_seconds", "failure_classes", "last_rows", "main",
           "torch_exports", "write_table"]

STAGES = ("build", "prepare", "calibrate", "convert", "export", "verify")


def error_class(error: str | None) -> str:
    """``"Type: message"`` with numbers, shapes and quoted names masked, so one cause groups into one class."""
    if not error:
        return ""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", error.splitlines()[0])
    return re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)[:120]


#: Seconds the child keeps of the parent's budget to write its row after its own alarm.
ROW_GRACE = 20.0


#: Functions whose frame on the stack names the stage a child was in when its budget ran out (outermost wins).
STAGE_FUNCTIONS = {"build": "build", "prepare": "prepare", "calibrate": "calibrate", "convert": "convert",
                   "export_onnx": "export", "verify_onnx": "verify", "export_float": "ort_float_export",
                   "_quantize_static": "ort_quantize"}


#: Stages of the peer (``quantize_static``'s side), run after ours: a budget that runs out there leaves our row whole.
PEER_STAGES = frozenset({"ort_float_export", "ort_quantize"})


class BudgetExceeded(BaseException):
    """Raised in the child by its alarm. A ``BaseException`` (as ``KeyboardInterrupt``), so that no ``except
    Exception`` of the library or the runner turns it into a failure of the stage it interrupted."""

    def __init__(self, message: str, stage: str = "-") -> None:
        super().__init__(message)
        self.stage = stage


def running_stage(frame: object) -> str:
    """The pipeline stage whose function is outermost on ``frame``'s stack (``"-"`` when none is)."""
    for summary in traceback.extract_stack(frame):  # outermost first
        if summary.name in STAGE_FUNCTIONS:
            return STAGE_FUNCTIONS[summary.name]
    return "-"


def start_budget_alarm(seconds: float) -> None:
    """From now on, raise :class:`BudgetExceeded` naming the running stage after ``seconds`` (SIGALRM)."""

    def expire(signum: int, frame: object) -> None:
        stage = running_stage(frame)
        raise BudgetExceeded(f"over the {seconds:.0f} s budget of the child in {stage}", stage)

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, int(seconds)))


def start_memory_watch(name: str, limit_gib: float) -> None:
    """From now on, end the child with a ``memory`` row naming the running stage once its resident set passes
    ``limit_gib`` (polled twice a second), before the kernel's out-of-memory killer picks a process of the machine."""
    import os
    import threading

    main_id = threading.main_thread().ident
    page = os.sysconf("SC_PAGE_SIZE")

    def watch() -> None:
        while True:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * page
            if rss > limit_gib * 2**30:
                stage = running_stage(sys._current_frames()[main_id])
                row = {"name": name, "failed_stage": "memory",
                       "error": f"MemoryExceeded: over the {limit_gib:g} GiB memory limit of the child in {stage}"}
                # the process's own stdout: a stage may have redirected sys.stdout (the peer's float export does)
                print("SWEEP-ROW " + json.dumps(row), file=sys.__stdout__, flush=True)
                os._exit(0)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def _run_one(name: str, out: Path) -> dict[str, object]:
    """The row of one model. A budget that runs out in the peer's stages (after ours finished) is the peer's
    failure: our stages stay measured and the row records it as ``ort_error``."""
    from benchmarks.corpus.runner import CorpusRow, RunOptions, run_corpus_model
    from benchmarks.sweep.catalog import entry_named

    entry = entry_named(name)
    row = CorpusRow(entry.name, entry.family)
    try:
        run_corpus_model(entry, out / "work", RunOptions(calib_batches=2, eval_batches=2), row=row)
    except BudgetExceeded as exc:
        if exc.stage not in PEER_STAGES:
            raise
        row.ort_error = f"BudgetExceeded: {exc}"
    record = dataclasses.asdict(row)
    record["end_to_end_ok"] = row.end_to_end_ok
    return record


def _child(name: str, out: Path, budget: float, memory_gib: float, threads: int = 1) -> None:
    """A child's whole work: one model's row on stdout (``SWEEP-ROW {...}``) within ``budget`` and ``memory_gib``,
    computing on ``threads`` torch threads."""
    import torch

    torch.set_num_threads(threads)
    start_budget_alarm(budget - ROW_GRACE)  # the parent's kill at the budget stays the backstop
    start_memory_watch(name, memory_gib)
    try:
        row = _run_one(name, out)
    except BudgetExceeded as exc:
        row = {"name": name, "failed_stage": "timeout", "error": f"BudgetExceeded: {exc}"}
    print("SWEEP-ROW " + json.dumps(row, default=str), flush=True)


def _crash_error(returncode: int, stderr: str) -> str:
    """What ended a child without a row: the signal that killed it (the kernel's OOM killer sends SIGKILL) or its
    last stderr line that is not a transformers / timm log line."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            name = signal.Signals(-returncode).name
            return f"Crash: killed by {name}" + (" (the out-of-memory killer?)" if name == "SIGKILL" else "")
    lines = [line for line in stderr.strip().splitlines() if line.strip() and not line.startswith(("[", "WARNING"))]
    return lines[-1] if lines else f"Crash: exit code {returncode}, nothing on stderr"


def _stage_reached(row: dict[str, object]) -> str:
    failed = row.get("failed_stage")
    if failed in ("timeout", "crash", "memory"):
        return str(failed)
    if failed is None:
        return "verify ok" if row.get("verify_ok") else "verify not ok"
    index = STAGES.index(str(failed)) if failed in STAGES else 0
    return f"{STAGES[index - 1] if index else '-'} (failed in {failed})"


def torch_exports(row: dict[str, object]) -> bool | None:
    """Whether torch's own float export (``torch.onnx.export(dynamo=True)``, the peer's first step) succeeded for
    the row's model (None: the peer never ran: the model did not build, or the child timed out or crashed)."""
    seconds = row.get("seconds")
    if not isinstance(seconds, dict) or "ort_float_export" not in seconds:
        return None
    return "ort_quantize" in seconds  # the quantize step runs only after the float export returned


def failure_classes(rows: list[dict[str, object]]) -> list[tuple[str, str, int, int]]:
    """``(where, class, rows, rows torch cannot export either)`` for every row not ok end to end, most rows first.

    ``where`` separates the catalog's own faults (``build``: the model did not build or run in float), the runner's
    limits (``timeout in <stage>`` / ``memory in <stage>``: the child's alarm or memory watch fired in that stage;
    ``timeout`` / ``crash`` without a
    stage: the child was killed) and our stages (``prepare`` ... ``verify``).
    """
    counts: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        if r.get("end_to_end_ok"):
            continue
        failed = r.get("failed_stage")
        where = str(failed) if failed else "verify not ok"
        if str(r.get("error", "")).startswith(("BudgetExceeded", "MemoryExceeded")):
            where = f"{failed} in {str(r['error']).rsplit(' in ', 1)[-1]}"
        key = (where, error_class(r.get("error")) if failed else "")
        entry = counts.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += torch_exports(r) is False
    return sorted(((w, c, n, t) for (w, c), (n, t) in counts.items()), key=lambda x: (-x[2], x[0], x[1]))


def _stage_seconds(rows: list[dict[str, object]]) -> str:
    totals: dict[str, float] = {}
    for r in rows:
        for stage, seconds in (r.get("seconds") or {}).items():
            totals[stage] = totals.get(stage, 0.0) + float(seconds)
    whole = sum(totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{stage} {v:.0f} s ({100 * v / whole:.0f} %)" for stage, v in ranked)


def write_table(rows: list[dict[str, object]], path: Path, wall_seconds: float) -> None:
    """Write the markdown table of ``rows``, the pass rates and the failure classes to ``path``."""
    ours = sum(1 for r in rows if r.get("end_to_end_ok"))
    peer = sum(1 for r in rows if r.get("sqnr_ort") is not None)
    built = [r for r in rows if r.get("failed_stage") != "build"]
    exportable = [r for r in built if torch_exports(r)]
    ours_exportable = sum(1 for r in exportable if r.get("end_to_end_ok"))

    def pct(n: int, d: int) -> str:
        return f"{n}/{d} ({100 * n / d:.0f} %)" if d else f"{n}/0"

    lines = [
        "# Architecture sweep (issue 30)", "",
        f"{len(rows)} models run ({len(rows) - len(built)} did not build from the catalog's config); wall time of the "
        f"runs so far: {wall_seconds / 60:.1f} min.", "",
        f"* ours end to end (prepare → calibrate → convert → export_onnx → verify_onnx ok): {pct(ours, len(built))} "
        "of the models that built",
        f"* quantize_static produced a file that ran: {pct(peer, len(built))} of the models that built",
        f"* ours end to end among the models torch's own float export handles: {pct(ours_exportable, len(exportable))}",
        f"* where the time goes (rows that finished, seconds summed per stage): {_stage_seconds(rows)}",
        "",
        "| model | stage reached | error class | SQNR ours | SQNR quantize_static | int kernels ours / peer | s |",
        "|---|---|---|---|---|---|---|",
    ]

    def db(value: object) -> str:
        return f"{value:.1f}" if isinstance(value, (int, float)) else "-"

    for r in sorted(rows, key=lambda r: str(r["name"])):
        seconds = r.get("wall") or (sum(r["seconds"].values()) if isinstance(r.get("seconds"), dict) else 0)
        lines.append(f"| {r['name']} | {_stage_reached(r)} | {error_class(r.get('error'))} | {db(r.get('sqnr_ours'))} "
                     f"| {db(r.get('sqnr_ort'))} | {r.get('int_ours', '-')} / {r.get('int_ort', '-')} "
                     f"| {seconds:.0f} |")
    lines += ["", "## Failure classes", "",
              "`where`: `build` is the catalog's config (not the library), `timeout` / `crash` the runner's limits "
              "(budget per model), `memory` the child's memory limit, the rest the first stage of ours that raised. "
              "`torch export fails too`: "
              "rows where torch's own float export (the peer's first step) raised as well.", "",
              "| count | where | class | torch export fails too |", "|---|---|---|---|"]
    lines += [f"| {n} | {w} | {c} | {t} |" for w, c, n, t in failure_classes(rows)]
    path.write_text("\n".join(lines) + "\n")


def last_rows(rows_path: Path) -> dict[str, dict[str, object]]:
    """Each model's last row in ``rows_path`` (a re-run after a fix, or two loops meeting, wins); empty if no file."""
    if not rows_path.exists():
        return {}
    return {row["name"]: row for row in map(json.loads, rows_path.read_text().splitlines())}


def expected_seconds(rows_path: Path, budget: float) -> dict[str, float]:
    """Each model's wall time in its last row in ``rows_path`` (at most ``budget``); empty if no file."""
    return {name: min(float(row.get("wall", budget)), budget) for name, row in last_rows(rows_path).items()}


def chunk_names(names: list[str], index: int, count: int, expected: dict[str, float]) -> list[str]:
    """Chunk ``index`` of ``count`` of ``names``, balanced by ``expected`` seconds, in catalog order.

    Longest first, each model joins the chunk with the least expected time so far (ties: the lower chunk, the
    earlier name). A model with no expected time counts the median of the others (1 s when none has one), so the
    chunks of every caller agree given the same ``expected``. The longest chunk is at most 4/3 of the optimum
    (Graham's bound); by index (``names[index::count]``) the sweep's two loops differed by 31 %.
    """
    known = sorted(expected[n] for n in names if n in expected)
    default = known[len(known) // 2] if known else 1.0
    loads = [0.0] * count
    members: list[set[str]] = [set() for _ in range(count)]
    order = sorted(range(len(names)), key=lambda i: (-expected.get(names[i], default), i))
    for name in (names[i] for i in order):
        lightest = min(range(count), key=lambda c: (loads[c], c))
        loads[lightest] += expected.get(name, default)
        members[lightest].add(name)
    return [name for name in names if name in members[index]]


def configure(parser: argparse.ArgumentParser) -> None:
    """The study's options (module docstring)."""
    parser.add_argument("--chunk", default="0/1", help="i/n: chunk i of n, balanced by the earlier rows' wall times")
    parser.add_argument("--balance-by", type=Path, default=Path(__file__).resolve().parent / "rows.jsonl",
                        help="rows whose wall times balance the chunks (default: the study's benchmarks/sweep/)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many entries of the chunk")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds per model")
    parser.add_argument("--memory-gib", type=float, default=8.0, help="resident memory limit per model")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per model (1: two chunk loops share the 2 cores without oversubscribing)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="folder of rows.jsonl and RESULTS.md (default: benchmarks/sweep/)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: one model, row on stdout


def main(argv: list[str] | argparse.Namespace | None = None) -> int:
    """Run a chunk (module docstring); ``argv`` is a parsed namespace when ``benchmarks.run`` calls it."""
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        parser = argparse.ArgumentParser(prog="python -m benchmarks.run sweep", description=__doc__.splitlines()[0])
        configure(parser)
        args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        _child(args.one, args.out, args.budget, args.memory_gib, args.threads)
        return 0
    from benchmarks.sweep.catalog import sweep_entries
    from benchmarks.sweep.forked import preload, run_forked


    index, count = (int(v) for v in args.chunk.split("/"))
    expected = expected_seconds(args.balance_by, args.budget)
    names = chunk_names([e.name for e in sweep_entries()], index, count, expected)[: args.limit]
    rows_path = args.out / "rows.jsonl"
    done = set(last_rows(rows_path))
    todo = [name for name in names if name not in done]
    if todo:
        preload()
    for name in todo:
        start = time.monotonic()
        work = functools.partial(_child, name, args.out, args.budget, args.memory_gib, args.threads)
        child = run_forked(work, args.budget)
        found = [line for line in child.stdout.splitlines() if line.startswith("SWEEP-ROW ")]
        if child.returncode is None:
            row = {"name": name, "failed_stage": "timeout", "error": f"TimeoutExpired: over {args.budget:.0f} s"}
        else:
            row = json.loads(found[-1][len("SWEEP-ROW "):]) if found else {
                "name": name, "failed_stage": "crash", "error": _crash_error(child.returncode, child.stderr)}
        row["wall"] = time.monotonic() - start
        with rows_path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        print(f"{name}: {_stage_reached(row)} {error_class(row.get('error'))} ({row['wall']:.0f} s)", flush=True)
    rows = list(last_rows(rows_path).values())
    write_table(rows, args.out / "RESULTS.md", sum(float(r.get("wall", 0)) for r in rows))
    return 0
