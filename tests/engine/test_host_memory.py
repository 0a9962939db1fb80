"""Huge pages for the KV cache: the advice covers a tensor's 2 MiB-aligned interior, and the
cache is advised while none of its pages is touched (the advice applies only to those): it is
zeros the kernel gives as pages are first used. The CPU cache's storage is layer-major."""

from pathlib import Path
from types import SimpleNamespace

import torch

from engine import kv_cache
from engine.host_memory import advise_huge_pages
from pdserve.huge_heap import thp_mode

HUGE = 2 << 20
THP_SUPPORTED = thp_mode() is not None


def test_advise_huge_pages_covers_the_aligned_interior_of_a_fresh_tensor():
    tensor = torch.empty(24 << 20, dtype=torch.uint8)
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel()
    interior = end // HUGE * HUGE - -(-start // HUGE) * HUGE
    assert advise_huge_pages(tensor) == (interior if THP_SUPPORTED else 0)
    assert interior >= 22 << 20
    assert advise_huge_pages(torch.empty(HUGE // 2, dtype=torch.uint8)) == 0  # no whole huge page inside


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_cpu_kv_cache_is_zeros_that_take_no_memory_or_time_until_touched(monkeypatch):
    """The cache is an anonymous mapping: advised for huge pages while no page of it is touched,
    zeros as the kernel gives them, memory taken only as blocks are written."""
    advised = []
    monkeypatch.setattr(kv_cache, "advise_huge_pages", lambda tensor: advised.append(tensor.data_ptr()) or 0)
    model = SimpleNamespace(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    before = _rss_bytes()
    cache = kv_cache.allocate_kv_cache(model, num_blocks=2048, block_size=16, device="cpu", prefault=False)  # 256 MiB
    assert _rss_bytes() - before < 16 << 20  # nothing written up front
    assert cache.shape == (2048, 4, 2, 16, 4, 64) and advised == [cache.data_ptr()]
    assert bool(torch.all(cache[::97] == 0)) and bool(torch.all(cache[-1] == 0))
    cache[5].fill_(1.0)
    assert float(cache[5].sum()) == cache[5].numel() and float(cache[4].abs().sum()) == 0.0


def test_a_prefaulted_cpu_kv_cache_is_in_memory_before_any_step():
    """prefault (the default): the pages are faulted in by the allocation, not by the first steps
    that write them."""
    model = SimpleNamespace(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    before = _rss_bytes()
    cache = kv_cache.allocate_kv_cache(model, num_blocks=2048, block_size=16, device="cpu")
    assert _rss_bytes() - before >= (256 << 20) * 0.95
    assert cache.shape == (2048, 4, 2, 16, 4, 64) and float(cache.abs().sum()) == 0.0


def test_cpu_kv_cache_is_stored_layer_major():
    """Indexed by block, stored layer by layer: a layer's consecutive blocks are one run of memory
    (what decode attention reads), each block's layer one contiguous slice; stored_layer_major
    gives a filled cache the same storage."""
    model = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    cache = kv_cache.allocate_kv_cache(model, num_blocks=10, block_size=16, device="cpu")
    assert cache.shape == (10, 3, 2, 16, 2, 32) and not cache.is_contiguous()
    assert cache.transpose(0, 1).is_contiguous() and cache[:, 1].is_contiguous()
    assert cache[4, 1].data_ptr() - cache[3, 1].data_ptr() == cache[0, 0].nbytes
    filled = torch.randn(10, 3, 2, 16, 2, 32)
    stored = kv_cache.stored_layer_major(filled)
    assert torch.equal(stored, filled) and stored.stride() == cache.stride()
