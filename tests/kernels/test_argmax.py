"""Row-wise argmax: the compiled CPU kernel against torch.argmax, ties and NaN included."""

import pytest
import torch

from tests.kernels.ops import CPU

argmax_rows = CPU.argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 7), (64, 2000), (5, 49152), (2, 151936)])
def test_argmax_rows_equals_torch_argmax_on_random_rows(rows, cols, dtype):
    """bfloat16 rows (8-bit mantissas) tie often: the first of equal maxima must win there too."""
    assert CPU.lib is not None and CPU.lib.has("argmax_rows_f32")  # the compiled path is under test
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)).to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x), x.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_takes_the_first_of_tied_maxima_infinities_and_nan_like_torch(dtype):
    x = torch.full((6, 100), -1.0)
    x[0, [17, 3, 90]] = 5.0  # tie: the first index
    x[1] = float("-inf")  # all -inf: index 0
    x[2, [40, 60]] = float("inf")
    x[3, [70, 10]] = float("nan")  # NaN wins, the first one
    x[3, 5] = float("inf")
    x[4, 99] = float("nan")
    x[5, [8, 9]] = torch.tensor([0.0, -0.0])
    x[5] = torch.where(x[5] == -1.0, torch.tensor(-2.0), x[5])
    x = x.to(dtype)
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [3, 0, 40, 10, 99, 8]


def test_argmax_rows_strided_rows_empty_batch_and_other_dtypes():
    wide = torch.randn(9, 300, generator=torch.Generator().manual_seed(1))
    view = wide[:, :257]
    assert view.stride(0) == 300 and torch.equal(argmax_rows(view), view.argmax(dim=-1))
    assert argmax_rows(torch.empty(0, 50)).shape == (0,)
    for dtype in (torch.float16, torch.float64):  # no compiled copy: torch's argmax
        other = wide.to(dtype)
        assert torch.equal(argmax_rows(other), other.argmax(dim=-1))
    half = wide.to(torch.bfloat16)[:, :257]
    assert half.stride(0) == 300 and torch.equal(argmax_rows(half), half.argmax(dim=-1))
    with pytest.raises(ValueError, match="argmax"):
        argmax_rows(torch.zeros(3))
