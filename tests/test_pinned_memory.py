"""The host buffer behind a colocated engine's first sleep(level=1) (``rollout.model_executor.pinned_memory``).

Pinning itself needs CUDA (``gpu_checks/check_sleep.py`` times and checks the sleep that uses it); here, the
mapping it pins: every byte zero and writable, of exactly the size asked, whatever the thread count."""

import pytest
import torch

from rollout.model_executor.pinned_memory import cudart_candidates, mapped_zeros, touch_threads


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


def test_the_cuda_runtime_cleared_after_a_refused_pin_is_torchs():
    """``clear_last_cuda_error`` resets the runtime torch uses: of two loaded runtimes, torch's CUDA major first."""
    maps = ["7f00-7f10 r-xp 00000000 08:01 11 /venv/nvidia/cu12/lib/libcudart.so.12\n",
            "7f20-7f30 r-xp 00000000 08:01 12 /venv/nvidia/cu13/lib/libcudart.so.13\n",
            "7f30-7f40 r--p 00010000 08:01 12 /venv/nvidia/cu13/lib/libcudart.so.13\n",
            "7f40-7f50 r-xp 00000000 08:01 13 /venv/torch/lib/libtorch_cuda.so\n",
            "7f50-7f60 rw-p 00000000 00:00 0 \n"]
    assert cudart_candidates(maps, "13.0") == ["/venv/nvidia/cu13/lib/libcudart.so.13",
                                               "/venv/nvidia/cu12/lib/libcudart.so.12"]
    assert cudart_candidates(maps, "12.8")[0].endswith("libcudart.so.12")
    assert cudart_candidates(maps[3:], "13.0") == []
    assert cudart_candidates(maps, None) == sorted(cudart_candidates(maps, None))
