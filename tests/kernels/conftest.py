"""Kernel test helpers: fresh random inputs, per-dtype tolerances, the device to run on, paged
caches with shuffled block tables, and a per-token attention oracle."""

import math
import os

import torch

# NOTE: Triton decides at kernel definition whether to interpret, so this runs before any
# kernels module is imported; without CUDA the Triton kernels then run on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Kernel vs reference (atol, rtol) per dtype: a few units in the last place of the output
# dtype, since kernel and reference sum in different orders and round at different points.
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GQA = [(4, 4), (6, 2), (8, 2), (8, 1)]  # (heads, kv heads): ratios 1, 3, 4, 8
BLOCK_SIZE = 16
NUM_BLOCKS = 40
NUM_LAYERS = 2

gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# The devices an engine test runs on: the CPU, and CUDA where there is a GPU.
ENGINE_DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, requires_cuda])]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def randn(*shape, dtype=torch.float32, seed=0, device=DEVICE) -> torch.Tensor:
    """Seeded normal values on DEVICE (the GPU where there is one); the compiled CPU kernels'
    tests ask for device="cpu"."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)


def make_cache(num_kv_heads: int, head_dim: int, dtype=torch.float32, seed=0, num_blocks=NUM_BLOCKS,
               device=DEVICE) -> torch.Tensor:
    """A whole random cache, [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]."""
    return randn(num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, seed=seed, device=device)


def shuffled_block_tables(seq_lens: list[int], seed=0, num_blocks=NUM_BLOCKS, extra_cols=0,
                          device=DEVICE) -> torch.Tensor:
    """Non-contiguous block ids, each sequence its own; unused columns point at block 0."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(1, max(math.ceil(n / BLOCK_SIZE) for n in seq_lens)) + extra_cols
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for row, n in enumerate(seq_lens):
        for col in range(math.ceil(n / BLOCK_SIZE)):
            table[row, col] = order.pop()
    return table.to(device)


def naive_attention(q, kv_layer, table_row, positions, scale) -> torch.Tensor:
    """q: [q_len, heads, d] at positions; per token and head, a float64 softmax over the keys
    at positions 0..its own, each looked up through the block table."""
    heads, num_kv_heads = q.shape[1], kv_layer.shape[3]
    kv_layer, q = kv_layer.double().cpu(), q.double().cpu()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        slots = [(int(table_row[pos // BLOCK_SIZE]), pos % BLOCK_SIZE) for pos in range(positions[t] + 1)]
        for h in range(heads):
            kv_head = h // (heads // num_kv_heads)
            keys = torch.stack([kv_layer[block, 0, offset, kv_head] for block, offset in slots])
            values = torch.stack([kv_layer[block, 1, offset, kv_head] for block, offset in slots])
            out[t, h] = torch.softmax(keys @ q[t, h] * scale, 0) @ values
    return out


@pytest.fixture(autouse=True)
def _fresh_seed():
    torch.manual_seed(0)
