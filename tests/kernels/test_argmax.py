"""tuili.kernels.argmax_rows against torch's arg-max of the logits as nan_to_num leaves them."""

import pytest
import torch

from tuili import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"no native kernels: {kernels.unavailable_reason()}")


def expected(x: torch.Tensor) -> torch.Tensor:
    finite_max = torch.finfo(torch.float32).max
    return torch.nan_to_num(x.clone(), nan=float("-inf"), posinf=finite_max, neginf=float("-inf")).argmax(-1)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 151936])
def test_argmax_rows_matches_torch(n):
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=generator)
    x[1, n // 2] = float("nan")
    x[2] = float("-inf")
    x[3] = float("nan")
    x[4, -1] = float("inf")
    x[5, 0] = x[5, -1] = 1e30  # a tie between the first element and the last
    x[6] = 2.5  # all tied
    x[7, n // 3] = x[7, n // 2] = float("inf")
    assert torch.equal(kernels.argmax_rows(x), expected(x))


def test_argmax_rows_any_thread_count_and_empty_inputs():
    x = torch.randn(33, 4097, generator=torch.Generator().manual_seed(0))
    previous = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert torch.equal(kernels.argmax_rows(x), expected(x))
    finally:
        torch.set_num_threads(previous)
    assert kernels.argmax_rows(torch.empty(0, 10)).shape == (0,)
    assert kernels.argmax_rows(torch.empty(3, 0)).tolist() == [0, 0, 0]


def test_argmax_rows_names_a_bad_argument():
    with pytest.raises(ValueError, match="x"):
        kernels.argmax_rows(torch.randn(2, 8).bfloat16())
    with pytest.raises(ValueError, match="x"):
        kernels.argmax_rows(torch.randn(8))
