"""The model's own sampling defaults, from its ``generation_config.json``.

vLLM (``generation_config="auto"``, its default) and SGLang (``--sampling-defaults model``, its default) both
read them: a request that leaves a sampling field unset gets the model's value instead of the library's (Qwen3
ships temperature 0.6, top-p 0.95, top-k 20; Llama-3.1-Instruct temperature 0.6, top-p 0.9). Where they apply
(``EngineConfig.sampling_defaults``):

- the Python API, when ``sampling_params`` is None (vLLM's ``LLM.generate(prompts)``, which uses
  ``get_default_sampling_params()``); a SamplingParams or dict that the caller passes is used as given;
- the OpenAI endpoints, for each of these fields the request leaves unset (vLLM's and SGLang's serving code);
  the model's ``max_new_tokens`` caps the request's ``max_tokens``, as vLLM takes the smaller of the two.

``/generate`` (SGLang's native endpoint) takes its ``sampling_params`` as given.
"""

from __future__ import annotations

import os
from typing import Any

from rollout.json_files import read_json_object

__all__ = ["SAMPLING_DEFAULTS", "read_sampling_defaults"]

SAMPLING_DEFAULTS = ("model", "openai")  # SGLang's choices: the model's defaults, or the library's
# generation_config.json keys vLLM reads (``ModelConfig.get_diff_sampling_param``), and their SamplingParams names
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_sampling_defaults(model_path: str) -> dict[str, Any]:
    """{SamplingParams name: value} for each of ``_KEYS`` that the model's ``generation_config.json`` sets to a
    value other than null; ``max_new_tokens`` comes back as ``max_tokens``. {} without the file.

    Raises ValueError when the file is not valid JSON or not an object; a bad value is refused where it is used
    (``SamplingParams.from_any`` names the field).
    """
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    raw = read_json_object(path)
    return {name: raw[key] for key, name in _KEYS.items() if raw.get(key) is not None}
