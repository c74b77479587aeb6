"""Fused Triton sampler for the common RL fast path of :class:`rollout.layers.sampler.Sampler`.

Fast path: no penalties, no top-k / top-p / min-p, no top logprobs (``SamplingBatchInfo.fast_path``). Each
row's vocabulary is cut into S chunks of whole blocks, one program per (row, chunk), so that B x S programs
fill the GPU at any batch size (see ``_chunk_layout``). Two launches, both over the (B, S) grid:

1. ``_scan_kernel``: each program scans its chunk once: online max and sum-exp of the row's chosen
   distribution, the chunk's argmax of the logits (greedy rows) or of the exponential race
   ``logits / T - log(-log(U))`` (random rows, with the same hash as ``uniform_noise``), and the max of every
   block. A block whose max cannot beat the chunk's race best so far skips the hash; one where no entry's
   bound ``logits / T - log(1 - U)`` (``-log(U) >= 1 - U``) reaches it skips the two logs and the exact
   division, which are most of the work, so flat distributions cost little more than peaked ones. The
   partials go to a small float32 scratch tensor.
2. ``_finish_kernel``: each program combines its row's S partials in a fixed order (so all programs of a
   row get bit-identical max, log-sum-exp and token; ties go to the lowest token id), and, on random rows,
   counts the entries of its own chunk that rank above the token, reading only the blocks whose max does,
   and adds the count to the row's rank atomically (unless ``count_ranks`` is off: only outputs with logprobs
   carry ranks). Chunk 0 stores the token and its logprob.

Greedy rows need no count (their token is the argmax of the raw distribution, so its rank is 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.layers import sampler as _sampler

__all__ = ["fused_sample"]

_MUL1 = tl.constexpr(_sampler._MUL1)
_MUL2 = tl.constexpr(_sampler._MUL2)
_SEED_SALT = tl.constexpr(_sampler._SEED_SALT)
_POS_SALT = tl.constexpr(_sampler._POS_SALT)
_TOKEN_SALT = tl.constexpr(_sampler._TOKEN_SALT)
_KEY2_SALT = tl.constexpr(_sampler._KEY2_SALT)

# row modes: which distribution the token, logprob and rank come from
_GREEDY = tl.constexpr(0)     # argmax of the logits; raw distribution
_RAW = tl.constexpr(1)        # race on logits / T; raw distribution
_PROCESSED = tl.constexpr(2)  # race on logits / T; distribution log_softmax(logits / T)

# U <= 1 - 2**-24, so E = -log(U) >= 5.96e-8 and -log(E) <= 16.64: a block whose max z = logits / T is
# below best - 17 cannot win the race.
_RACE_BOUND = tl.constexpr(17.0)
# the per-entry bound's slack for rounding (x * (1 / T) against x / T, the approximate exp, the logs within an
# ulp): an absolute part and one relative to |logits / T|, both far above the few ulps they cover
_BOUND_SLACK = tl.constexpr(1e-3)
_BOUND_SLACK_REL = tl.constexpr(1e-5)
_BLOCK = 1024          # tile (4 warps): the fastest or near it at 16-256 rows (tools/bench_sampler.py --sweep)
_PROGRAMS_PER_SM = 4    # chunk rule on CUDA: B x S programs >= this many per SM
_INTERPRETER_CHUNKS = 4  # chunks per row off CUDA, so the CPU tests run the multi-chunk paths
_MAX_INT32 = tl.constexpr(2**31 - 1)


@triton.jit
def _mix32(x):
    """``sampler._mix32`` on uint32 (wrapping multiplies, logical shifts)."""
    x = x ^ (x >> 16)
    x = x * _MUL1
    x = x ^ (x >> 15)
    x = x * _MUL2
    return x ^ (x >> 15)


@triton.jit
def _row_keys(seed, position):
    """The two per-row uint32 keys of ``uniform_noise`` from an int64 seed and an int64 position."""
    key = _mix32(seed.to(tl.uint32) ^ _SEED_SALT)
    key = _mix32(key ^ (seed >> 32).to(tl.uint32))
    key = _mix32(key ^ (position.to(tl.uint32) ^ _POS_SALT))
    return key, _mix32(key ^ _KEY2_SALT)


@triton.jit
def _uniform(offs, key, key2):
    """``uniform_noise`` at token ids ``offs`` (int32): float32 odd multiples of 2**-24, bit-identical."""
    x = _mix32(key ^ _mix32(offs.to(tl.uint32) ^ _TOKEN_SALT))
    x = _mix32(x ^ key2)
    # the top 23 bits as the mantissa of 1 + j * 2**-23; minus (1 - 2**-24) this is exactly (2j + 1) * 2**-24
    one_plus = ((x >> 9) | 0x3F800000).to(tl.float32, bitcast=True)
    return one_plus - (1.0 - 2.0**-24)


@triton.jit
def _log(x):
    """Natural log of positive normal float32 ``x``, within 1 ulp, branch-free.

    Not tl.log, whose precision is the backend's (libdevice on NVIDIA; numpy's float32 log, up to 4 ulp
    off, in the interpreter): -log(U) is ~6e-8 for U near 1, i.e. for the tokens most likely to win the race,
    and needs relative precision there. This one is also the same formula in the interpreter as on the GPU
    (up to FMA contraction), so the CPU tests check the arithmetic the GPU runs.
    """
    bits = x.to(tl.int32, bitcast=True)
    e = (bits - 0x3F400000) >> 23  # x = 2**e * (1 + f) with 1 + f in [0.75, 1.5)
    f = (bits - (e << 23)).to(tl.float32, bitcast=True) - 1.0
    # e as float through the mantissa of 1.5 * 2**23 (no quarter-rate int-to-float conversion)
    ef = (e + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    q = -0.04490300267934799  # log1p(f) = f + f**2 * q(f): relative error < 5e-9 on [-0.25, 0.5]
    q = q * f + 0.10447084903717041
    q = q * f - 0.13161559402942657
    q = q * f + 0.14482031762599945
    q = q * f - 0.16647827625274658
    q = q * f + 0.1999061554670334
    q = q * f - 0.250000536441803
    q = q * f + 0.3333345353603363
    q = q * f - 0.5
    log1p = f + f * f * q
    return ef * 0.693359375 + (ef * -2.1219444005469e-4 + log1p)  # ln 2 split in a short exact part and a rest


@triton.jit
def _argmax_update(v, offs, v_max, tok, best):
    """Fold one block (values ``v`` at ``offs``, max ``v_max``) into the running argmax; lowest index wins ties."""
    if v_max > best:  # rare after the first blocks: the index reduction runs only then
        tok = tl.min(tl.where(v == v_max, offs, _MAX_INT32), axis=0)
        best = v_max
    return tok, best


@triton.jit
def _scan_chunk(row_ptr, t, inv_t, key, key2, blk_lo, blk_hi, V: tl.constexpr, MODE: tl.constexpr,
                BLOCK: tl.constexpr, NB: tl.constexpr):
    """Loop over blocks [blk_lo, blk_hi) of a row (blk_lo < blk_hi) -> (tok, best, m, s, blk_max) of the
    chosen distribution y (logits, or logits / T for _PROCESSED) on that chunk: tok / best the argmax of the
    logits (greedy) or of the race, lowest id on ties (tok 0, best -inf when nothing beats -inf);
    m = max(y); s = sum(exp(y - m)) (0 when m is -inf); the block maxima of y at their block ids in an
    [NB] vector (-inf elsewhere)."""
    offs0 = tl.arange(0, BLOCK)
    blk_ids = tl.arange(0, NB)
    blk_max = tl.full([NB], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    tok = tl.zeros([], tl.int32)
    end = tl.minimum(blk_hi * BLOCK, V)
    offs_next = blk_lo * BLOCK + offs0
    x_next = tl.load(row_ptr + offs_next, mask=offs_next < end, other=float("-inf"))
    for i in range(blk_lo, blk_hi):
        offs = i * BLOCK + offs0
        x = x_next.to(tl.float32)
        # prefetch: the next block's load is in flight while this one is reduced
        x_next = tl.load(row_ptr + offs + BLOCK, mask=offs + BLOCK < end, other=float("-inf"))
        y = x
        if MODE == _PROCESSED:
            y = tl.math.div_rn(x, t)
        y_max = tl.max(y, axis=0)
        blk_max = tl.where(blk_ids == i, y_max, blk_max)
        m_new = tl.maximum(m, y_max)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # keeps -inf - -inf (NaN) out while all is -inf
        acc = acc * tl.exp(m - shift) + tl.exp(y - shift)
        m = m_new
        if MODE == _GREEDY:
            tok, best = _argmax_update(x, offs, y_max, tok, best)
        else:
            z_max = y_max
            if MODE == _RAW:
                z_max = tl.math.div_rn(y_max, t)  # division by T > 0 rounds monotonically
            if z_max + _RACE_BOUND >= best:  # else no entry of the block can reach the chunk's best
                u = _uniform(offs, key, key2)
                # score = z - log(-log(U)) <= z - log(1 - U) (1 - U is exact); the block's exact scores only
                # where some entry's bound (z approximated by x * (1 / T), plus slack) reaches the best so far:
                # elsewhere every score is below it and the argmax would not move
                z_hat = y
                if MODE == _RAW:
                    z_hat = x * inv_t
                slack = _BOUND_SLACK + _BOUND_SLACK_REL * tl.abs(z_hat)
                reach = (1.0 - u) <= tl.exp(z_hat - best + slack)  # best -inf: every finite entry reaches
                if tl.max(reach.to(tl.int32), axis=0) > 0:
                    z = y
                    if MODE == _RAW:
                        z = tl.math.div_rn(x, t)
                    score = z - _log(-_log(u))
                    tok, best = _argmax_update(score, offs, tl.max(score, axis=0), tok, best)
    return tok, best, m, tl.sum(acc, axis=0), blk_max


@triton.jit
def _chunk_blocks(chunk, blocks_per_chunk, V: tl.constexpr, BLOCK: tl.constexpr):
    """The block range [lo, hi) of ``chunk``: chunks of ``blocks_per_chunk`` blocks, the last one shorter."""
    lo = chunk * blocks_per_chunk
    return lo, tl.minimum(lo + blocks_per_chunk, tl.cdiv(V, BLOCK))


@triton.jit(do_not_specialize=["width", "n_chunks", "blocks_per_chunk"])  # one compile for every batch size
def _scan_kernel(logits_ptr, stride, temp_ptr, seed_ptr, pos_ptr, greedy_ptr, processed_ptr, part_ptr, tok_ptr,
                 rank_ptr, width, n_chunks, blocks_per_chunk, V: tl.constexpr, BLOCK: tl.constexpr,
                 NB: tl.constexpr):
    """Program (row, chunk): the chunk's partials into the row's scratch (layout in ``fused_sample``);
    chunk 0 also sets the row's rank to 1, the base ``_finish_kernel`` adds its counts to."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    t = tl.load(temp_ptr + row).to(tl.float32)
    inv_t = 1.0 / t  # random rows only (T > 0): the race bound's approximate z
    key, key2 = _row_keys(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
    lo, hi = _chunk_blocks(chunk, blocks_per_chunk, V, BLOCK)
    if tl.load(greedy_ptr + row):
        tok, best, m, s, blk_max = _scan_chunk(row_ptr, t, inv_t, key, key2, lo, hi, V, _GREEDY, BLOCK, NB)
    elif tl.load(processed_ptr + row):
        tok, best, m, s, blk_max = _scan_chunk(row_ptr, t, inv_t, key, key2, lo, hi, V, _PROCESSED, BLOCK, NB)
    else:
        tok, best, m, s, blk_max = _scan_chunk(row_ptr, t, inv_t, key, key2, lo, hi, V, _RAW, BLOCK, NB)
    part_ptr += row * width
    tl.store(part_ptr + chunk, m)
    tl.store(part_ptr + n_chunks + chunk, s)
    tl.store(part_ptr + 2 * n_chunks + chunk, best)
    tl.store(tok_ptr + row * width + 3 * n_chunks + chunk, tok)
    blk_ids = tl.arange(0, NB)
    tl.store(part_ptr + 4 * n_chunks + blk_ids, blk_max, mask=(blk_ids >= lo) & (blk_ids < hi))
    if chunk == 0:
        tl.store(rank_ptr + row, 1)


@triton.jit
def _combine(part_ptr, tok_ptr, n_chunks, NB: tl.constexpr):
    """A row's chunk partials (row scratch at ``part_ptr`` / ``tok_ptr``) -> (tok, m, lse), reduced in one
    fixed order so every program of the row gets the same bits: m = max(y), lse = log(sum(exp(y - m))),
    tok = the partial tok of highest best, the lowest id on ties (chunks hold increasing ids)."""
    ids = tl.arange(0, NB)
    used = ids < n_chunks
    m_c = tl.load(part_ptr + ids, mask=used, other=float("-inf"))
    s_c = tl.load(part_ptr + n_chunks + ids, mask=used, other=0.0)
    best_c = tl.load(part_ptr + 2 * n_chunks + ids, mask=used, other=float("-inf"))
    tok_c = tl.load(tok_ptr + 3 * n_chunks + ids, mask=used, other=_MAX_INT32)
    m = tl.max(m_c, axis=0)
    shift = tl.where(m == float("-inf"), 0.0, m)  # all -inf: s_c are 0, keep their weights out of NaN
    s = tl.sum(s_c * tl.exp(m_c - shift), axis=0)
    best = tl.max(best_c, axis=0)
    tok = tl.min(tl.where(best_c == best, tok_c, _MAX_INT32), axis=0)
    return tok, m, _log(s)


@triton.jit
def _count_above(row_ptr, t, m, lse, lp_tok, blk_max, lo, hi, V: tl.constexpr, MODE: tl.constexpr,
                 BLOCK: tl.constexpr, NB: tl.constexpr):
    """Number of entries in blocks [lo, hi) whose logprob (y - m) - lse is strictly above ``lp_tok``. That
    expression rounds monotonically in y, so a block whose max (from ``blk_max``) is not above the token
    holds no such entry: skip it."""
    offs0 = tl.arange(0, BLOCK)
    blk_ids = tl.arange(0, NB)
    count = tl.zeros([BLOCK], tl.int32)
    if (tl.max(blk_max, axis=0) - m) - lse > lp_tok:  # else the whole chunk is at or below the token
        for i in range(lo, hi):
            y_max = tl.max(tl.where(blk_ids == i, blk_max, float("-inf")), axis=0)
            if (y_max - m) - lse > lp_tok:
                offs = i * BLOCK + offs0
                y = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                if MODE == _PROCESSED:
                    y = tl.math.div_rn(y, t)
                count += (((y - m) - lse) > lp_tok).to(tl.int32)
    return tl.sum(count, axis=0)


@triton.jit
def _finish_chunk(row_ptr, t, part_ptr, tok_ptr, ids_ptr, lp_ptr, rank_ptr, chunk, n_chunks, blocks_per_chunk,
                  V: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, COUNT: tl.constexpr):
    """Program (row, chunk) of a row in mode ``MODE``: the row's token and logprob (stored by chunk 0) and,
    on random rows with ``COUNT``, the chunk's entries above the token added to ``rank_ptr``."""
    tok, m, lse = _combine(part_ptr, tok_ptr, n_chunks, NB)
    y_tok = tl.load(row_ptr + tok).to(tl.float32)
    if MODE == _PROCESSED:
        y_tok = tl.math.div_rn(y_tok, t)
    lp_tok = (y_tok - m) - lse  # the same expression (and rounding) as log_softmax
    if chunk == 0:
        tl.store(ids_ptr, tok)
        tl.store(lp_ptr, lp_tok)
    if MODE != _GREEDY and COUNT:
        lo, hi = _chunk_blocks(chunk, blocks_per_chunk, V, BLOCK)
        blk_ids = tl.arange(0, NB)
        blk_max = tl.load(part_ptr + 4 * n_chunks + blk_ids, mask=(blk_ids >= lo) & (blk_ids < hi),
                          other=float("-inf"))
        count = _count_above(row_ptr, t, m, lse, lp_tok, blk_max, lo, hi, V, MODE, BLOCK, NB)
        tl.atomic_add(rank_ptr, count, mask=count > 0, sem="relaxed")


@triton.jit(do_not_specialize=["width", "n_chunks", "blocks_per_chunk"])  # one compile for every batch size
def _finish_kernel(logits_ptr, stride, temp_ptr, greedy_ptr, processed_ptr, part_ptr, tok_ptr, ids_ptr, lp_ptr,
                   rank_ptr, width, n_chunks, blocks_per_chunk, V: tl.constexpr, BLOCK: tl.constexpr,
                   NB: tl.constexpr, COUNT: tl.constexpr):
    """Program (row, chunk) after ``_scan_kernel``; greedy rows, and every row without ``COUNT``, need only their
    chunk 0 (rank stays 1)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    t = tl.load(temp_ptr + row).to(tl.float32)
    part_ptr += row * width
    tok_ptr += row * width
    ids_ptr += row
    lp_ptr += row
    rank_ptr += row
    if tl.load(greedy_ptr + row):
        if chunk == 0:
            _finish_chunk(row_ptr, t, part_ptr, tok_ptr, ids_ptr, lp_ptr, rank_ptr, chunk, n_chunks,
                          blocks_per_chunk, V, _GREEDY, BLOCK, NB, False)
    elif tl.load(processed_ptr + row):
        if COUNT or chunk == 0:
            _finish_chunk(row_ptr, t, part_ptr, tok_ptr, ids_ptr, lp_ptr, rank_ptr, chunk, n_chunks,
                          blocks_per_chunk, V, _PROCESSED, BLOCK, NB, COUNT)
    elif COUNT or chunk == 0:
        _finish_chunk(row_ptr, t, part_ptr, tok_ptr, ids_ptr, lp_ptr, rank_ptr, chunk, n_chunks, blocks_per_chunk,
                      V, _RAW, BLOCK, NB, COUNT)


def _chunk_layout(batch: int, num_blocks: int, device: torch.device, num_chunks: int | None = None) -> tuple[int, int]:
    """-> (chunks S, blocks per chunk) for a [batch, num_blocks blocks] problem: 1 <= S <= num_blocks and no
    chunk is empty (the last may be shorter). S aims at ``_PROGRAMS_PER_SM`` programs per SM over the
    batch on CUDA, ``_INTERPRETER_CHUNKS`` elsewhere; ``num_chunks`` asks for a count instead (it is
    clamped, and lowered where equal chunks of whole blocks cannot make that many)."""
    if num_chunks is None:
        if device.type == "cuda":
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            num_chunks = triton.cdiv(_PROGRAMS_PER_SM * num_sms, batch)
        else:
            num_chunks = _INTERPRETER_CHUNKS
    per_chunk = triton.cdiv(num_blocks, max(1, min(num_chunks, num_blocks)))
    return triton.cdiv(num_blocks, per_chunk), per_chunk


def fused_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                 is_greedy: torch.Tensor, use_processed: torch.Tensor, *, count_ranks: bool = True,
                 block_size: int | None = None, num_chunks: int | None = None, num_warps: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (next_token_ids int64 [B], logprobs float32 [B], ranks int64 [B])

    ``Sampler.forward`` for a batch on the fast path (no penalties, top-k, top-p, min-p or top logprobs), in
    two kernel launches and without host syncs. ``logits`` [B, V] any float dtype (computed in float32, last
    dim contiguous); per-row [B] tensors on the same device: ``temperatures`` float32 (ignored on greedy
    rows), ``seeds`` int64 (seed mod 2**64 as two's complement), ``positions`` int64 (output_len),
    ``is_greedy`` bool, ``use_processed`` bool (logprobs_mode == "processed").

    Greedy rows: token = argmax(logits), lowest index on ties; logprob in the raw distribution; rank 1.
    Random rows: token = argmax(logits / T - log(-log(U))) with U = ``uniform_noise(seeds, positions, V)``;
    logprob and rank in the raw distribution log_softmax(logits), or in log_softmax(logits / T) when
    ``use_processed``; rank = 1 + number of entries strictly above the token's (1 without ``count_ranks``,
    which saves the second read of the logits above the token). ``block_size`` (a power of
    two) overrides the tile each program loops over, and ``num_chunks`` the number of programs each row is
    split over (see ``_chunk_layout``), and ``num_warps`` the warps of each program, for tests and tuning;
    tokens and ranks do not depend on any of them.
    """
    B, V = logits.shape
    device = logits.device
    ids = torch.empty(B, dtype=torch.int64, device=device)
    logprobs = torch.empty(B, dtype=torch.float32, device=device)
    ranks = torch.empty(B, dtype=torch.int64, device=device)
    if B == 0:
        return ids, logprobs, ranks
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = block_size or min(_BLOCK, triton.next_power_of_2(V))
    num_blocks = triton.cdiv(V, block)
    chunks, per_chunk = _chunk_layout(B, num_blocks, device, num_chunks)
    # per row, S = chunks: [m (S) | sum-exp (S) | race or argmax best (S) | its token (S, int32 bits) |
    # block maxima (num_blocks)], float32
    width = 4 * chunks + num_blocks
    scratch = torch.empty(B, width, dtype=torch.float32, device=device)
    rows = (logits, logits.stride(0), temperatures.contiguous())
    flags = (is_greedy.contiguous(), use_processed.contiguous())
    layout = dict(width=width, n_chunks=chunks, blocks_per_chunk=per_chunk, V=V, BLOCK=block,
                  NB=triton.next_power_of_2(num_blocks), num_warps=num_warps or (8 if block >= 2048 else 4))
    _scan_kernel[(B, chunks)](*rows, seeds.contiguous(), positions.contiguous(), *flags, scratch,
                              scratch.view(torch.int32), ranks, **layout)
    _finish_kernel[(B, chunks if count_ranks else 1)](*rows, *flags, scratch, scratch.view(torch.int32), ids, logprobs,
                                                      ranks, COUNT=count_ranks, **layout)
    return ids, logprobs, ranks


# ------------------------------------------------------------------------------------------ test helpers


@triton.jit
def _noise_kernel(seed_ptr, pos_ptr, u_ptr, e_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key, key2 = _row_keys(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
    u = _uniform(offs, key, key2)
    tl.store(u_ptr + row * V + offs, u, mask=offs < V)
    tl.store(e_ptr + row * V + offs, -_log(u), mask=offs < V)


def _noise_for_test(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                    block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, E) [B, V] float32 as the kernel computes them: U = uniform_noise(...) and E = -log(U)."""
    B = seeds.shape[0]
    u = torch.empty(B, vocab_size, dtype=torch.float32, device=seeds.device)
    e = torch.empty_like(u)
    _noise_kernel[(B, triton.cdiv(vocab_size, block))](seeds, positions, u, e, vocab_size, BLOCK=block)
    return u, e


@triton.jit
def _log_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _log(tl.load(x_ptr + offs, mask=offs < n, other=1.0)), mask=offs < n)


def _log_for_test(x: torch.Tensor, block: int = 8192) -> torch.Tensor:
    """The kernel's float32 natural log of a positive 1-D float32 tensor."""
    out = torch.empty_like(x)
    _log_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block)
    return out
