"""The host buffer behind a colocated engine's first sleep(level=1) (``rollout.model_executor.pinned_memory``).

Pinning itself needs CUDA (``gpu_checks/check_sleep.py`` times and checks the sleep that uses it); here, the
mapping it pins: every byte zero and writable, of exactly the size asked, whatever the thread count."""

import pytest
import torch

from rollout.model_executor.pinned_memory import mapped_zeros, touch_threads


@pytest.mark.parametrize("nbytes, threads",
                         [(1, 1), (4096, 3), (5 * 4096 + 17, 2), ((8 << 20) + 1, 4), ((70 << 20) + 5, 3)])
def test_mapped_zeros_are_zero_writable_and_exactly_the_size(nbytes, threads):
    t = mapped_zeros(nbytes, threads)
    assert t.dtype == torch.uint8 and t.shape == (nbytes,)
    assert int(t.count_nonzero()) == 0
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    t.copy_(src)
    assert torch.equal(t, src)


def test_touch_threads_stay_between_one_and_sixteen():
    assert 1 <= touch_threads() <= 16
