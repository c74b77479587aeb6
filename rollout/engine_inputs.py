"""Turning ``Engine.generate``'s arguments into one validated (prompt, token ids, SamplingParams, request id)
per prompt, the way vLLM's ``LLM.generate`` takes them: strings, token-id lists, ``{"prompt",
"prompt_token_ids"}`` dicts or chat message lists; one SamplingParams (or dict) for all or one per prompt."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from rollout.sampling_params import SamplingParams

PromptItem = tuple[Any, Any, SamplingParams, Any]  # (text | None, token ids | None, params, request id | None)
# apply_chat_template's own arguments: chat_template_kwargs may not set them (they have options of their own)
_TEMPLATE_ARGUMENTS = frozenset({"chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
                                 "conversation", "return_dict", "return_tensors", "tools"})


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a conversation becomes a prompt: vLLM's ``LLM.chat`` / chat-completions options. The template's own
    variables (Qwen3's ``enable_thinking``, ...) go in ``chat_template_kwargs``; ``tools`` (JSON schemas, as
    vLLM's ``LLM.chat`` takes them) reach the template as its ``tools`` variable."""

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]],
                    options: ChatTemplateOptions = ChatTemplateOptions()) -> list[int]:
    """The token ids of ``messages`` under the chat template (``chat_prompt``'s ids)."""
    return chat_prompt(tokenizer, messages, options)[1]


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                options: ChatTemplateOptions = ChatTemplateOptions()) -> tuple[str, list[int]]:
    """The text of ``messages`` under the chat template and its token ids (the text tokenized without added
    special tokens, as ``apply_chat_template(tokenize=True)`` does); ValueError naming the problem. A message
    whose content is a list of OpenAI text parts (``{"type": "text", "text"}``) reaches the template as their
    texts joined by newlines (vLLM's rendering for templates that take string content); other parts are refused."""
    if tokenizer is None or not (options.chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model's tokenizer has no chat template (pass chat_template)")
    if options.add_generation_prompt and options.continue_final_message:  # vLLM's check and message
        raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    taken = sorted(set(options.chat_template_kwargs) & _TEMPLATE_ARGUMENTS)
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {taken}: pass them as options of their own")
    bad = next((m for m in messages if not isinstance(m, dict)), None)
    if bad is not None:
        raise ValueError(f"a chat message must be a {{'role', 'content'}} dict, got {type(bad).__name__}")
    messages = [_with_text_content(m) for m in messages]
    for m in messages:
        for value in m.values():
            if isinstance(value, str):
                check_unicode(value, "a chat message")
    text = _render_template(tokenizer, messages, options)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render_template(tokenizer: Any, messages: list[Any], options: ChatTemplateOptions) -> str:
    """The template's text for ``messages``; ValueError when the template fails on them: jinja's TemplateError
    (a syntax error in a given ``chat_template``, an undefined variable, the template's own
    ``raise_exception``, e.g. "Conversation roles must alternate user/assistant/...") or a TypeError of its
    expressions. Those are the request's fault (vLLM answers them with a 400); they reached the server as a 500."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, chat_template=options.chat_template, tokenize=False,
                                             add_generation_prompt=options.add_generation_prompt,
                                             continue_final_message=options.continue_final_message,
                                             tools=options.tools, **options.chat_template_kwargs)
    except (TemplateError, TypeError) as e:
        raise ValueError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None


def conversations(messages: Any) -> list[list[Any]]:
    """``LLM.chat``'s ``messages`` as a list of conversations: one conversation (a list of message dicts) or a
    list of them; ValueError for anything else (a string, a conversation that is not a list)."""
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
        messages = [messages]
    if not isinstance(messages, (list, tuple)) or not all(isinstance(c, (list, tuple)) for c in messages):
        raise ValueError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of them, "
                         f"got {type(messages).__name__}")
    return [list(c) for c in messages]


def content_text(parts: list[Any]) -> str:
    """The text of a message's content parts: the texts of its ``{"type": "text", "text"}`` parts joined by
    newlines, as vLLM's ``parse_chat_messages`` renders them for a string-content template; ValueError for
    any other part (this engine takes text only)."""
    texts = []
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ValueError(f"unsupported message content part {part!r}: only {{'type': 'text', 'text': ...}}")
        texts.append(part["text"])
    return "\n".join(texts)


def _with_text_content(message: Any) -> Any:
    """``message`` with a list ``content`` of text parts replaced by its text (``content_text``)."""
    if isinstance(message, dict) and isinstance(message.get("content"), list):
        return {**message, "content": content_text(message["content"])}
    return message


def abort_ids(ids: Any) -> list[str]:
    """One request id or several (vLLM's ``abort_request`` takes a string or an iterable of them) as a list;
    ValueError for anything else."""
    out = [ids] if isinstance(ids, str) else list(ids) if isinstance(ids, (list, tuple, set, frozenset)) else None
    if out is None or not all(isinstance(rid, str) for rid in out):
        raise ValueError(f"request ids must be a string or a list of strings, got {ids!r}")
    return out


def check_sleep_level(level: Any) -> None:
    """``sleep``'s ``level`` on every surface: 1 or 2, else a ValueError (over HTTP ``int(level)`` made 1.5 and
    "2" a sleep of level 1 and 2)."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")


def check_wake_tags(tags: list[str] | None) -> None:
    """``wake_up``'s ``tags`` on every surface: None wakes everything released; an empty list names nothing to
    wake and is a ValueError (docs/colocation.md; over HTTP it would be an empty query, which wakes everything)."""
    if tags is not None and not tags:
        raise ValueError("tags must be a non-empty list (None wakes everything that is released)")


def check_unicode(text: str, what: str) -> None:
    """ValueError if ``text`` holds a lone UTF-16 surrogate (valid JSON can carry one; no tokenizer takes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate {text[e.start]!r} "
                         f"at index {e.start}") from None


def normalize(prompts: Any, prompt_token_ids: Any, sampling_params: Any, request_id: Any,
              render_chat: Callable[[list[dict[str, Any]]], tuple[str, list[int]]],
              defaults: Mapping[str, Any] | None = None) -> list[PromptItem]:
    """One (text, token ids, params, request id) per prompt; ValueError naming the problem. A conversation
    (a list of message dicts) is rendered by ``render_chat`` into its text and token ids (``chat_prompt``).
    Sampling params of None (all, or one prompt's) are ``defaults`` (the model's, ``Engine.sampling_defaults``)."""
    if prompt_token_ids is not None:
        if prompts is not None:
            raise ValueError("pass prompts or prompt_token_ids, not both")
        pairs = _token_id_prompts(prompt_token_ids)
    else:
        if prompts is None:
            raise ValueError("no prompts given")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a prompt dict, a list of token ids or a list of them, "
                             f"got {type(prompts).__name__}")
        pairs = [_prompt_pair(p, render_chat) for p in prompts]
    if not pairs:
        raise ValueError("no prompts given")
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != len(pairs):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(pairs)} prompts")
        params = [SamplingParams.from_any(defaults if p is None else p) for p in sampling_params]
    else:
        params = [SamplingParams.from_any(defaults if sampling_params is None else sampling_params)] * len(pairs)
    rids = request_ids(request_id, len(pairs))
    return [(text, ids, p, rid) for (text, ids), p, rid in zip(pairs, params, rids)]


def _token_id_prompts(prompt_token_ids: Any) -> list[tuple[None, list[int]]]:
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise ValueError(f"prompt_token_ids must be a list of token-id lists, got {type(prompt_token_ids).__name__}")
    if prompt_token_ids and not isinstance(prompt_token_ids[0], (list, tuple)):
        prompt_token_ids = [prompt_token_ids]
    if not all(isinstance(ids, (list, tuple)) for ids in prompt_token_ids):
        raise ValueError("prompt_token_ids must be one list of token ids or a list of them")
    return [(None, list(ids)) for ids in prompt_token_ids]


def _prompt_pair(prompt: Any, render_chat: Callable[[list[dict[str, Any]]], tuple[str, list[int]]]
                 ) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        return _dict_prompt_pair(prompt)
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        return render_chat(list(prompt))
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}")


def _dict_prompt_pair(prompt: dict[str, Any]) -> tuple[str | None, list[int] | None]:
    """vLLM's ``TokensPrompt`` (``prompt_token_ids``: a list of ids, with an optional ``prompt`` text) or
    ``TextPrompt`` (``prompt``: a string); ValueError naming a field of the wrong type."""
    text = prompt.get("prompt")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"a prompt dict's 'prompt_token_ids' must be a list of token ids, got {ids!r}")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"a prompt dict's 'prompt' must be a string, got {type(text).__name__}")
        return text, list(ids)
    if "prompt" in prompt:
        if not isinstance(text, str):
            raise ValueError(f"a prompt dict's 'prompt' must be a string, got {type(text).__name__}")
        return text, None
    raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")


def request_ids(request_id: Any, count: int) -> list[str | None]:
    """One request id (or None: a fresh one) per prompt from ``request_id``: None, a string for one prompt,
    or a list of distinct strings, one per prompt."""
    if request_id is None:
        return [None] * count
    if isinstance(request_id, str):
        if count > 1:
            raise ValueError(f"request_id: one id for {count} prompts; pass a list of {count} ids")
        return [request_id]
    if not isinstance(request_id, (list, tuple)):
        raise ValueError(f"request_id must be a string or a list of strings, got {request_id!r}")
    if len(request_id) != count:
        raise ValueError(f"request_id: got {len(request_id)} ids for {count} prompts")
    if not all(isinstance(r, str) and r for r in request_id) or len(set(request_id)) != count:
        raise ValueError(f"request_id must be distinct, non-empty strings, got {list(request_id)!r}")
    return list(request_id)
