"""Shared fixtures: tiny random checkpoints and the transformers reference."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from tiny_models import make_tiny_checkpoint  # noqa: E402
from reference import hf_greedy, hf_logprobs  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(arch, **overrides) → path of a cached random checkpoint."""
    made: dict = {}

    def get(arch: str = "llama", **overrides) -> str:
        key = (arch, repr(sorted(overrides.items())))
        if key not in made:
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            made[key] = make_tiny_checkpoint(path, arch, **overrides)
        return made[key]

    return get


class HFReference:
    """transformers on the same checkpoint: greedy generation and teacher-forced log-probabilities."""

    def __init__(self, path: str, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.eos = self.model.generation_config.eos_token_id

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
        """``generate`` with do_sample=False; EOS ends the sequence only with ``stop_at_eos``."""
        return hf_greedy(self.model, prompt_ids, max_new_tokens, self.eos if stop_at_eos else None)

    def logprobs(self, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
        return hf_logprobs(self.model, prompt_ids, output_ids)


@pytest.fixture(scope="module")
def path(tiny_dir):
    """The tiny Llama checkpoint most modules test on."""
    return tiny_dir("llama")


@pytest.fixture(scope="module")
def engine(path):
    """An engine on ``path`` for the module (float32, CPU): the Python API, and the reference the HTTP tests
    compare the server with."""
    from rollout import Engine

    with Engine(path, dtype="float32", device="cpu") as e:
        yield e


@pytest.fixture(scope="module")
def server(path):
    """The real HTTP server (``server_harness.ServerProcess``, API key ``server_harness.API_KEY``) on ``path``
    for the module; it must shut down cleanly at the end."""
    from server_harness import API_KEY, running_server

    with running_server(path, api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="session")
def hf_reference():
    cache: dict = {}

    def get(path: str) -> HFReference:
        if path not in cache:
            cache[path] = HFReference(path)
        return cache[path]

    return get


def prompts_of_lengths(lengths: list[int], vocab: int = 500, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def prefill_request(cache, req) -> None:
    """What the scheduler does for a request on a ``KVCacheManager``: place its cached prefix, take slots for
    the rest, compute it (``kv_len``), hand it to the tree."""
    prefix, node = cache.match(req.fill_ids[:req.prefix_match_len()])
    cache.lock(node)
    cache.place(req, prefix, node)
    n = req.seq_len - req.kv_len
    assert cache.ensure_free(cache.slots_needed(n, req.kv_len))
    cache.extend(req, n)
    req.kv_len += n
    cache.cache_prefix(req)
