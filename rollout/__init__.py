"""An RLHF rollout engine with live weight sync, in SGLang's shape."""

from rollout.engine import Engine
from rollout.outputs import CompletionOutput, Logprob, RequestOutput
from rollout.sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
