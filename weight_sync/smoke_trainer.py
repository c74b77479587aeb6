"""The trainer process of ``rollout-smoke``: holds the checkpoint in transformers, learns from a rollout,
pushes the new weights into the engine, and measures the result. It reports numbers; ``smoke`` judges."""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from weight_sync.hf_compare import greedy_gaps, hf_greedy, hf_logprobs

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 7 times 8?",
    "Write a haiku about the sea.", "Who wrote Romeo and Juliet?", "Say hello in French.",
    "How many legs does a spider have?", "What is the largest planet in our solar system?",
]


@dataclass
class SmokeConfig:
    model_path: str
    mode: str
    bucket_mb: float
    dtype: str
    trainer_device: str
    backend: str
    port: int
    tp_size: int
    num_prompts: int
    max_new_tokens: int
    lr: float
    seed: int
    replay_routing: bool = False  # a mixture-of-experts model: compare with the engine's routing replayed


def _parity(model: Any, outs: list[Any], reference: Any = None) -> dict[str, float]:
    """The engine's logprobs against transformers' (teacher-forced; with the engine's routing replayed where
    the outputs carry it, counting the router choices that differ). With ``reference`` (the float32 model,
    when ``model`` is its 16-bit copy) also "ref_max": how far transformers' own 16-bit logprobs fall from
    float32's on the same tokens (the scale of 16-bit rounding for this model), and "fp32_max": the engine's
    distance from float32."""
    counts: dict[str, int] = {}
    ours, theirs, exact = [], [], []
    for o in outs:
        for c in o.outputs:
            if len(c.token_logprobs) != len(c.token_ids):  # zip below would pair the rest off by one, or drop them
                raise ValueError(f"the engine returned {len(c.token_logprobs)} logprobs for {len(c.token_ids)} tokens")
            ours += c.token_logprobs
            theirs += hf_logprobs(model, o.prompt_token_ids, c.token_ids, c.routed_experts, counts)
            if reference is not None:
                exact += hf_logprobs(reference, o.prompt_token_ids, c.token_ids, c.routed_experts)
    deltas = [abs(a - b) for a, b in zip(ours, theirs)]
    report = {"max": max(deltas), "mean": statistics.fmean(deltas), "tokens": len(deltas),
              "routing_rows": counts.get("rows", 0), "routing_differ": counts.get("differ", 0)}
    if exact:
        report["ref_max"] = max(abs(a - b) for a, b in zip(theirs, exact))
        report["fp32_max"] = max(abs(a - b) for a, b in zip(ours, exact))
    return report


def _train_step(model: Any, outs: list[Any], lr: float, device: str) -> float:
    """One AdamW step of supervised learning on the engine's own samples (a real optimizer step)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    total = 0.0
    samples = [(o.prompt_token_ids, c.token_ids) for o in outs for c in o.outputs if c.token_ids]
    for prompt, completion in samples:
        ids = torch.tensor([prompt + completion], device=device)
        labels = ids.clone()
        labels[0, :len(prompt)] = -100
        loss = model(ids, labels=labels).loss / len(samples)
        loss.backward()
        total += float(loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    return total


def run(cfg: SmokeConfig, conn: Any, results: Any) -> None:
    """Process target: puts one report dict (or {"error": ...}) on ``results``."""
    from rollout.logging_utils import dump_stacks_periodically

    dump_stacks_periodically()
    try:
        results.put(_run(cfg, conn))
    except Exception as e:  # noqa: BLE001 - reported by the CLI
        import traceback

        results.put({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


def _run(cfg: SmokeConfig, conn: Any) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import weight_sync
    from rollout import SamplingParams
    from weight_sync.remote import RemoteEngine

    engine = RemoteEngine(conn)
    dtype = getattr(torch, cfg.dtype)
    if cfg.trainer_device.startswith("cuda"):
        torch.cuda.set_device(cfg.trainer_device)  # NCCL uses the current device
    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=torch.float32).to(cfg.trainer_device).eval()
    ask = _asker(engine, tok, cfg.num_prompts)
    sample = SamplingParams(temperature=1.0, n=2, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, logprobs=0,
                            return_routed_experts=cfg.replay_routing)
    report: dict[str, Any] = {"version_before": engine.get_weight_version()}

    t0 = time.perf_counter()
    rollout = ask(sample)
    report["rollout1"] = {"seconds": time.perf_counter() - t0, "sequences": sum(len(o.outputs) for o in rollout),
                          "tokens": sum(len(c.token_ids) for o in rollout for c in o.outputs),
                          "version": rollout[0].weight_version}
    served = _served(model, dtype)
    report["parity_before"] = _parity(served, rollout, None if served is model else model)
    fp_before = weight_sync.fingerprint(model, dtype=dtype)
    report["loss"] = _train_step(model, rollout, cfg.lr, cfg.trainer_device)
    fp_after = weight_sync.fingerprint(model, dtype=dtype)
    report["weights_changed"] = fp_before != fp_after

    report["sync"] = _sync(cfg, engine, model, dtype)
    report["fp_trainer"], report["fp_engine"] = fp_after, engine.weights_fingerprint()

    served = _served(model, dtype)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=cfg.max_new_tokens, return_routed_experts=cfg.replay_routing)
    outs = ask(greedy)
    eos = tok.eos_token_id
    theirs = [hf_greedy(served, o.prompt_token_ids, cfg.max_new_tokens, eos) for o in outs]
    stops = _stop_ids(tok, model)
    report["greedy_total"] = len(outs)
    report["greedy_equal"] = sum(o.outputs[0].token_ids == t for o, t in zip(outs, theirs))
    # a strict prefix of transformers' output diverges at no token, so no gap shows it: it must end at a stop token
    report["greedy_cut_short"] = sum(_cut_short(o.outputs[0].token_ids, t, stops) for o, t in zip(outs, theirs))
    report["greedy_max_gap"] = max(max(greedy_gaps(served, o.prompt_token_ids, o.outputs[0].token_ids,
                                                   o.outputs[0].routed_experts), default=0.0) for o in outs)
    rollout2 = ask(sample)
    report["parity_after"] = _parity(served, rollout2, None if served is model else model)
    report["version_after"] = engine.get_weight_version()
    report["output_versions"] = sorted({o.weight_version for o in outs + rollout2})
    report["sample_answer"] = outs[0].outputs[0].text.strip()
    return report


def _stop_ids(tok: Any, model: Any) -> set[int]:
    """The ids that end the engine's sequences: the tokenizer's EOS and the model's (config, generation config)."""
    ids = {tok.eos_token_id}
    for eos in (model.config.eos_token_id, model.generation_config.eos_token_id):
        ids.update(eos if isinstance(eos, list) else [eos])
    return {i for i in ids if i is not None}


def _cut_short(ours: list[int], theirs: list[int], stops: set[int]) -> bool:
    """``ours`` stops before ``theirs`` without a token of its own that differs, and not at a stop token."""
    return len(ours) < len(theirs) and ours == theirs[:len(ours)] and not (ours and ours[-1] in stops)


def _asker(engine: Any, tok: Any, n: int) -> Any:
    """``ask(params)``: the smoke's ``n`` questions to the engine, as chats where the tokenizer has a chat
    template, else as plain text (a base model's tokenizer often has none)."""
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    if getattr(tok, "chat_template", None):
        chats = [[{"role": "user", "content": q}] for q in questions]
        return lambda params: engine.chat(chats, params, use_tqdm=False)
    return lambda params: engine.generate(questions, params, use_tqdm=False)


def _served(model: Any, dtype: torch.dtype) -> Any:
    """The trainer's model as the engine serves it (cast to the engine's dtype)."""
    return model if next(model.parameters()).dtype == dtype else copy.deepcopy(model).to(dtype)


def _sync(cfg: SmokeConfig, engine: Any, model: Any, dtype: torch.dtype) -> dict[str, Any]:
    import weight_sync

    named = [(n, p.detach().to(dtype)) for n, p in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    if cfg.mode in ("bucket", "per-tensor"):
        group = weight_sync.join_engines([engine], "smoke", backend=cfg.backend, tp_size=cfg.tp_size, port=cfg.port)
        sender = weight_sync.WeightSender([engine], group, "smoke", bucket_bytes=int(cfg.bucket_mb * (1 << 20)),
                                          mode="bucket" if cfg.mode == "bucket" else "per_tensor")
        rep = sender.send(named)
        weight_sync.leave_engines([engine], group, "smoke")
        return {"mode": cfg.mode, "tensors": rep.num_tensors, "buckets": rep.num_buckets, "bytes": rep.bytes,
                "seconds": rep.seconds, "gbps": rep.gbps}
    start = time.perf_counter()
    if cfg.mode == "disk":
        with tempfile.TemporaryDirectory() as d:
            _served(model, dtype).save_pretrained(d)
            start = time.perf_counter()
            engine.update_weights_from_disk(d)
    elif cfg.mode == "tensor":
        engine.update_weights_from_tensor([(n, t.cpu()) for n, t in named])
    else:
        raise ValueError(f"unknown mode {cfg.mode!r}")
    seconds = time.perf_counter() - start
    return {"mode": cfg.mode, "tensors": len(named), "buckets": 1, "bytes": nbytes, "seconds": seconds,
            "gbps": nbytes / seconds / 1e9}

