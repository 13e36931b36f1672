"""benchmarks/e2e.py's allocator settings and its fresh-pages measure: under glibc's defaults a
buffer above the mmap threshold is fresh pages every time it is allocated; under ``--malloc
caching`` (``MALLOC_CACHING``) the heap grows to its steady size within the first few
allocations (small objects allocated in between may take the start of a freed region, so the
next large one extends the heap once or twice more: never after the third of 8 in 90 runs), then every
allocation reuses pages it had -- as e2e.py measures, after its warm-up."""
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
print(json.dumps([fresh_mib(touch) for _ in range(8)]))
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
    env.update(MALLOCS[malloc])
    proc = run_script([sys.executable, "-c", SNIPPET], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    mib = json.loads(proc.stdout.splitlines()[-1])
    if malloc == "glibc":
        assert all(m >= 63 for m in mib), mib  # every allocation faults in all of its 64 MiB
    else:
        assert mib[0] >= 63 and max(mib[4:]) < 1, mib  # the heap reaches its size, then its pages are reused
