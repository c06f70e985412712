"""The decoder matrix (issue 32, first acceptance): 8 families x w4 / w8 / w8a8_dynamic, token-identical generation.

``python -m benchmarks.run llm [--families ...] [--presets ...] [--quick | --tiny]`` writes each family's tiny
``save_pretrained`` folder (:mod:`benchmarks.llm.families`), quantizes it per preset as a KV-cache decoder file
(:mod:`benchmarks.llm.cells`), and greedily generates ``--tokens`` tokens after each of ``--prompts`` prompts:
(a) eager converted model vs onnxruntime, (b) onnxruntime with the cache vs regenerating from scratch. Each
comparison counts its flips under teacher forcing and checks each against the near-tie bound derived from the
file's logits tolerance (:mod:`coreai_opt.onnx.verify.token_flips`). One cell (``--cli``) also runs through the
``coreai-opt quantize`` console command. Writes ``benchmarks/llm/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

from benchmarks.common.results_file import write_page
from benchmarks.common.study import BENCHMARKS, add_settings_options, quiet_libraries
from benchmarks.llm.cells import EXTRA_PRESETS, Cell, run_cell, run_cli_cell
from benchmarks.llm.families import FAMILIES, save_family

__all__ = ["PRESETS", "configure", "run", "render"]

PRESETS = ("w4", "w8", "w8a8_dynamic")


def configure(parser: argparse.ArgumentParser) -> None:
    add_settings_options(parser, BENCHMARKS / "llm" / "RESULTS.md", latency=False)
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--presets", nargs="+", choices=[*PRESETS, *EXTRA_PRESETS], default=list(PRESETS),
                        help="w8_int8: w8 with int8-compute MatMulNBits (an extra beside the three)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per cell (at most 8)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--cli", default="gpt2:w8", metavar="FAMILY:PRESET",
                        help="the cell also run through `coreai-opt quantize --task text-generation` ('' for none)")


def _flips(report: object) -> str:
    flips = getattr(report, "flips", ())
    if not flips:
        return "0"
    shown = ", ".join(f"p{f.prompt}s{f.step} {f.margin:.3g}{'<' if f.near_tie else '≥'}{f.bound:.3g}"
                      for f in flips[:3])
    return f"{len(flips)} ({shown}{', ...' if len(flips) > 3 else ''})"


def _row(cell: Cell) -> str:
    if cell.error is not None:
        return (f"| {cell.family} | {cell.preset} | error: {cell.error.replace('|', '/')} | | | | | | "
                f"{cell.seconds:.1f} |")
    a, b = cell.eager_vs_ort, cell.cache_vs_no_cache
    assert a is not None and b is not None
    return (f"| {cell.family} | {cell.preset} | {'ok' if cell.ok else 'FAIL'} | {a.identical}/{a.tokens} | "
            f"{_flips(a)} | {b.identical}/{b.tokens} | {_flips(b)} | {cell.megabytes:.2f} | {cell.seconds:.1f} |")


def _dynamic_note(cells: list[Cell]) -> list[str]:
    """Why w8a8_dynamic cells part with and without the cache, when they do."""
    parted = [c for c in cells if c.preset == "w8a8_dynamic" and c.cache_vs_no_cache is not None
              and not c.cache_vs_no_cache.ok]
    if not parted:
        return []
    near = all(f.near_tie for c in parted for f in c.cache_vs_no_cache.flips)  # type: ignore[union-attr]
    return [f"w8a8_dynamic, cache vs no cache ({len(parted)} cell(s) over 1 flip in 256): its DynamicQuantizeLinear "
            "takes one scale per tensor, from every token of the call, so a token's logits depend on which tokens "
            "share its forward: one per decode step with the cache, the whole sequence when regenerating. Eager and "
            "onnxruntime agree on each; the flips are "
            f"{'all near-ties' if near else 'NOT all near-ties'} by the bound, which covers runtime numerics only "
            "(verify's derivation counts no DynamicQuantizeLinear as a quantizer stage, so a change of scale is "
            "outside it). Not met for this preset: it needs a token-local activation quantizer (per token, as w8's "
            "int8-compute MatMulNBits quantizes per row and K block).", ""]


def render(cells: list[Cell], cli: str, command: str) -> str:
    """The results page: one row per cell, the bound rules met, the CLI cell."""
    passed = sum(c.ok for c in cells)
    reasons = sorted({f"{c.preset}: {c.bound_reason}" for c in cells if c.bound_reason})
    lines = [
        "# Decoder matrix: 8 families x 3 presets, KV-cache decoder files, greedy generation",
        "",
        f"`{command}` on {platform.machine()} ({platform.python_version()}); 1 onnxruntime thread, batch 1. "
        "Random tiny models (hidden 64, 2 layers, 4 heads, 2 KV heads where the family has GQA; sliding window 16 "
        "for Mistral and Gemma2's local layers; see benchmarks/llm/families.py).",
        "",
        "Columns: *eager/ORT* = free-running greedy tokens identical between the eager converted model and "
        "onnxruntime (both with the cache), up to each prompt's first difference; *cache/no-cache* = the same "
        "between onnxruntime decoding with the cache and regenerating from scratch each step. *flips* = steps "
        "where the other run's arg-max differs from the reference's token when forced along the reference stream, "
        "each as `p<prompt>s<step> margin<bound` (margin: the reference's logit gap between the two tokens; bound: "
        "twice the file's derived logits tolerance at that step; `<` = near-tie). A cell is ok when every flip is "
        "a near-tie and flips are at most 1 in 256 tokens. *s* = load + prepare + calibrate + convert + export on a "
        "shared 2-core machine (not a speed claim).",
        "",
        f"**{passed}/{len(cells)} cells ok.**",
        "",
        "| family | preset | result | eager/ORT identical | eager/ORT flips | cache/no-cache identical | "
        "cache/no-cache flips | file MB | s |",
        "|---|---|---|---|---|---|---|---|---|",
        *(_row(c) for c in cells),
        "",
        *_dynamic_note(cells),
        "Logits tolerance behind the bound, per preset (verify_onnx's derivation on the file):",
        "",
        *(f"- {r}" for r in reasons),
        "",
        cli,
        "",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    quiet_libraries()
    from benchmarks.common.torchvision_ops import declare_torchvision_ops

    declare_torchvision_ops()
    families, presets = args.families, args.presets
    if args.tiny:
        families, presets = ["gpt2"], ["w8a8_dynamic"]
    elif args.quick:
        presets = ["w8a8_dynamic"]
    with tempfile.TemporaryDirectory() as temp:
        work = args.work_dir or Path(temp)
        work.mkdir(parents=True, exist_ok=True)
        cells: list[Cell] = []
        for family in families:
            directory = save_family(family, work / family)
            for preset in presets:
                cell = run_cell(directory, family, preset, work, min(args.prompts, 8), args.tokens)
                print(_row(cell), flush=True)
                for line in cell.details:
                    print("   ", line, flush=True)
                cells.append(cell)
        cli = "CLI cell: none run (--cli '')."
        if args.cli and not args.tiny:
            family, preset = args.cli.split(":")
            code, record, seconds = run_cli_cell(save_family(family, work / f"{family}-cli"), family, preset, work)
            cli = (f"CLI cell: `coreai-opt quantize {family}/ --task text-generation --preset {preset} --calib-text "
                   f"...`: exit {code}, its own check {record.get('tokens_identical')}/{record.get('tokens')} tokens "
                   f"identical eager/ORT (ok={record.get('ok')}), {seconds:.1f} s.")
            print(cli, flush=True)
    write_page(args.output, render(cells, cli, args.command))
    print(f"wrote {args.output}")
    return 0 if all(c.ok for c in cells) else 1
