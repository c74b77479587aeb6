"""A small client for the rollout HTTP server, usable as an engine handle by ``weight_sync.WeightSender``.

``EngineClient(url, api_key=None)`` has the Engine's update and control methods with the same names and
signatures; those that take ``async_op`` return a ``concurrent.futures.Future`` with ``async_op=True``.
Such calls (the ones that take part in a collective) go out one at a time, in call order, from one
worker thread: the order of update announcements must match the order of the trainer's broadcasts,
and each call returns only after its broadcast, so no call waits on a later one. Other calls go out
directly. Errors: HTTP 400 raises ValueError (as the Engine does for a bad call), 401/403
PermissionError, anything else RuntimeError; each carries the server's message.

Only the standard library is used, so a trainer needs nothing beyond this package.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Sequence

from rollout.dtypes import dtype_name
from rollout.engine_inputs import abort_ids, check_sleep_level, check_wake_tags

DEFAULT_TIMEOUT_S = 3600.0


class EngineClient:
    """An engine handle for a server at ``base_url`` (e.g. ``http://127.0.0.1:30000``)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = DEFAULT_TIMEOUT_S) -> None:
        parts = urllib.parse.urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme in {base_url!r}")
        self.base_url = f"{parts.scheme}://{parts.netloc}"
        self._https = parts.scheme == "https"
        self._netloc = parts.netloc
        self.api_key = api_key
        self.timeout = timeout
        self._ordered = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-client")

    # ---- weight sync (the Engine's signatures) -------------------------------------------------------

    def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str = "weight_update_group", backend: str = "nccl",
                           timeout: float | None = None, async_op: bool = False) -> Any:
        """Make the server's engine join a weight-update group (blocks until the trainer joins too)."""
        body = {"master_address": master_address, "master_port": int(master_port), "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend, "timeout": timeout}
        return self._in_order("/init_weights_update_group", body, async_op, _success)

    def destroy_process_group(self, group_name: str = "weight_update_group", async_op: bool = False) -> Any:
        return self._in_order("/destroy_weights_update_group", {"group_name": group_name}, async_op, _success)

    init_weights_update_group = init_process_group        # SGLang's names, as the endpoints
    destroy_weights_update_group = destroy_process_group

    def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False,
                      async_op: bool = False) -> Any:
        """OpenRLHF's per-tensor update (one broadcast); ``empty_cache=True`` completes the update."""
        body = {"names": [name], "dtypes": [dtype_name(dtype)], "shapes": [list(shape)], "group_name": None,
                "flush_cache": empty_cache}
        return self._in_order("/update_weights_from_distributed", body, async_op, _result)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[Any],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None, load_format: str | None = None,
                                        check_finite: bool = False, async_op: bool = False) -> Any:
        """SGLang's bucketed update: the server's engine receives ``names`` broadcast by trainer rank 0."""
        body = {"names": list(names), "dtypes": [dtype_name(d) for d in dtypes], "shapes": [list(s) for s in shapes],
                "group_name": group_name, "flush_cache": flush_cache, "weight_version": _version(weight_version),
                "load_format": load_format, "check_finite": check_finite}
        return self._in_order("/update_weights_from_distributed", body, async_op, _result)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 async_op: bool = False, *, load_format: str | None = None) -> Any:
        body = {"model_path": str(model_path), "weight_version": _version(weight_version), "load_format": load_format}
        return self._in_order("/update_weights_from_disk", body, async_op, _result)

    def rollback_weights(self) -> dict[str, Any]:
        return _result(self._post("/rollback_weights", {}))

    # ---- control ----------------------------------------------------------------------------------

    def flush_cache(self) -> bool:
        """True if flushed; False while running requests hold cache entries (the server's 400, as SGLang's)."""
        try:
            return bool(self._post("/flush_cache", None)["success"])
        except ValueError as e:
            if "HTTP 400" in str(e) and "not flushed" in str(e):
                return False
            raise

    reset_prefix_cache = flush_cache

    def pause_generation(self, mode: str = "abort") -> bool:
        return _success(self._post("/pause_generation", {"mode": mode}))

    def continue_generation(self) -> bool:
        return _success(self._post("/continue_generation", {}))

    resume_generation = continue_generation

    def get_weight_version(self) -> str:
        return self._call("GET", "/get_weight_version")["weight_version"]

    def update_weight_version(self, weight_version: str) -> str:
        return self._post("/update_weight_version", {"new_version": str(weight_version)})["new_version"]

    def get_weight_state(self) -> dict[str, Any]:
        return self._call("GET", "/get_weight_state")

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        return self._post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def weights_fingerprint(self) -> str:
        return self._call("GET", "/weights_fingerprint")["fingerprint"]

    def get_server_info(self) -> dict[str, Any]:
        return self._call("GET", "/get_server_info")

    def start_profile(self, output_dir: str | None = None, start_step: int | None = None,
                      num_steps: int | None = None, activities: list[str] | None = None, with_stack: bool = False,
                      record_shapes: bool = False, profile_id: str | None = None) -> dict[str, Any]:
        """``Engine.start_profile`` on the server (the traces are written on the server's machine)."""
        return _result(self._post("/start_profile", {
            "output_dir": output_dir, "start_step": start_step, "num_steps": num_steps, "activities": activities,
            "with_stack": with_stack, "record_shapes": record_shapes, "profile_id": profile_id}))

    def stop_profile(self) -> dict[str, Any]:
        return _result(self._post("/stop_profile", None))

    # ---- colocation -------------------------------------------------------------------------------

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        return _result(self._post("/release_memory_occupation", {"tags": tags}))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        return _result(self._post("/resume_memory_occupation", {"tags": tags}))

    def sleep(self, level: int = 1) -> dict[str, Any]:
        check_sleep_level(level)
        return _result(self._post(f"/sleep?level={int(level)}", None))

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """``Engine.wake_up`` over HTTP; an empty list is refused here (an empty query would wake everything)."""
        check_wake_tags(tags)
        query = urllib.parse.urlencode([("tags", t) for t in tags or []])
        return _result(self._post("/wake_up" + (f"?{query}" if query else ""), None))

    def is_sleeping(self) -> bool:
        return bool(self._call("GET", "/is_sleeping")["is_sleeping"])

    def abort(self, request_id: str | Iterable[str]) -> bool:
        """``Engine.abort``: one id or a list; True when any of them was live."""
        return any([bool(self._post("/abort_request", {"rid": rid})["success"]) for rid in abort_ids(request_id)])

    # ---- serving ----------------------------------------------------------------------------------

    def health(self) -> bool:
        """True when the server's engine is ready."""
        try:
            self._call("GET", "/health", timeout=10)
            return True
        except (OSError, RuntimeError):
            return False

    def wait_until_ready(self, timeout: float = 300.0, poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.base_url} not ready after {timeout} s")
            time.sleep(poll_s)

    def generate(self, text: str | list[str] | None = None, input_ids: Sequence[Any] | None = None,
                 sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None, **fields: Any) -> Any:
        """``POST /generate`` (SGLang's fields, e.g. ``return_logprob=True``); returns the JSON answer."""
        return self._post("/generate", _generate_body(text, input_ids, sampling_params, fields))

    def generate_stream(self, text: str | list[str] | None = None, input_ids: Sequence[Any] | None = None,
                        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                        **fields: Any) -> Iterator[dict[str, Any]]:
        """``POST /generate`` with ``stream=True``: yields each event's JSON (cumulative per sample)."""
        body = _generate_body(text, input_ids, sampling_params, {**fields, "stream": True})
        conn, resp = self._open("POST", "/generate", body)
        try:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise _error(400 if event["error"].get("code") == 400 else 500, event, "/generate")
                yield event
        finally:
            conn.close()

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self._post("/tokenize", {"prompt": prompt, "add_special_tokens": add_special_tokens})["tokens"]

    def detokenize(self, tokens: list[int]) -> str:
        return self._post("/detokenize", {"tokens": list(tokens)})["text"]

    # ---- plumbing ---------------------------------------------------------------------------------

    def close(self) -> None:
        self._ordered.shutdown(wait=False)

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _in_order(self, path: str, body: dict[str, Any], async_op: bool, convert: Callable[[Any], Any]) -> Any:
        fut: Future = self._ordered.submit(lambda: convert(self._post(path, body)))
        return fut if async_op else fut.result()

    def _post(self, path: str, body: Any) -> Any:
        return self._call("POST", path, body)

    def _call(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        conn, resp = self._open(method, path, body, timeout)
        try:
            data = resp.read()
        finally:
            conn.close()
        return json.loads(data) if data else None

    def _open(self, method: str, path: str, body: Any, timeout: float | None = None
              ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request; returns the open response, or raises the server's error."""
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._netloc, timeout=timeout if timeout is not None else self.timeout)
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
            resp = conn.getresponse()
            if resp.status >= 400:
                data = resp.read()
                raise _error(resp.status, _json_or_text(data), path)
        except BaseException:
            conn.close()
            raise
        return conn, resp


def _generate_body(text: Any, input_ids: Any, sampling_params: Any, fields: dict[str, Any]) -> dict[str, Any]:
    body = {"sampling_params": sampling_params, **fields}
    if text is not None:
        body["text"] = text
    if input_ids is not None:
        body["input_ids"] = [list(x) for x in input_ids] if input_ids and not isinstance(input_ids[0], int) \
            else list(input_ids)
    return body


def _version(weight_version: Any) -> str | None:
    """A weight version as the Engine names it (``str``, e.g. a trainer's step number), None for none."""
    return None if weight_version is None else str(weight_version)


def _success(answer: dict[str, Any]) -> bool:
    return bool(answer.get("success", False))


def _result(answer: dict[str, Any]) -> dict[str, Any]:
    """The engine's result of an update call (the answer less SGLang's success/message fields)."""
    return {k: v for k, v in answer.items() if k not in ("success", "message")}


def _json_or_text(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")


def _error(status: int, answer: Any, path: str) -> Exception:
    if isinstance(answer, dict):
        err = answer.get("error")
        message = err.get("message") if isinstance(err, dict) else answer.get("message", answer)
    else:
        message = answer
    text = f"{path}: HTTP {status}: {message}"
    if status in (401, 403):
        return PermissionError(text)
    return ValueError(text) if 400 <= status < 500 else RuntimeError(text)
