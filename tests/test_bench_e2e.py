"""benchmarks/e2e.py's allocator settings and its fresh-pages measure: under glibc's defaults a
buffer above the mmap threshold is fresh pages every time it is allocated; under ``--malloc
caching`` (``MALLOC_CACHING``) the second allocation reuses the first one's pages."""
import json
import os
import sys

import pytest

from helpers import REPO, run_script

SNIPPET = """
import json, sys, torch
sys.path.insert(0, "benchmarks")
from e2e import fresh_mib
touch = lambda: torch.ones(16 * 2**20)  # 64 MiB, above glibc's largest mmap threshold (32 MiB)
print(json.dumps([fresh_mib(touch) for _ in range(3)]))
"""


@pytest.mark.e2e
@pytest.mark.parametrize("malloc", ["glibc", "caching"])
def test_a_64_mib_buffer_is_fresh_pages_every_time_unless_the_allocator_caches(malloc):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from e2e import MALLOCS
    finally:
        sys.path.pop(0)
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if MALLOCS[malloc]:
        env["GLIBC_TUNABLES"] = MALLOCS[malloc]
    proc = run_script([sys.executable, "-c", SNIPPET], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    mib = json.loads(proc.stdout.splitlines()[-1])
    if malloc == "glibc":
        assert all(m >= 63 for m in mib), mib  # every allocation faults in all of its 64 MiB
    else:
        assert mib[0] >= 63 and max(mib[1:]) < 1, mib  # the heap grows once, then its pages are reused
