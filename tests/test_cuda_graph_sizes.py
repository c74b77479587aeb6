"""The decode batch sizes the CUDA graph runner captures (``default_batch_sizes``); the graphs themselves run
in gpu_checks/check_attention_and_engine.py."""

from rollout.model_executor.cuda_graph_runner import default_batch_sizes


def test_sizes_up_to_256_then_every_32_up_to_the_cap():
    assert default_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert default_batch_sizes(512)[-9:] == [256, 288, 320, 352, 384, 416, 448, 480, 512]
    assert default_batch_sizes(300)[-3:] == [256, 288, 300]  # the cap itself is always captured
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
