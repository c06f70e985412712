"""Entry point of the ``coreai-opt`` console script.

Subcommands::

    coreai-opt demo                       train (or load) a digits CNN, quantize it w8a8, export, verify, report
    coreai-opt quantize MODEL [options]   quantize any model to an ONNX QDQ file plus a verification report
    coreai-opt inspect MODEL.onnx         count Q/DQ nodes, quantized initializers and ops; show ORT fusions

Exit codes: 0 success, 1 the exported model failed verification, 2 bad input (one line on stderr; pass
``--debug`` for the traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from coreai_opt.cli import demo, inspect_onnx, quantize
from coreai_opt.cli.errors import EXIT_USAGE, one_line

_SUBCOMMANDS = (demo, quantize, inspect_onnx)


def build_parser() -> argparse.ArgumentParser:
    """Build the ``coreai-opt`` argument parser with one subparser per subcommand module.

    Returns:
        The parser; each subparser stores its module's ``run`` function as the ``run`` default.
    """
    parser = argparse.ArgumentParser(
        prog="coreai-opt",
        description="Quantize PyTorch models to ONNX QDQ and verify them in onnxruntime.",
        epilog="Run 'coreai-opt demo' for a one-minute tour.",
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    # ``--debug`` is also accepted after the subcommand; SUPPRESS keeps the subparser from resetting it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _SUBCOMMANDS:
        sub = module.add_parser(subparsers, parents=[common])
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
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"coreai-opt {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - every error becomes one line unless --debug
        if args.debug:
            raise
        print(f"coreai-opt {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
