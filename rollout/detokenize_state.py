"""Incremental detokenization: turn a stream of token ids into text deltas that are safe to show.

Pure Python, one object per request; the detokenizer process feeds it the ids the scheduler produced.
Each step decodes only a small window of ids (the surrogate/read-offset technique of vLLM's and SGLang's
``detokenize_incrementally``), so a step costs O(1) in the length of the sequence, and the window's
shared start keeps the leading-space rules of SentencePiece and byte-level BPE decoders right.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens that seed the decode window (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
SEED_PROMPT_TOKENS = 5
# How far back a seed may widen to start at a whole character: the prompt ids the scheduler sends (DecodeSpec)
SEED_LOOKBACK_TOKENS = 5 * SEED_PROMPT_TOKENS
# A held window longer than this is tested on its last this-many ids only (``_still_held``)
HELD_CHECK_TOKENS = 8


@dataclass
class DecodeStatus:
    """Per-request decode state.

    ``decode_ids`` holds ``num_seed`` prompt ids (the seed of the window) followed by the output ids.
    Each step decodes ``decode_ids[surr_offset:]`` and ``decode_ids[surr_offset:read_offset]``; the
    difference is the text of the ids after ``read_offset``. ``decoded_text`` is the output text decoded so
    far, complete characters only, before any stop-string cut; ``sent_offset`` is how many of its
    characters ``step`` has returned. ``stop_limit`` is the index in ``decoded_text`` at which the earliest
    complete stop string begins (or ends, with ``include_stop_str_in_output``); nothing at or past it
    is sent while unfinished. ``stop_from`` is the length of the text of the first ``min_new_tokens``
    output ids (None until there are that many): a stop string counts only if it ends past it.
    ``stop_scanned`` is how much of ``decoded_text`` has been searched for stop strings.
    """

    decode_ids: list[int] = field(default_factory=list)
    num_seed: int = 0
    surr_offset: int = 0
    read_offset: int = 0
    decoded_text: str = ""
    sent_offset: int = 0
    stop_limit: int | None = None
    stop_from: int | None = 0
    stop_scanned: int = 0
    finished: bool = False

    @property
    def output_ids(self) -> list[int]:
        return self.decode_ids[self.num_seed:]


class IncrementalDetokenizer:
    """Turns one request's output ids into text deltas.

    Contract:
    - With no stop string involved, the deltas returned by ``step`` concatenate to
      ``tokenizer.decode(output_ids, skip_special_tokens=..., spaces_between_special_tokens=...)``
      (decoded without ``clean_up_tokenization_spaces``, which no incremental decoder can honour). With
      ``prompt_token_ids`` the first output token is decoded after the prompt's last tokens, so the text
      is what the output adds to the decoded prompt (a SentencePiece leading space is kept).
    - A delta never ends inside a character: text whose decode ends in U+FFFD, or whose last token is a
      ``<0xNN>`` byte-fallback token (a later byte could still change how the group decodes), is held
      back until it settles; ``finished=True`` flushes whatever remains.
    - Stop strings count only where they end after the text of the first ``min_new_tokens`` output ids
      (vLLM's ``min_tokens``). While unfinished, no text at or after the first such stop string is sent
      (the stop string itself is sent with ``include_stop_str_in_output``), and unless
      ``include_stop_str_in_output`` a suffix that is a prefix of a stop string is held back. On
      ``finished=True`` with a string ``matched_stop`` the final text is cut right before (or right after,
      with ``include_stop_str_in_output``) the first such occurrence of it; if there is none, nothing is
      cut. ``matched_stop`` should be one of ``stop``; the concatenated deltas always equal ``text``, which
      is never shortened.
    - A stop token: on ``finished=True`` with an int ``matched_stop`` equal to the last output id (a stop
      token id or EOS), that token's text is left out unless ``include_stop_str_in_output`` (vLLM's
      detokenizer does the same); ``output_ids`` still holds it.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool,
                 stop: Sequence[str], include_stop_str_in_output: bool,
                 prompt_token_ids: Sequence[int] | None = None, min_new_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.min_new_tokens = min_new_tokens
        self._special_ids: frozenset[int] | None = None
        seed = self._seed_ids(prompt_token_ids)
        self.status = DecodeStatus(decode_ids=list(seed), num_seed=len(seed), read_offset=len(seed),
                                   stop_from=0 if min_new_tokens <= 0 else None)

    @property
    def text(self) -> str:
        """All text returned by ``step`` so far."""
        return self.status.decoded_text[:self.status.sent_offset]

    @property
    def output_ids(self) -> list[int]:
        return self.status.output_ids

    def step(self, new_token_ids: Sequence[int], finished: bool, matched_stop: str | int | None = None) -> str:
        """Append new tokens; return the text delta that is now safe to show.

        Raises RuntimeError when called again after a step with ``finished=True``.
        """
        st = self.status
        if st.finished:
            raise RuntimeError("step() called after the request finished")
        ids = [int(t) for t in new_token_ids]
        dropped = ids[-1:] if finished and self._drops_stop_token(ids, matched_stop) else []
        st.decode_ids.extend(ids[:len(ids) - len(dropped)])
        if st.stop_from is None and len(st.output_ids) + len(dropped) >= self.min_new_tokens:
            st.stop_from = self._text_len(self.min_new_tokens)
        st.decoded_text += self._decode_window(flush=finished)
        st.decode_ids.extend(dropped)  # kept in output_ids, not decoded
        self._scan_stops()
        end = self._final_end(matched_stop) if finished else self._safe_end()
        st.finished = finished
        return self._send_until(end)

    def _drops_stop_token(self, ids: list[int], matched_stop: str | int | None) -> bool:
        """Whether the last of ``ids`` is the stop token that ended the request, its text left out."""
        return (isinstance(matched_stop, int) and not isinstance(matched_stop, bool) and bool(ids)
                and ids[-1] == matched_stop and not self.include_stop_str_in_output)

    def _text_len(self, n: int) -> int:
        """Characters that the first ``n`` output ids add to the text (complete characters only)."""
        st = self.status
        ids = st.decode_ids[:st.num_seed + n]
        base = self._decode(ids[:st.num_seed]) if st.num_seed else ""
        return max(0, len(self._decode(ids).rstrip(REPLACEMENT_CHAR)) - len(base))

    # -- window decoding -------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _seed_ids(self, prompt_token_ids: Sequence[int] | None) -> list[int]:
        return prompt_seed_ids(self._decode, prompt_token_ids)

    def _decode_window(self, flush: bool) -> str:
        """Text of the ids after ``read_offset`` if it has settled (or ``flush``), advancing the window."""
        st = self.status
        ids = st.decode_ids
        if st.read_offset >= len(ids):
            return ""
        if not flush and self._still_held(ids, st.read_offset):
            return ""
        prefix_text = self._decode(ids[st.surr_offset:st.read_offset])
        new_text = self._decode(ids[st.surr_offset:])
        if len(new_text) <= len(prefix_text):
            return ""
        if not flush and new_text.endswith(REPLACEMENT_CHAR):
            return ""
        st.surr_offset, st.read_offset = st.read_offset, len(ids)
        return new_text[len(prefix_text):]

    def _still_held(self, ids: list[int], start: int) -> bool:
        """Whether the ids after ``start`` must stay held, told without decoding all of them: the last kept id is
        a ``<0xNN>`` byte token, or more than ``HELD_CHECK_TOKENS`` are held and the decode of the last that many
        still ends in U+FFFD. Without the second test a run that never settles (invalid bytes: a degenerate
        rollout) was decoded whole at every step, quadratic in its length, while the one detokenizer process
        served every request. Holding only delays text (a later step or the flush decodes the whole window), so
        a tail that ends in U+FFFD where the whole window would not (its first bytes cut) only waits longer."""
        if self._ends_in_byte_token(ids, start):
            return True
        return (len(ids) - start > HELD_CHECK_TOKENS
                and self._decode(ids[-HELD_CHECK_TOKENS:]).endswith(REPLACEMENT_CHAR))

    def _ends_in_byte_token(self, ids: list[int], start: int) -> bool:
        """Whether the last id from ``start`` on that the decode keeps is a ``<0xNN>`` byte-fallback token."""
        for token_id in reversed(ids[start:]):
            if self.skip_special_tokens and token_id in self._skipped_ids():
                continue
            return _is_byte_token(self.tokenizer.convert_ids_to_tokens(token_id))
        return False

    def _skipped_ids(self) -> frozenset[int]:
        """Ids that ``decode(skip_special_tokens=True)`` drops; computed once, on first need."""
        if self._special_ids is None:
            self._special_ids = skipped_special_ids(self.tokenizer)
        return self._special_ids

    # -- stop strings ----------------------------------------------------------------------------

    def _scan_stops(self) -> None:
        """Lower ``stop_limit`` for stop strings that end past both ``stop_scanned`` and ``stop_from``."""
        st = self.status
        if st.stop_from is None:
            return  # the output is still within min_new_tokens: no stop string counts yet
        lo = max(st.stop_scanned, st.stop_from)
        for s in self.stop:
            idx = st.decoded_text.find(s, max(0, lo - len(s) + 1))
            if idx < 0:
                continue
            limit = idx + len(s) if self.include_stop_str_in_output else idx
            st.stop_limit = limit if st.stop_limit is None else min(st.stop_limit, limit)
        st.stop_scanned = len(st.decoded_text)

    def _safe_end(self) -> int:
        """How far into ``decoded_text`` an unfinished request may send."""
        st = self.status
        end = len(st.decoded_text)
        if st.stop_limit is not None:
            end = min(end, st.stop_limit)
        if self.stop and not self.include_stop_str_in_output:
            end = min(end, _partial_stop_start(st.decoded_text, self.stop, self._max_stop_len))
        return end

    def _final_end(self, matched_stop: str | int | None) -> int:
        """Where the final text ends: at the first occurrence of a string ``matched_stop`` that ends past
        ``stop_from``, else the whole text."""
        text = self.status.decoded_text
        if not isinstance(matched_stop, str) or not matched_stop:
            return len(text)
        idx = text.find(matched_stop, max(0, (self.status.stop_from or 0) - len(matched_stop) + 1))
        if idx < 0:
            return len(text)
        return idx + len(matched_stop) if self.include_stop_str_in_output else idx

    def _send_until(self, end: int) -> str:
        st = self.status
        if end <= st.sent_offset:
            return ""
        delta = st.decoded_text[st.sent_offset:end]
        st.sent_offset = end
        return delta


def _is_byte_token(token: str | None) -> bool:
    """SentencePiece byte-fallback tokens are spelled ``<0xNN>``."""
    if not isinstance(token, str) or len(token) != 6 or not token.startswith("<0x") or not token.endswith(">"):
        return False
    try:
        int(token[3:5], 16)
    except ValueError:
        return False
    return True


def _partial_stop_start(text: str, stop: Sequence[str], max_stop_len: int) -> int:
    """Start of the longest suffix of ``text`` that is a proper prefix of a stop string (``len(text)``
    when there is none)."""
    for k in range(min(len(text), max_stop_len - 1), 0, -1):
        tail = text[-k:]
        if any(len(s) > k and s.startswith(tail) for s in stop):
            return len(text) - k
    return len(text)


def skipped_special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids that ``tokenizer.decode(..., skip_special_tokens=True)`` drops: its special ids and the added
    tokens marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
    return frozenset(ids)


def prompt_seed_ids(decode: Callable[[list[int]], str], prompt_token_ids: Sequence[int] | None) -> list[int]:
    """The prompt's last few ids that the output's text is decoded after (so it reads as it does after the
    prompt: a SentencePiece first token keeps its leading space), widened so the window does not start inside
    a character (byte tokens); none when the prompt ends inside a character or no clean start is found nearby."""
    if not prompt_token_ids:
        return []
    ids = [int(t) for t in prompt_token_ids]
    lowest = max(0, len(ids) - SEED_LOOKBACK_TOKENS)
    if decode(ids[lowest:]).endswith(REPLACEMENT_CHAR):
        return []  # the prompt ends inside a character
    start = max(0, len(ids) - SEED_PROMPT_TOKENS)
    while REPLACEMENT_CHAR in decode(ids[start:]):  # a run of byte tokens cut at its start
        if start == lowest:
            return []
        start -= 1
    return ids[start:]
