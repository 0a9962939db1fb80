"""On CUDA the Triton attention kernels compile once per model and dtype: what changes from step to
step (the block table's width, the decode split count, the prefill tile count) is not specialized
on, so no step after the warm-up waits for a compile (seconds, for every request of the node)."""

import pytest
import torch

from kernels.triton import decode_attention as triton_decode
from kernels.triton import prefill_attention as triton_prefill
from tests.kernels.conftest import gpu, requires_cuda
from tests.kernels.ops import decode_attention, prefill_attention
from tests.kernels.test_decode_attention import decode_case
from tests.kernels.test_prefill_attention import prefill_case

# NOTE: a shape no other test uses (heads 6 over 2 KV heads, head_dim 48), so its compiles are its own
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 48
NUM_BLOCKS = 64


def _compiled(kernel) -> int:
    """The kernel's compiled variants: its per-device caches' first dict (the compiled kernels by
    specialization key in Triton 3's device_caches entries; older ones keep a dict per device)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return sum(len(cache) for cache in kernel.cache.values())
    return sum(len(next(part for part in entry if isinstance(part, dict))) for entry in caches.values())


@gpu
@requires_cuda
def test_on_cuda_decode_attention_compiles_once_for_every_table_width_and_split_count():
    # widths 32, 1, 1, 2, 3 and 16 blocks: several splits for the 32-block table first (as a warm-up's
    # long prompt decodes), then one split for the short tables (the attention kernel writes the
    # output itself, the merge kernel is not launched: no new variant of either)
    cases = [([17], 30), ([1], 0), ([16, 3, 9], 0), ([17, 5], 0), ([40] * 7, 0), ([17], 14)]
    counts = []
    for seq_lens, extra_cols in cases:
        query, kv_layer, table, lens = decode_case(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, 7, seq_lens=seq_lens,
                                                   extra_cols=extra_cols, num_blocks=NUM_BLOCKS)
        decode_attention(query, kv_layer, table, lens, HEAD_DIM ** -0.5, force_triton=True)
        counts.append((_compiled(triton_decode._decode_attention_kernel),
                       _compiled(triton_decode._decode_reduce_kernel)))
    assert counts == [counts[0]] * len(cases), "a step recompiled a decode attention kernel"


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_prefill_attention_compiles_once_for_every_table_width_and_tile_count(dtype):
    cases = [([5], [5]), ([300], [300]), ([7, 130], [20, 400]), ([1], [17])]  # 1 to 4 tiles, widths 1 to 25
    counts = []
    for q_lens, totals in cases:
        query, kv_layer, table, cu, lens = prefill_case(HEADS, KV_HEADS, HEAD_DIM, dtype, 9, q_lens=q_lens,
                                                        totals=totals, num_blocks=NUM_BLOCKS)
        prefill_attention(query, kv_layer, table, cu, lens, HEAD_DIM ** -0.5, force_triton=True)
        counts.append(_compiled(triton_prefill._prefill_attention_kernel))
    assert counts == [counts[0]] * len(cases), "a step recompiled the prefill attention kernel"
