"""Kernel test helpers: fresh random inputs, per-dtype tolerances, the device to run on."""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Stated tolerances (atol, rtol) per dtype for kernel vs reference.
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=DEVICE)


@pytest.fixture(autouse=True)
def _fresh_seed():
    torch.manual_seed(0)
