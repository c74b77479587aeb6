"""The bench's ``--hf-baseline``: the same prompts through ``transformers`` ``generate``."""

from __future__ import annotations

import time
from typing import Any

from benchmarks.workload import RunResult, Workload


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
