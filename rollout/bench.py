"""Offline throughput benchmark (the nano-vllm protocol): random token-id prompts, ``ignore_eos``, one timed
``Engine.generate`` call; optionally the same prompts through ``transformers`` ``generate`` as a baseline.

Command line::

    python -m rollout.bench                                   # SmolLM2-135M, 256 prompts x 1024 in / 1024 out
    python -m rollout.bench --random-range                    # lengths uniform in [100, 1024] (nano-vllm)
    python -m rollout.bench --preset llama-3.1-8b --num-prompts 256 --random-range --batch1-steps 64
    python -m rollout.bench --preset tiny --num-prompts 16 --input-len 32 --output-len 16 --hf-baseline

Besides tokens/s it reports the mean decode-step time at the steady batch size (and at batch size 1 with
``--batch1-steps``) against a memory-bandwidth floor: (weight bytes a decode step reads on one TP rank +
KV bytes read at that step) / the device-to-device copy bandwidth the bench measures itself.

``--preset NAME`` benchmarks a random-weight checkpoint with a real model's shapes (bf16 safetensors and a
synthetic word-level tokenizer), written once into ``<cache_root>/presets/NAME`` (or ``--preset-dir``); the
engine then runs with ``skip_tokenizer_init=True`` (token ids only, no detokenizer process). With ``--model``
the engine loads the model's tokenizer and detokenizes as in normal use.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import sys
import time
import uuid
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rollout.config import (ATTENTION_BACKENDS, DECODE_ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATION_METHODS,
                            ModelConfig, kv_cache_torch_dtype)

MAX_SHARD_BYTES = 2 * 1024**3
PRESET_NAMES = ("tiny", "qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b")
_PRESET_MARKER = "rollout_preset.json"
_INIT_STD = 0.02


# ---- presets --------------------------------------------------------------------------------------

def _llama3_rope_scaling(factor: float) -> dict[str, Any]:
    return {"factor": factor, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def _llama(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int,
           theta: float, max_pos: int, tie: bool, eps: float, rope_scaling: dict | None) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "rope_theta": theta, "rope_scaling": rope_scaling, "max_position_embeddings": max_pos,
            "tie_word_embeddings": tie, "rms_norm_eps": eps, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": _INIT_STD,
            "bos_token_id": 128000 if vocab == 128256 else 1, "eos_token_id": 128001 if vocab == 128256 else 2,
            "torch_dtype": "bfloat16", "use_cache": True}


def _qwen3(hidden: int, inter: int, layers: int, heads: int, kv: int, tie: bool) -> dict[str, Any]:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128, "rope_theta": 1000000.0,
            "rope_scaling": None, "max_position_embeddings": 40960, "tie_word_embeddings": tie,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": layers,
            "initializer_range": _INIT_STD, "bos_token_id": 151643, "eos_token_id": 151645,
            "torch_dtype": "bfloat16", "use_cache": True}


def preset_config(name: str) -> dict[str, Any]:
    """The config.json dict of preset ``name`` (a fresh dict each call): the real model's shapes and rope
    settings (values of the Hugging Face hub configs), or a few-MB Llama for ``tiny``."""
    builders = {
        "tiny": lambda: _llama(1024, 128, 256, 2, 4, 2, 32, 10000.0, 4096, False, 1e-6, None),
        "qwen3-0.6b": lambda: _qwen3(1024, 3072, 28, 16, 8, True),
        "qwen3-8b": lambda: _qwen3(4096, 12288, 36, 32, 8, False),
        "llama-3.2-1b": lambda: _llama(128256, 2048, 8192, 16, 32, 8, 64, 500000.0, 131072, True, 1e-5,
                                       _llama3_rope_scaling(32.0)),
        "llama-3.1-8b": lambda: _llama(128256, 4096, 14336, 32, 32, 8, 128, 500000.0, 131072, False, 1e-5,
                                       _llama3_rope_scaling(8.0)),
    }
    if name not in builders:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESET_NAMES)}")
    return builders[name]()


def preset_param_specs(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF parameter name, shape) of every tensor a checkpoint of ``config`` stores, in model order; built
    on the ``meta`` device, so nothing is allocated. A tied LM head is not listed (it is the embedding)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    hf_config = AutoConfig.for_model(config["model_type"], **extra)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    specs = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    if config.get("tie_word_embeddings"):
        specs = [(n, s) for n, s in specs if n != "lm_head.weight"]
    return specs


def shard_plan(specs: Sequence[tuple[str, tuple[int, ...]]], bytes_per_elem: int,
               max_shard_bytes: int = MAX_SHARD_BYTES) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Split tensors, in order, into shards of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        n = _numel(shape) * bytes_per_elem
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    return shards


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _init_tensor(name: str, shape: tuple[int, ...], seed: int, device: str = "cpu"):
    """Norm weights 1, biases 0, everything else N(0, 0.02) in bf16, seeded by (seed, name) and drawn on
    ``device`` (a GPU draws an 8B model's 16 GB in seconds; the values differ from a CPU draw)."""
    import torch

    if "norm" in name:
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    gen = torch.Generator(device).manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, _INIT_STD, generator=gen).cpu()


def _write_weights(out: Path, specs: list[tuple[str, tuple[int, ...]]], seed: int,
                   max_shard_bytes: int) -> None:
    """Write bf16 safetensors shard by shard (one shard in memory at a time), with an index when sharded."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shards = shard_plan(specs, 2, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map: dict[str, str] = {}
    total = 0
    for fname, shard in tqdm(list(zip(names, shards)), desc="Writing preset shards", unit="shard"):
        tensors = {name: _init_tensor(name, shape, seed, device) for name, shape in shard}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        os.chmod(out / fname, (out / "config.json").stat().st_mode)  # safetensors writes 0600; use umask's
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({name: fname for name in tensors})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token ``<tN>`` per id, so the engine's detokenizer can run."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>").save_pretrained(str(out))


def _preset_complete(path: Path, name: str, seed: int) -> bool:
    marker = path / _PRESET_MARKER
    if not marker.is_file():
        return False
    return json.loads(marker.read_text()) == {"preset": name, "seed": seed}


def write_preset(name: str, root: str | os.PathLike[str] | None = None, seed: int = 0,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """Return the directory of preset ``name``'s random checkpoint under ``root`` (default
    ``<cache_root>/presets``), writing it first if absent. It is written into a temporary directory and
    renamed into place, so an existing directory with its marker file is always complete."""
    from rollout.default_model import cache_root

    config = preset_config(name)
    base = Path(root).expanduser() if root is not None else cache_root() / "presets"
    final = base / name
    if _preset_complete(final, name, seed):
        return str(final)
    base.mkdir(parents=True, exist_ok=True)
    tmp = base / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _write_weights(tmp, preset_param_specs(config), seed, max_shard_bytes)
        _write_tokenizer(tmp, config["vocab_size"])
        (tmp / _PRESET_MARKER).write_text(json.dumps({"preset": name, "seed": seed}) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


# ---- bytes per decode step ------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelBytes:
    """Bytes on one TP rank: all weights, the weights one decode step reads, and KV bytes per token."""

    weight_bytes: int
    weight_bytes_read: int
    kv_bytes_per_token: int


def model_bytes(cfg: ModelConfig, tp_size: int, elem_bytes: int, kv_elem_bytes: int | None = None,
                quantization: str | None = None) -> ModelBytes:
    """Count from the config, sharded as the engine shards: heads, MLP columns and vocabulary rows are
    split across ranks; norms are replicated; KV heads are replicated when ``tp_size > num_kv_heads``.
    A decode step reads every weight except an untied input-embedding table (only the batch's rows).
    KV entries take ``kv_elem_bytes`` each (default: ``elem_bytes``, the model dtype). Under
    ``quantization="fp8"`` the projections take 1 byte per element plus a float32 scale per local row."""
    heads = cfg.num_heads // tp_size
    kv_heads = cfg.num_kv_heads // tp_size if cfg.num_kv_heads >= tp_size else 1
    vocab_rows = -(-cfg.vocab_size // tp_size)
    h, d = cfg.hidden_size, cfg.head_dim
    qkv_out = (heads + 2 * kv_heads) * d
    mlp = cfg.intermediate_size // tp_size
    proj = h * qkv_out + heads * d * h + 3 * h * mlp  # qkv, o, gate_up, down
    proj_rows = qkv_out + h + 2 * mlp + h
    proj_bytes = proj + 4 * proj_rows if quantization == "fp8" else proj * elem_bytes
    other = 2 * h + (qkv_out if cfg.qkv_bias else 0) + (2 * d if cfg.qk_norm else 0)  # norms, biases
    read = cfg.num_layers * (proj_bytes + other * elem_bytes) + (h + vocab_rows * h) * elem_bytes  # + final norm, LM head
    stored = read + (0 if cfg.tie_word_embeddings else vocab_rows * h * elem_bytes)
    kv = 2 * cfg.num_layers * kv_heads * d * (kv_elem_bytes or elem_bytes)
    return ModelBytes(stored, read, kv)


def measure_copy_bandwidth(device: str, nbytes: int | None = None, repeats: int = 10) -> float:
    """Best-of-``repeats`` device-to-device ``copy_`` bandwidth in bytes/s, counting bytes read plus bytes
    written (2 x size). Default size: 1 GiB on CUDA, 256 MiB on CPU."""
    import torch

    cuda = device.startswith("cuda")
    nbytes = nbytes or (1024**3 if cuda else 256 * 1024**2)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch pages / warm up
    best = float("inf")
    for _ in range(repeats):
        best = min(best, _time_copy(dst, src, cuda))
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    return 2 * nbytes / best


def _time_copy(dst, src, cuda: bool) -> float:
    import torch

    if not cuda:
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000.0


# ---- workload -------------------------------------------------------------------------------------

@dataclass
class Workload:
    """Prompts (random token ids) and each prompt's exact output length."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_prompts: int, vocab_size: int, seed: int, input_len: int, output_len: int,
                  length_range: tuple[int, int] | None = None) -> Workload:
    """``num_prompts`` prompts of uniform random token ids in [0, vocab). Fixed lengths, or with
    ``length_range=(lo, hi)`` input and output lengths each drawn uniformly from [lo, hi] (nano-vllm)."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_prompts):
        n_in = rng.randint(*length_range) if length_range else input_len
        n_out = rng.randint(*length_range) if length_range else output_len
        prompts.append([rng.randrange(vocab_size) for _ in range(n_in)])
        outs.append(n_out)
    return Workload(prompts, outs)


# ---- runs -----------------------------------------------------------------------------------------

@dataclass
class RunResult:
    """One timed generation run: token counts and wall time."""

    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s}


@dataclass
class StepTiming:
    """Mean decode-step time at one batch size, and the mean KV tokens those steps read."""

    batch_size: int
    steps: int
    mean_step_ms: float
    mean_kv_tokens: float


@dataclass
class EngineRun:
    """The engine's timed run, its steady-batch decode timing, and the optional batch-1 timing."""

    result: RunResult
    steady: StepTiming | None
    batch1: StepTiming | None = None
    context_len: int = 0
    kv_tokens: int = 0
    step_stats: dict[str, Any] = field(default_factory=dict)


def steady_step(stats: dict[str, Any]) -> StepTiming | None:
    """From ``Engine.get_step_stats()``: the batch size with the most decode steps (ties: the larger)."""
    decode = stats.get("decode") or {}
    if not decode:
        return None
    bs = max(decode, key=lambda b: (decode[b]["steps"], b))
    return _timing(int(bs), decode[bs])


def _timing(batch_size: int, entry: dict[str, Any]) -> StepTiming:
    steps = entry["steps"]
    return StepTiming(batch_size, steps, 1000.0 * entry["seconds"] / steps, entry["kv_tokens"] / steps)


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine keyword options from the flags; presets skip the tokenizer (no detokenizer process)."""
    opts: dict[str, Any] = {"seed": args.seed, "skip_tokenizer_init": bool(args.preset)}
    for name in ("max_running_requests", "mem_fraction_static", "attention_backend", "decode_attention_backend",
                 "kv_cache_dtype", "quantization", "page_size"):
        if getattr(args, name) is not None:
            opts[name] = getattr(args, name)
    return opts


def _sampling(output_len: int, temperature: float):
    from rollout.sampling_params import SamplingParams

    return SamplingParams(max_new_tokens=output_len, temperature=temperature, ignore_eos=True)


def run_engine(args: argparse.Namespace, model_path: str, device: str, dtype: str, work: Workload) -> EngineRun:
    """Start the engine, warm up, time one ``generate`` over the workload, then the batch-1 probe."""
    from rollout.engine import Engine

    with Engine(model_path, tp_size=args.tp_size, dtype=dtype, device=device, **_engine_options(args)) as engine:
        longest = max(len(p) + n for p, n in zip(work.prompts, work.output_lens))
        if longest > engine.context_len:
            raise ValueError(f"a request needs {longest} tokens but the engine's context is {engine.context_len}")
        if args.warmup:
            _engine_warmup(engine, work, args)
        engine.get_step_stats(reset=True)
        params = [_sampling(n, args.temperature) for n in work.output_lens]
        start = time.perf_counter()
        outs = engine.generate(prompt_token_ids=work.prompts, sampling_params=params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        stats = engine.get_step_stats(reset=True)
        produced = sum(len(c.token_ids) for o in outs for c in o.outputs)
        run = EngineRun(RunResult(len(outs), work.input_tokens, produced, elapsed), steady_step(stats),
                        context_len=engine.context_len, kv_tokens=engine.get_server_info()["max_total_tokens"],
                        step_stats=stats)
        if args.batch1_steps:
            run.batch1 = _batch1_probe(engine, work, args)
    return run


def _engine_warmup(engine: Any, work: Workload, args: argparse.Namespace) -> None:
    """Untimed generates on separate random prompts, then drop their prefix-cache entries: a short one,
    and one whose prefill fills a whole prefill batch with prompts as long as the workload's longest,
    so that every kernel the timed run uses at those shapes is compiled and loaded first (the first 8B
    fp8 run on a fresh H200 had a 6.22 s prefill, the next run on the same machine 4.28 s)."""
    vocab = engine.model_config.vocab_size
    warm = make_workload(min(8, len(work.prompts)), vocab, args.seed + 1, 16, 8)
    engine.generate(prompt_token_ids=warm.prompts, sampling_params=_sampling(8, args.temperature),
                    use_tqdm=False)
    longest = max(len(p) for p in work.prompts)
    count = min(len(work.prompts), -(-engine.config.max_prefill_tokens // longest))
    full = make_workload(count, vocab, args.seed + 3, longest, 8)
    engine.generate(prompt_token_ids=full.prompts, sampling_params=_sampling(8, args.temperature),
                    use_tqdm=False)
    engine.flush_cache()


def _batch1_probe(engine: Any, work: Workload, args: argparse.Namespace) -> StepTiming | None:
    """One request alone for ``args.batch1_steps`` decode steps; its mean step time at batch size 1."""
    n_in = max(1, min(round(work.input_tokens / len(work.prompts)), engine.context_len - args.batch1_steps - 2))
    probe = make_workload(1, engine.model_config.vocab_size, args.seed + 2, n_in, args.batch1_steps + 1)
    engine.get_step_stats(reset=True)
    engine.generate(prompt_token_ids=probe.prompts, sampling_params=_sampling(args.batch1_steps + 1,
                                                                              args.temperature), use_tqdm=False)
    entry = (engine.get_step_stats(reset=True).get("decode") or {}).get(1)
    return _timing(1, entry) if entry else None


def run_hf(model_path: str, device: str, dtype: str, work: Workload, temperature: float, batch_size: int,
           warmup: bool) -> RunResult:
    """The same prompts through ``AutoModelForCausalLM.generate`` in left-padded batches of ``batch_size``.

    Each batch generates exactly its longest requested output (``min_new_tokens = max_new_tokens``, no
    EOS stop); only the tokens each prompt requested count as output tokens."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    if warmup:
        _hf_generate(model, [[1] * 16] * min(batch_size, len(work.prompts)), 4, temperature, device)
    batches = [range(i, min(i + batch_size, len(work.prompts))) for i in range(0, len(work.prompts), batch_size)]
    bar = tqdm(batches, desc="HF generate", unit="batch", dynamic_ncols=True)
    start, done = time.perf_counter(), 0
    for idx in bar:
        _hf_generate(model, [work.prompts[i] for i in idx], max(work.output_lens[i] for i in idx),
                     temperature, device)
        done += sum(work.output_lens[i] for i in idx)
        bar.set_postfix_str(f"out {done / (time.perf_counter() - start):.1f} tok/s")
    elapsed = time.perf_counter() - start
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return RunResult(len(work.prompts), work.input_tokens, work.output_tokens, elapsed)


def _hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, temperature: float, device: str) -> None:
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                              pad_token_id=0, **sample)
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
    if out.shape[1] - width != new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, expected {new_tokens}")
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- report ---------------------------------------------------------------------------------------

def floor_ms(mb: ModelBytes, kv_tokens: float, bandwidth: float) -> float:
    """Memory-bandwidth floor of one decode step in ms: (weights read + KV read) / copy bandwidth."""
    return 1000.0 * (mb.weight_bytes_read + kv_tokens * mb.kv_bytes_per_token) / bandwidth


def _step_report(timing: StepTiming | None, mb: ModelBytes, bandwidth: float) -> dict[str, Any] | None:
    if timing is None:
        return None
    floor = floor_ms(mb, timing.mean_kv_tokens, bandwidth)
    return {**asdict(timing), "floor_ms": floor, "step_over_floor": timing.mean_step_ms / floor,
            "kv_bytes_read": timing.mean_kv_tokens * mb.kv_bytes_per_token}


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({os.cpu_count()} CPUs)" if names else platform.processor()
    except OSError:
        return platform.processor() or "cpu"


def build_report(args: argparse.Namespace, model_path: str, device: str, dtype: str, work: Workload,
                 engine: EngineRun, mb: ModelBytes, bandwidth: float, hf: RunResult | None) -> dict[str, Any]:
    """Everything the bench measured, as one JSON-ready dict (the printed table shows the same numbers)."""
    import torch
    import transformers

    workload = {"num_prompts": len(work.prompts), "temperature": args.temperature, "seed": args.seed,
                "input_len": None if args.random_range else args.input_len,
                "output_len": None if args.random_range else args.output_len,
                "random_range": [args.min_len, args.max_len] if args.random_range else None}
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "model": model_path, "preset": args.preset, "device": device, "device_name": _device_name(device),
        "dtype": dtype, "kv_cache_dtype": args.kv_cache_dtype or "auto", "quantization": args.quantization,
        "page_size": args.page_size or 1,
        "tp_size": args.tp_size,
        "decode_attention_backend": args.decode_attention_backend or "auto",
        "workload": workload,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "engine": engine.result.to_dict(),
        "memory": {"copy_bandwidth_gb_s": bandwidth / 1e9, **asdict(mb), "kv_cache_tokens": engine.kv_tokens,
                   "kv_cache_gib": engine.kv_tokens * mb.kv_bytes_per_token / 2**30},
        "decode_steady": _step_report(engine.steady, mb, bandwidth),
        "decode_batch1": _step_report(engine.batch1, mb, bandwidth),
        "prefill": engine.step_stats.get("prefill"),
        "hf": hf.to_dict() if hf else None,
        "engine_over_hf": engine.result.output_tok_s / hf.output_tok_s if hf else None,
    }
    return report


def format_report(r: dict[str, Any]) -> str:
    """The human-readable table of a report dict."""
    w = r["workload"]
    lens = (f"lengths uniform in [{w['random_range'][0]}, {w['random_range'][1]}]" if w["random_range"]
            else f"input {w['input_len']}, output {w['output_len']} tokens")
    lines = [f"model {r['model']} | {r['device_name']} | {r['dtype']} | weights {r.get('quantization') or r['dtype']} | "
             f"KV {r.get('kv_cache_dtype', 'auto')} | "
             f"tp {r['tp_size']} | decode attention {r.get('decode_attention_backend', 'auto')} | "
             f"page size {r.get('page_size', 1)}",
             f"workload: {w['num_prompts']} prompts, {lens}, temperature {w['temperature']}, seed {w['seed']}",
             f"{'':<22}{'engine':>14}{'hf generate':>14}"]
    e, h = r["engine"], r["hf"] or {}
    for key, label, fmt in (("num_requests", "requests", "{:.0f}"), ("input_tokens", "input tokens", "{:.0f}"),
                            ("output_tokens", "output tokens", "{:.0f}"), ("elapsed_s", "elapsed (s)", "{:.2f}"),
                            ("output_tok_s", "output tok/s", "{:.1f}"), ("total_tok_s", "total tok/s", "{:.1f}")):
        hf_val = fmt.format(h[key]) if key in h else "-"
        lines.append(f"{label:<22}{fmt.format(e[key]):>14}{hf_val:>14}")
    if r["engine_over_hf"] is not None:
        lines.append(f"engine / hf output tok/s: {r['engine_over_hf']:.2f}x  (hf batches run to their longest "
                     f"output; hf counts only each prompt's requested output tokens)")
    m = r["memory"]
    lines.append(f"copy bandwidth {m['copy_bandwidth_gb_s']:.1f} GB/s (read+write); weights read per step "
                 f"{m['weight_bytes_read'] / 1e6:.1f} MB of {m['weight_bytes'] / 1e6:.1f} MB per rank; "
                 f"KV {m['kv_bytes_per_token']} B/token/rank")
    lines.append(f"KV cache {m['kv_cache_tokens']} tokens ({m['kv_cache_gib']:.1f} GiB per rank)")
    pre = r.get("prefill") or {}
    if pre.get("steps"):
        lines.append(f"prefill: {pre['tokens']} tokens in {pre['steps']} steps, {pre['seconds']:.2f} s "
                     f"({pre['tokens'] / max(pre['seconds'], 1e-9):.0f} tok/s)")
    for key in ("decode_steady", "decode_batch1"):
        s = r[key]
        if s is not None:
            lines.append(f"decode step (batch {s['batch_size']}, {s['steps']} steps, mean KV {s['mean_kv_tokens']:.0f}"
                         f" tokens): {s['mean_step_ms']:.2f} ms; bandwidth floor {s['floor_ms']:.2f} ms; "
                         f"step/floor {s['step_over_floor']:.2f}")
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rollout.bench", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="local HF model dir (default: SmolLM2-135M-Instruct)")
    src.add_argument("--preset", choices=PRESET_NAMES, default=None,
                     help="benchmark a random-weight checkpoint with this model's real shapes")
    p.add_argument("--preset-dir", default=None, help="where presets are cached (default <cache>/presets)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--random-range", action="store_true",
                   help="draw input and output lengths uniformly from [--min-len, --max-len]")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (default 0.6, as nano-vllm)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="auto: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None)
    p.add_argument("--decode-attention-backend", choices=DECODE_ATTENTION_BACKENDS, default=None,
                   help="decode kernel under the flashinfer backend (default auto: triton)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="KV cache storage type (default auto: the model dtype); fp8 halves the KV bytes")
    p.add_argument("--page-size", type=int, default=None,
                   help="KV slots per page (default 1; --decode-attention-backend xqa needs 16, 32, 64 or 128)")
    p.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                   help="online weight quantization (fp8: W8A8 projections; default none: the model dtype)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="a short untimed generate first (default on)")
    p.add_argument("--batch1-steps", type=int, default=0,
                   help="also time N decode steps of one request alone (batch size 1)")
    p.add_argument("--hf-baseline", action="store_true", help="also run transformers generate on the same prompts")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or args.hf_batch_size < 1:
        p.error("--num-prompts, --input-len, --output-len and --hf-batch-size must be >= 1")
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    if args.temperature < 0 or args.batch1_steps < 0:
        p.error("--temperature and --batch1-steps must be >= 0")


def _resolve_model(args: argparse.Namespace) -> str:
    if args.preset:
        return write_preset(args.preset, args.preset_dir, seed=0)
    if args.model:
        return args.model
    from rollout.default_model import ensure_default_model

    return ensure_default_model()


def _resolve_device(device: str | None) -> str:
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the table (and write ``--json``). Returns the exit code."""
    import torch

    args = parse_args(argv)
    model_path = _resolve_model(args)
    device = _resolve_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    cfg = ModelConfig.from_path(model_path)
    length_range = (args.min_len, args.max_len) if args.random_range else None
    work = make_workload(args.num_prompts, cfg.vocab_size, args.seed, args.input_len, args.output_len, length_range)
    engine = run_engine(args, model_path, device, dtype, work)
    bandwidth = measure_copy_bandwidth(device)
    hf = (run_hf(model_path, device, dtype, work, args.temperature, args.hf_batch_size, args.warmup)
          if args.hf_baseline else None)
    model_dtype = getattr(torch, dtype)
    kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype or "auto", model_dtype)
    mb = model_bytes(cfg, args.tp_size, model_dtype.itemsize, kv_dtype.itemsize, args.quantization)
    report = build_report(args, model_path, device, dtype, work, engine, mb, bandwidth, hf)
    print(format_report(report), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
