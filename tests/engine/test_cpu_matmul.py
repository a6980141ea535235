"""The C matmul of a few rows (engine.cpu_matmul), which ops.linear uses on the CPU for decode steps:
the same products as torch's matmul at every row count it takes, whatever the threads, and the shapes it
does not take left to torch."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_matmul, ops

pytestmark = pytest.mark.skipif(not cpu_matmul.available(),
                                reason=f"the C matmul is not built: {cpu_matmul.MISSING}")


@pytest.fixture
def torch_threads():
    """Sets torch's thread count for one test and puts it back (it is process-wide)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,out_features,in_features", [(2, 1408, 512), (5, 513, 256), (8, 704, 704),
                                                            (16, 2048, 128), (9, 5, 16384)])
def test_equals_torch_matmul(rows, out_features, in_features, threads, torch_threads):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    torch_threads(threads)
    assert cpu_matmul.takes(x, weight)
    got = ops.linear(x, weight)
    torch.testing.assert_close(got, x @ weight.T, rtol=1e-5, atol=1e-5)


def test_a_row_slice_of_a_larger_input_and_an_expert_slice_of_a_stacked_weight():
    """What fused_moe hands it: a run of sorted rows and one expert's slice of [experts, out, in]."""
    rows = torch.randn(20, 256)
    experts = torch.randn(4, 512, 256) * 0.05
    got = ops.linear(rows[3:11], experts[2])
    torch.testing.assert_close(got, rows[3:11] @ experts[2].T, rtol=1e-5, atol=1e-5)


def test_shapes_it_does_not_take_stay_with_torch():
    weight = torch.randn(512, 256)
    assert not cpu_matmul.takes(torch.randn(17, 256), weight)                     # a prefill chunk
    assert not cpu_matmul.takes(torch.randn(4, 250), torch.randn(512, 250))       # in_features not a multiple of 16
    assert not cpu_matmul.takes(torch.randn(4, 256), weight.T.contiguous().T)     # a transposed view
    assert not cpu_matmul.takes(torch.randn(4, 256, dtype=torch.float64), weight.double())
    assert not cpu_matmul.takes(torch.randn(4, 64), torch.randn(64, 64))          # small enough to sit in cache
    assert not cpu_matmul.takes(torch.randn(1, 256), weight)                      # a matrix-vector product


def test_sizes_that_disagree_raise():
    x, weight, out = torch.randn(4, 256), torch.randn(512, 256), torch.empty(4, 511)
    with pytest.raises(ValueError, match="disagree"):
        cpu_matmul._cpu_matmul.matmul(x.numpy(), weight.numpy(), out.numpy(), None, 4, 512, 256, 1)
    with pytest.raises(ValueError, match="disagree"):
        cpu_matmul._cpu_matmul.matmul(x.numpy(), weight.numpy(), torch.empty(4, 512).numpy(),
                                      torch.zeros(511).numpy(), 4, 512, 256, 1)
    with pytest.raises(ValueError, match="unsupported shape"):
        cpu_matmul._cpu_matmul.matmul(x.numpy(), weight.numpy(), out.numpy(), None, 17, 512, 256, 1)
