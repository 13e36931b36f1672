"""fzero.norm: the grads' sum of squares for the global norm, against float64 math."""
import torch

from fzero.grad_forms import Segments
from fzero.norm import sum_of_squares


def test_sum_of_squares_is_the_float64_sum_and_non_finite_on_any_inf():
    g = torch.randn(1000) * 100
    pieces = Segments((g[:123], g[123:700], g[700:]), (0, 123, 700), 1000, False)
    for bounded in (True, False):
        for compiled in (False, True):  # compiled: the whole parts (no block cut; the same for a small shard)
            a = sum_of_squares(pieces, bounded=bounded, compiled=compiled)
            assert a.dtype == torch.float64
            torch.testing.assert_close(a, g.double().square().sum(), rtol=1e-6, atol=0)
    assert torch.isinf(sum_of_squares(Segments.of(torch.tensor([1.0, float("inf")]), False), bounded=True))
