"""Tiny random Hugging Face checkpoints (config → save_pretrained) for tests; no hub access."""

from __future__ import annotations

import os

import torch

TINY_VOCAB = 512


def _tokenizer():
    """A small word-level fast tokenizer, trained offline, with BOS/EOS special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    words = ("the a an of to in is was and for on with as by at from sky blue red green sun moon "
             "cat dog bird fish tree house car road city river sea hello world good bad day night "
             "one two three four five six seven eight nine ten capital france paris rome italy").split()
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 8, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    return fast


def make_tiny_checkpoint(path: str, arch: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0,
                         **overrides) -> str:
    """Write a random tiny checkpoint of ``arch`` (llama, mistral, qwen2, qwen3, and the mixture-of-experts
    qwen3_moe and mixtral: 8 experts, top-2) into ``path``."""
    from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config,
                              Qwen3Config, Qwen3MoeConfig)

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    if arch == "qwen3_moe":
        common.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
    if arch == "mixtral":
        common.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48)
    common.update(overrides)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig}[arch]
    if arch in ("qwen3", "qwen3_moe"):
        common.setdefault("head_dim", 32)
    config = cls(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # make norms and biases non-trivial so mistakes show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def scaled_copy(model: torch.nn.Module, factor: float) -> torch.nn.Module:
    """A copy of ``model`` with every parameter scaled by ``factor`` (a stand-in for a training step)."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.mul_(factor)
    return out
