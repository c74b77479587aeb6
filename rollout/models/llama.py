"""One Llama-family model for Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm) and their mixture-of-experts
kin Qwen3-MoE (Qwen3's attention) and Mixtral (Mistral's), tensor-parallel."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rollout.config import ModelConfig
from rollout.distributed import TPGroup
from rollout.layers.attention import Attention
from rollout.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from rollout.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rollout.layers.norm import RMSNorm
from rollout.layers.quantization import Fp8Activation, fused_quant_supports
from rollout.layers.rotary import RotaryEmbedding, rope_inv_freq
from rollout.layers.split_k import SplitKPartials
from rollout.model_executor.forward_batch import ForwardBatch
from rollout.models.moe import SparseMoeBlock


class LlamaAttention(nn.Module):
    """The attention block's weights and parts; ``LlamaDecoderLayer`` runs them in turn (``project``, ``attn``,
    ``o_proj``), with a cut at the attention for the piecewise CUDA graphs, so the block has no ``forward``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPGroup,
                 dtype: torch.dtype, device: Any, fused: bool = False, quant: str | None = None) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, tp, dtype, device, quant)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, tp, dtype, device,
                                        quant, split_k=fused)  # split: its output goes to the fused add + norm
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, fused) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, fused) if cfg.qk_norm else None
        self.rotary = rotary
        self.head_dim = cfg.head_dim
        self.fused = fused
        self.attn = Attention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim,
                              cfg.head_dim ** -0.5)

    def project(self, positions: torch.Tensor, x: torch.Tensor | Fp8Activation, batch: ForwardBatch,
                q_out: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
        """The attention's inputs from the normed hidden states: ``(q, k, v, kv_stored)`` for ``self.attn``
        (q normed and roped; k and v None once the fused kernel has written them into the KV pool). ``q_out``
        [T, Hq, D]: where the fused kernel writes q (a piecewise CUDA graph's fixed buffer)."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        t = x.shape[0]
        q = q.reshape(t, -1, self.head_dim)
        k = k.reshape(t, -1, self.head_dim)
        if self.fused:  # one Triton kernel: q/k norm and rope on q and k, k and v written into the KV pool
            from rollout.kernels.rope import rope_and_store_kv

            pool, layer = batch.kv_pool, self.attn.layer_id
            v = v.reshape(t, -1, self.head_dim)
            fresh = batch.attn_backend.wants_fresh_kv(batch)
            k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if fresh else None
            norms = {} if self.q_norm is None else dict(
                q_norm_weight=self.q_norm.weight, k_norm_weight=self.k_norm.weight, norm_eps=self.q_norm.eps)
            q = rope_and_store_kv(q, k, v, positions, self.rotary.cos_cache, self.rotary.sin_cache,
                                  pool.k_buffers[layer], pool.v_buffers[layer], batch.out_cache_loc, q_out=q_out,
                                  k_out=k_out, **norms)
            return (q, k_out, v.contiguous(), True) if fresh else (q, None, None, False)
        if q_out is not None:
            raise ValueError("q_out needs the fused path (CUDA with FlashInfer)")
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v, False


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: Any, fused: bool = False,
                 quant: str | None = None) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size], False, tp, dtype, device,
                                                       quant)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, False, tp, dtype, device, quant, split_k=fused)
        self.fused = fused
        self.quantize_act = fused and quant == "fp8" and fused_quant_supports(self.down_proj.in_local)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor | SplitKPartials:
        """The MLP's output; on the fused path a small batch's may be ``SplitKPartials`` (for the next norm)."""
        gate_up = self.gate_up_proj(x)
        if self.quantize_act:  # one kernel: SiLU·mul and the per-token fp8 quantization of down_proj's input
            from rollout.kernels.fused_quant import silu_mul_quant_fp8

            return self.down_proj(silu_mul_quant_fp8(gate_up))
        if self.fused:
            from flashinfer.activation import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is passed along so norms can fuse the add (HF's order). Its ``mlp``
    is a ``SparseMoeBlock`` on the layers ``cfg.sparse_layers`` names (MoE models), else the dense MLP."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPGroup,
                 dtype: torch.dtype, device: Any, fused: bool = False, quant: str | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rotary, tp, dtype, device, fused, quant)
        self.sparse = layer_id in cfg.sparse_layers
        self.mlp = (SparseMoeBlock(cfg, layer_id, tp, dtype, device, fused, quant) if self.sparse
                    else LlamaMLP(cfg, tp, dtype, device, fused, quant))
        # before fp8 projections the fused norms also quantize their output (no separate kernel)
        quantize = fused and quant == "fp8" and fused_quant_supports(cfg.hidden_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, fused, quantize)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, fused, quantize)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, stored, residual = self.attention_inputs(positions, x, residual, batch)
        return self.attention_output(self.self_attn.attn(q, k, v, batch, kv_stored=stored), residual, batch)

    def attention_inputs(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                         batch: ForwardBatch, q_out: torch.Tensor | None = None):
        """The layer up to its attention: the input norm (adding ``x`` into ``residual``, which the fused norm
        does in place) and ``LlamaAttention.project``; returns ``(q, k, v, kv_stored, residual)``."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        return (*self.self_attn.project(positions, h, batch, q_out), residual)

    def attention_output(self, attn: torch.Tensor, residual: torch.Tensor,
                         batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its attention (output [T, Hq * D]): o_proj, the norm, the MLP; ``(x, residual)``."""
        h, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn), residual)
        return (self.mlp(h, batch) if self.sparse else self.mlp(h)), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup, dtype: torch.dtype, device: Any,
                 fused: bool = False, quant: str | None = None) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(cfg.raw, cfg.rope, cfg.head_dim)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, inv_freq, scaling, dtype, device)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, rotary, tp, dtype, device, fused, quant)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, fused)
        self.rotary = rotary

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(batch.positions, x, residual, batch)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Causal LM whose ``forward`` returns the logits of each request's last new token [B, vocab]
    (``model`` alone gives the final hidden states of every token, for prompt logprobs).

    ``fused=True`` (CUDA with FlashInfer) uses fused add+RMSNorm and SiLU·mul kernels; the default
    torch path computes exactly what transformers computes. ``quant="fp8"`` stores the decoder layers'
    projections in fp8 (``rollout.layers.quantization``); embeddings, norms and the LM head stay as they are.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup, dtype: torch.dtype, device: Any,
                 fused: bool = False, quant: str | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions, tp, dtype, device, fused, quant)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.logits(batch, self.model(batch), out)

    def logits(self, batch: ForwardBatch, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, vocab] of each request's last token, from the final hidden states [T, H] of ``batch``
        (written into ``out`` [B, padded vocab] if given: ``ParallelLMHead.logits``)."""
        last = batch.last_token_indices()
        if last is not None:
            hidden = hidden.index_select(0, last)
        return self.lm_head.logits(hidden, out)
