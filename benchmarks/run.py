"""The one entry point of the benchmarks: ``python -m benchmarks.run NAME [options]``, NAME picks a study.

Usage::

    python -m benchmarks.run --list                                  # the studies, what each measures, how long
    python -m benchmarks.run comparison [--quick] [--only speed accuracy] [--output /tmp/R.md]
    python -m benchmarks.run comparison --quick --only accuracy --tiny --output /tmp/R.md   # smoke test (tests/)
    python -m benchmarks.run corpus --no-latency                     # the 40-model corpus, untimed
    python -m benchmarks.run auto --no-latency                       # co.auto_quantize, accuracy only
    python -m benchmarks.run minilm w8a8 --quick                     # MiniLM W8A8; parts: see `minilm --help`
    python -m benchmarks.run matmul_nbits --quick
    python -m benchmarks.run memory --sizes 0.2 --presets w8a8 w4
    python -m benchmarks.run demo --ulps 64 --runs 8                 # the demo table under emulated kernels
    python -m benchmarks.run sweep --chunk 0/13 --budget 600         # the architecture sweep, resumable
    python -m benchmarks.run verify clean --presets w8a8 w4          # verify_onnx on the corpus; parts: --help
    python -m benchmarks.run llm [--quick]                           # 8 decoder families x 3 presets
    python -m benchmarks.run llm_quality                             # perplexity of a trained LM vs the genai builder
    python -m benchmarks.run llm_speed --rounds 20 --profile          # w4 KV-cache decoder vs genai's builder
    python -m benchmarks.run llm_memory --layers 1 2 4                # 1.1 B-wide w4 decoder: peak RSS, CLI vs API
    python -m benchmarks.run NAME --help                             # a study's options

Each study lives in ``benchmarks/<NAME>/`` and writes one results file there, ``benchmarks/<NAME>/RESULTS.md``
(``--output`` writes elsewhere). A new study is a package ``benchmarks/<name>/`` whose ``__init__`` defines
``STUDY`` (:class:`benchmarks.common.study.Study`), plus one line in :data:`STUDIES`.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from benchmarks import (
    audit,
    auto,
    comparison,
    corpus,
    demo,
    export_cost,
    llm,
    llm_memory,
    llm_quality,
    llm_speed,
    matmul_nbits,
    memory,
    minilm,
    sweep,
    verify,
)
from benchmarks.common.study import Study

__all__ = ["STUDIES", "main", "study_list", "unknown_study_message"]

#: The study registry, NAME -> Study; the order of ``--list``.
STUDIES: dict[str, Study] = {study.name: study for study in (
    comparison.STUDY,
    minilm.STUDY,
    matmul_nbits.STUDY,
    corpus.STUDY,
    auto.STUDY,
    memory.STUDY,
    demo.STUDY,
    sweep.STUDY,
    verify.STUDY,
    llm.STUDY,
    audit.STUDY,
    export_cost.STUDY,
    llm_quality.STUDY,
    llm_speed.STUDY,
    llm_memory.STUDY,
)}


def study_list() -> str:
    """One paragraph per study: name, what it measures, how long it takes."""
    return "\n".join(f"{s.name}\n    measures: {s.measures}\n    takes: {s.duration}" for s in STUDIES.values())


def unknown_study_message(name: str) -> str:
    """The error for a NAME that is no study: the known names and how to see them."""
    return (f"unknown study {name!r}; the studies are: {', '.join(STUDIES)} "
            "(python -m benchmarks.run --list says what each measures)")


def main(argv: list[str] | None = None) -> int:
    """Run the study named by ``argv[0]`` with the rest of ``argv`` as its options; 0 on success, 2 on a usage error."""
    argv = sys.argv[1:] if argv is None else list(argv)
    usage = "python -m benchmarks.run NAME [options] | --list"
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print((__doc__ if argv[:1] != ["--list"] else "") + "\nStudies:\n" + study_list())
        return 0 if argv else 2
    name = argv[0]
    if name not in STUDIES:
        argparse.ArgumentParser(prog="python -m benchmarks.run", usage=usage).error(unknown_study_message(name))
    study = STUDIES[name]
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.run {name}", description=study.measures)
    study.configure(parser)
    args = parser.parse_args(argv[1:])
    args.command = "python -m benchmarks.run " + shlex.join(argv)
    return study.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
