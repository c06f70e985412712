"""Where the CLI's own messages go: progress and results on stdout, warnings on stderr, ``--quiet`` / ``--verbose``.

* normal: step lines and the final report on stdout; ``warning: ...`` lines on stderr; a progress bar only when
  stderr is a terminal (a bar redrawn with carriage returns is noise in a log file or a CI capture).
* ``--quiet``: nothing on stdout; warnings and errors still go to stderr (the exit code tells the result).
* ``--verbose``: also third-party warnings and log records that are filtered by default
  (:mod:`coreai_opt.cli.third_party_noise`) and coreai_opt's own INFO log (e.g. which capture method was used).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Console:
    """The output policy of one CLI run.

    Attributes:
        quiet: Print nothing on stdout.
        verbose: Show filtered third-party messages and coreai_opt's INFO log.
    """

    quiet: bool = False
    verbose: bool = False

    def info(self, text: str = "") -> None:
        """Print ``text`` on stdout unless quiet."""
        if not self.quiet:
            print(text, flush=True)

    def warn(self, text: str) -> None:
        """Print ``warning: text`` on stderr (also when quiet)."""
        print(f"warning: {text}", file=sys.stderr, flush=True)

    @property
    def progress(self) -> bool:
        """Whether to draw progress bars: not quiet and stderr is a terminal."""
        return not self.quiet and sys.stderr.isatty()
