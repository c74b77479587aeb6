"""The server's flags (SGLang's names) as one frozen config object; no FastAPI or torch imports here."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
from dataclasses import dataclass
from typing import Any, Sequence

from rollout.config import ATTENTION_BACKENDS, DECODE_ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATION_METHODS
from rollout.sampling_defaults import SAMPLING_DEFAULTS

# flag name → EngineConfig field, for options passed to the Engine only when given
_ENGINE_OPTIONS = {
    "tokenizer_path": "tokenizer_path",
    "mem_fraction_static": "mem_fraction_static",
    "context_length": "context_length",
    "max_running_requests": "max_running_requests",
    "max_total_tokens": "max_total_tokens",
    "chunked_prefill_size": "chunked_prefill_size",
    "max_prefill_tokens": "max_prefill_tokens",
    "cpu_kv_cache_gb": "cpu_kv_cache_gb",
    "attention_backend": "attention_backend",
    "decode_attention_backend": "decode_attention_backend",
    "random_seed": "seed",
    "weight_version": "weight_version",
    "load_format": "load_format",
    "log_interval": "log_interval_s",
    "kv_cache_dtype": "kv_cache_dtype",
    "quantization": "quantization",
    "page_size": "page_size",
    "cuda_graph_max_bs": "cuda_graph_max_bs",
    "schedule_conservativeness": "schedule_conservativeness",
    "decode_balance_ratio": "decode_balance_ratio",
    "piecewise_cuda_graph_max_tokens": "piecewise_cuda_graph_max_tokens",
    "sampling_defaults": "sampling_defaults",
    "max_logprobs": "max_logprobs",
}

# on/off flags, passed to the Engine (same field name) only when set
_ENGINE_SWITCHES = ("disable_radix_cache", "keep_weight_copy", "enable_memory_saver", "enable_return_routed_experts",
                    "update_weights_in_flight", "enable_mixed_chunk", "disable_cascade_attn",
                    "enable_piecewise_cuda_graph")


@dataclass(frozen=True)
class ServerArgs:
    """Everything ``rollout.launch_server`` takes. ``engine_kwargs()`` gives the ``Engine`` arguments."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    dtype: str = "auto"
    device: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    tokenizer_path: str | None = None
    mem_fraction_static: float | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int | None = None
    cpu_kv_cache_gb: float | None = None
    attention_backend: str | None = None
    decode_attention_backend: str | None = None
    random_seed: int | None = None
    weight_version: str | None = None
    load_format: str | None = None
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    page_size: int | None = None
    cuda_graph_max_bs: int | None = None
    schedule_conservativeness: float | None = None
    decode_balance_ratio: float | None = None
    disable_radix_cache: bool = False
    keep_weight_copy: bool = False
    enable_memory_saver: bool = False
    enable_return_routed_experts: bool = False
    update_weights_in_flight: bool = False
    enable_mixed_chunk: bool = False
    disable_cascade_attn: bool = False
    enable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: int | None = None
    sampling_defaults: str | None = None
    max_logprobs: int | None = None
    log_level: str = "info"
    log_interval: float | None = None
    log_requests: bool = False

    @property
    def model_name(self) -> str:
        """The name clients put in ``model`` (``--served-model-name``, else the model path)."""
        return self.served_model_name or self.model_path

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def control_refusal(self) -> str | None:
        """Why control endpoints must refuse to run (a non-loopback bind without a key), else None."""
        if self.loopback or self.api_key:
            return None
        return (f"control endpoints are disabled: the server is bound to {self.host!r} (not loopback) without "
                "--api-key; restart it with --api-key KEY or bind to 127.0.0.1")

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``rollout.Engine`` (options left unset keep the engine's defaults)."""
        kwargs: dict[str, Any] = {"model_path": self.model_path, "tp_size": self.tp_size, "dtype": self.dtype,
                                  "device": self.device}
        for flag, option in _ENGINE_OPTIONS.items():
            value = getattr(self, flag)
            if value is not None:
                kwargs[option] = value
        kwargs.update({switch: True for switch in _ENGINE_SWITCHES if getattr(self, switch)})
        kwargs["log_level"] = "INFO" if self.log_level in ("debug", "info") else self.log_level.upper()
        return kwargs

    @classmethod
    def from_cli(cls, argv: Sequence[str] | None = None) -> "ServerArgs":
        """Parse command-line flags (SystemExit with usage on bad flags, like any argparse program)."""
        ns = build_parser().parse_args(argv)
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def is_loopback(host: str) -> bool:
    """True for "localhost" and loopback addresses (127.0.0.0/8, ::1); False for 0.0.0.0, :: and names."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-server",
                                description="OpenAI-compatible and SGLang-style HTTP server for a rollout Engine")
    p.add_argument("--model-path", required=True, help="local Hugging Face checkpoint directory")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: the path)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every endpoint")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-prefill-tokens", type=int, default=None)
    p.add_argument("--cpu-kv-cache-gb", type=float, default=None)
    p.add_argument("--attention-backend", default=None, choices=ATTENTION_BACKENDS)
    p.add_argument("--decode-attention-backend", default=None, choices=DECODE_ATTENTION_BACKENDS,
                   help="decode kernel under the flashinfer backend (auto: triton)")
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--weight-version", default=None, help="the version reported before any update")
    p.add_argument("--load-format", default=None, choices=["auto", "safetensors", "dummy"])
    p.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                   help="KV cache storage type (default auto: the model dtype)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                   help="online weight quantization (fp8: W8A8 projections, quantized as weights load)")
    p.add_argument("--page-size", type=int, default=None,
                   help="KV slots per page (default 1; decode backend xqa needs 16, 32, 64 or 128)")
    p.add_argument("--decode-balance-ratio", type=float, default=None,
                   help="cut decode requests into pieces by length when the longest holds this many times the "
                        "mean cached tokens (default 4; 0: always; inf: never)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest decode batch captured in a CUDA graph (default 1024; larger batches run eagerly)")
    p.add_argument("--schedule-conservativeness", type=float, default=None,
                   help="how much KV admission keeps free for the running requests' future tokens (default 0.3; "
                        "lower admits more at once, 0 keeps one page each)")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--keep-weight-copy", action="store_true", help="enable /rollback_weights")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="enable /release_memory_occupation, /sleep and their resume calls (colocated training)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE models: requests may ask for the experts each token was routed to (routing replay)")
    p.add_argument("--update-weights-in-flight", action="store_true",
                   help="apply weight updates at the next step while requests keep running (partial rollouts)")
    p.add_argument("--enable-mixed-chunk", action="store_true",
                   help="prefill steps also decode the running requests (SGLang's mixed chunk)")
    p.add_argument("--disable-cascade-attn", action="store_true",
                   help="decode reads a prefix that running requests share once per request, not once per group")
    p.add_argument("--enable-piecewise-cuda-graph", action="store_true",
                   help="extend (prefill) steps replay piecewise CUDA graphs (attention eager between them)")
    p.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=None,
                   help="largest extend step replayed from piecewise CUDA graphs (default: --max-prefill-tokens)")
    p.add_argument("--sampling-defaults", default=None, choices=SAMPLING_DEFAULTS,
                   help="model (default): OpenAI requests take the sampling fields they leave unset from the model's "
                        "generation_config.json; openai: the library's defaults")
    p.add_argument("--max-logprobs", type=int, default=None,
                   help="the most top logprobs a request may ask for (vLLM's flag; default 20, -1: the vocabulary)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-interval", type=float, default=None, help="seconds between scheduler log lines")
    p.add_argument("--log-requests", action="store_true", help="log every HTTP request (uvicorn access log)")
    return p
