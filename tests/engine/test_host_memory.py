"""Huge pages for the KV cache: the advice covers a tensor's 2 MiB-aligned interior, and the
cache is advised before it is zeroed (the advice applies only to pages not yet touched). The CPU
cache's storage is layer-major."""

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


def test_kv_cache_is_advised_before_it_is_zeroed(monkeypatch):
    advised = []

    def touch_and_record(tensor):
        advised.append(tensor.data_ptr())
        tensor.fill_(7)  # what the cache holds when the advice comes must not survive
        return 0

    monkeypatch.setattr(kv_cache, "advise_huge_pages", touch_and_record)
    model = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=32, dtype=torch.bfloat16)
    cache = kv_cache.allocate_kv_cache(model, num_blocks=300, block_size=16, device="cpu")
    assert cache.shape == (300, 2, 2, 16, 1, 32) and cache.dtype == torch.bfloat16
    assert advised == [cache.data_ptr()] and bool(torch.all(cache == 0))


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
