"""Entry point of the ``coreai-opt`` console script.

Subcommands::

    coreai-opt demo                       train (or load) a digits CNN, quantize it w8a8, export, verify, report
    coreai-opt quantize MODEL [options]   quantize any model to an ONNX QDQ file plus a verification report
    coreai-opt inspect MODEL.onnx         count Q/DQ nodes, quantized initializers and ops; show ORT fusions

Exit codes: 0 success, 1 the exported model failed verification, 2 bad input (one line on stderr; pass
``--debug`` for the traceback).

Trust: a model given as ``file.py:factory`` or ``module:factory`` is Python code and runs as such; TorchScript
files load with ``torch.jit.load``; ``.pt2`` files load with ``torch.export.load`` only after every pickle in the
archive has loaded in torch's restricted (``weights_only``) mode. Plain pickles (``torch.save(model)``) are never
unpickled. Only run model files you trust.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from importlib import metadata

from coreai_opt import third_party_noise
from coreai_opt.cli.allocator import return_large_buffers_to_the_system
from coreai_opt.cli.commands import demo, inspect_onnx, quantize
from coreai_opt.cli.console import Console
from coreai_opt.cli.usage_errors import EXIT_OK, EXIT_USAGE, one_line

_SUBCOMMANDS = (demo, quantize, inspect_onnx)
TRUST_NOTE = (
    "Model files are trusted code: file.py:factory and module:factory run Python; TorchScript loads with "
    "torch.jit.load; .pt2 loads with torch.export.load after its pickles passed torch's restricted loader."
)


def version_text() -> str:
    """``coreai-opt 0.1.0 (torch 2.13.0+cpu, onnx 1.23.2, onnxruntime 1.32.0)``, read without importing torch."""
    import coreai_opt

    parts = []
    for package in ("torch", "onnx", "onnxruntime"):
        try:
            parts.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{package} missing")
    return f"coreai-opt {coreai_opt.__version__} ({', '.join(parts)})"


def _common_options() -> argparse.ArgumentParser:
    """Options accepted after the subcommand too; SUPPRESS keeps the subparser from resetting the global value."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return common


def build_parser() -> argparse.ArgumentParser:
    """Build the ``coreai-opt`` argument parser with one subparser per subcommand module.

    Returns:
        The parser; each subparser stores its module's ``run`` function as the ``run`` default.
    """
    parser = argparse.ArgumentParser(
        prog="coreai-opt",
        description="Quantize PyTorch models to ONNX QDQ and verify them in onnxruntime.",
        epilog=f"Run 'coreai-opt demo' for a one-minute tour. {TRUST_NOTE}",
    )
    parser.add_argument("--version", action="version", version=version_text())
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on stdout (warnings and errors "
                        "still go to stderr; the exit code tells the result)")
    parser.add_argument("-v", "--verbose", action="store_true", help="also show third-party warnings that are "
                        "filtered by default and coreai_opt's INFO log")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _SUBCOMMANDS:
        sub = module.add_parser(subparsers, parents=[_common_options()])
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the chosen subcommand and return its exit code.

    Args:
        argv: Command-line arguments without the program name.

    Returns:
        0 on success, 1 when verification failed, 2 on bad input (or no subcommand).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.quiet and args.verbose:
        print(f"coreai-opt {args.command}: error: --quiet and --verbose contradict each other; pick one",
              file=sys.stderr)
        return EXIT_USAGE
    args.console = Console(quiet=args.quiet, verbose=args.verbose)
    return_large_buffers_to_the_system()
    if args.verbose:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("coreai_opt").setLevel(logging.INFO)
    else:
        third_party_noise.install()
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"coreai-opt {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (coreai-opt inspect m.onnx | head): not an error of ours
        sys.stdout = None
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - every error becomes one line unless --debug
        if args.debug:
            raise
        print(f"coreai-opt {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
