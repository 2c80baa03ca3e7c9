"""heron_cpu's caching CPU allocator (``caching_allocator.cpp``): a freed block of >= 1 MiB is
handed to the next allocation of its rounded size (no page faults: the pages are touched
already), at most the limit stays cached, small tensors and oneDNN's raw scratch memory
still work, and no value changes. Each check runs in a child process, where installing the
allocator (process-wide) starts from torch's default."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from heron.kernels import cpu

_PRELUDE = """
import resource, torch
from heron.kernels import cpu
assert cpu.load()
ops = torch.ops.heron_cpu
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
"""


def _run(body: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", _PRELUDE + body], capture_output=True,
                         text=True, timeout=600, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(autouse=True)
def kernels():
    if not cpu.load():
        pytest.skip("heron's CPU kernels did not build")


def test_a_freed_large_block_is_reused_without_page_faults():
    out = _run("""
ops.use_caching_allocator(256)
a = torch.empty(3 << 20, dtype=torch.uint8)  # 3 MiB
a.fill_(1)
first = a.data_ptr()
del a
assert ops.caching_allocator_cached_bytes() == 3 << 20
before = faults()
b = torch.empty((3 << 20) - 100, dtype=torch.uint8)  # rounds to the same 3 MiB block
b.fill_(2)
print(b.data_ptr() == first, faults() - before, ops.caching_allocator_cached_bytes())
""")
    assert out == "True 0 0"


def test_without_it_torch_faults_the_pages_in_again():
    """The control: torch's default allocator gives the pages back, so the refill faults."""
    out = _run("""
a = torch.empty(32 << 20, dtype=torch.uint8); a.fill_(1); del a
before = faults()
b = torch.empty(32 << 20, dtype=torch.uint8); b.fill_(2)
print(faults() - before)
""")
    assert int(out) > 1000


def test_the_limit_bounds_what_stays_cached():
    out = _run("""
ops.use_caching_allocator(4)  # 4 MiB
blocks = [torch.empty(2 << 20, dtype=torch.uint8) for _ in range(3)]
del blocks  # 6 MiB freed: two blocks fit under the limit, the third goes back
cached = ops.caching_allocator_cached_bytes()
ops.use_caching_allocator(0)  # lowering the limit trims the cache
print(cached, ops.caching_allocator_cached_bytes())
""")
    assert out == f"{4 << 20} 0"


def test_values_small_tensors_and_onednn_scratch_are_unchanged():
    """Matmuls through oneDNN (which allocates raw scratch memory), big and small tensors:
    the same bits with the cache as without."""
    body = """
g = torch.Generator().manual_seed(0)
x, w = torch.randn(512, 576, generator=g), torch.randn(3072, 576, generator=g)
packed = torch.ops.mkldnn._reorder_linear_weight(w)
total = torch.zeros(512, 3072)
for _ in range(5):
    y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    total += torch.nn.functional.silu(y) + torch.ones(7).sum()
import hashlib
print(hashlib.sha256(total.numpy().tobytes()).hexdigest())
"""
    plain = _run(body)
    cached = _run("ops.use_caching_allocator(64)\n" + body)
    assert plain == cached
