"""CI: with only the ``server`` extra installed, ``rollout.launch_server`` serves the default model on CPU.

Starts the server on a free port, waits for /health, asks /generate and /v1/completions, stops it with
SIGTERM; exits non-zero (printing the server's log) if any step fails.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def main() -> int:
    from rollout.default_model import ensure_default_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile()
    server = subprocess.Popen([sys.executable, "-m", "rollout.launch_server", "--model-path", ensure_default_model(),
                               "--device", "cpu", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except (urllib.error.URLError, OSError):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not become ready (exit code {server.poll()})")
                time.sleep(0.5)
        out = _post(url + "/generate", {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8,
                                                                                             "temperature": 0}})
        cmpl = _post(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "echo": True, "logprobs": 1})
        print(f"server extra OK: /generate -> {out['text']!r}; /v1/completions echo -> "
              f"{cmpl['choices'][0]['text']!r}")
        return 0
    except Exception as e:  # noqa: BLE001 - reported with the server's log
        log.seek(0)
        print(f"server extra check FAILED: {type(e).__name__}: {e}\n{log.read().decode(errors='replace')[-5000:]}")
        return 1
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


if __name__ == "__main__":
    sys.exit(main())
