"""The CLI's allocator setting (coreai_opt.cli.allocator): freed weight-sized buffers leave the process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_HOLES = """
import sys, torch
from coreai_opt.cli.allocator import return_large_buffers_to_the_system
applied = return_large_buffers_to_the_system() if sys.argv[1] == "set" else False
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
big = torch.ones(16 << 20, dtype=torch.uint8); del big  # a 16 MiB block freed: glibc's threshold climbs to it
kept, freed = [], []
for i in range(40):  # 8 MiB buffers, every other one kept: the freed ones are holes between live blocks
    (kept if i % 2 else freed).append(torch.ones(8 << 20, dtype=torch.uint8))
before = rss()
freed.clear()
print(applied, (before - rss()) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_8_mib_buffers_between_live_ones_go_back_to_the_system_only_with_the_setting() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    root = Path(__file__).resolve().parents[2]
    out = {mode: subprocess.run([sys.executable, "-c", _HOLES, mode], capture_output=True, text=True, env=env,
                                cwd=root, check=True).stdout.split() for mode in ("set", "default")}
    assert out["set"][0] == "True" and out["default"][0] == "False"
    assert float(out["set"][1]) >= 150  # the 20 freed buffers (160 MiB) left the process
    assert float(out["default"][1]) < 20  # on the heap, between kept ones: still resident


def test_a_users_own_threshold_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from coreai_opt.cli.allocator import return_large_buffers_to_the_system

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert return_large_buffers_to_the_system() is False
