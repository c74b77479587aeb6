"""The HTTP server's launcher: flags, the loopback/API-key rule, start-up failure; and the test harness
(``ServerProcess``) the other server tests use to run the real server as a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Any, Iterator

import psutil
import pytest

from rollout.ipc import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




class ServerProcess:
    """``python -m rollout.launch_server`` on 127.0.0.1 and a free port, output in a temporary log file.

    ``statuses`` records what ``/health`` answered while starting (None = connection refused)."""

    def __init__(self, model_path: str, *flags: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.statuses: list[int | None] = []
        self._log = tempfile.NamedTemporaryFile("w+b", prefix="rollout-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "rollout.launch_server", "--model-path", model_path, "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--device", "cpu", *flags]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def health(self) -> int | None:
        req = urllib.request.Request(self.url + "/health", headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def wait_ready(self, timeout: float = 300.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.health()
            self.statuses.append(status)
            if status == 200:
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.1)
        raise AssertionError(f"the server was not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        with open(self._log.name, "rb") as f:
            return f.read().decode("utf-8", "replace")[-6000:]

    def stop(self, timeout: float = 30.0) -> bool:
        """SIGTERM, as a process manager would; True if the server shut down cleanly: uvicorn finished its
        graceful shutdown (which stops the engine) and no engine subprocess outlived it. SIGKILL after
        ``timeout``."""
        children = []
        if self.proc.poll() is None:
            children = psutil.Process(self.proc.pid).children(recursive=True)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        _, alive = psutil.wait_procs(children, timeout=15)
        log = self.log()
        self._log.close()
        os.unlink(self._log.name)
        clean = self.proc.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in log
        if not clean or alive:
            print(f"server exit {self.proc.returncode}, children alive: {alive}\n{log}")
        return clean and not alive


@contextmanager
def running_server(model_path: str, *flags: str, api_key: str | None = None) -> Iterator[ServerProcess]:
    """A real server (``ServerProcess``) on ``model_path``, ready; it must shut down cleanly at the end."""
    srv = ServerProcess(model_path, *flags, api_key=api_key)
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop(), "the server did not shut down cleanly (or left engine processes behind)"


@contextmanager
def server_client(model_path: str, *flags: str) -> Iterator[Any]:
    """An httpx client of ``running_server(model_path, *flags)`` (no API key)."""
    import httpx

    with running_server(model_path, *flags) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client


def metrics(http: Any) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client's parser: {name{labels}: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# ---- the launcher ---------------------------------------------------------------------------------


def test_flags_have_sglang_names_and_map_to_engine_options():
    from rollout.server.server_args import ServerArgs

    args = ServerArgs.from_cli(["--model-path", "/m", "--tp-size", "2", "--dtype", "bfloat16",
                                "--mem-fraction-static", "0.7", "--context-length", "256",
                                "--max-running-requests", "64", "--random-seed", "3", "--device", "cpu",
                                "--weight-version", "v0", "--disable-radix-cache",
                                "--decode-attention-backend", "flashinfer", "--quantization", "fp8",
                                "--cuda-graph-max-bs", "512", "--schedule-conservativeness", "0.3",
                                "--disable-cascade-attn", "--decode-balance-ratio", "8",
                                "--enable-piecewise-cuda-graph", "--piecewise-cuda-graph-max-tokens", "4096"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 30000, None)
    kwargs = args.engine_kwargs()
    assert kwargs["model_path"] == "/m" and kwargs["tp_size"] == 2 and kwargs["dtype"] == "bfloat16"
    assert kwargs["mem_fraction_static"] == 0.7 and kwargs["context_length"] == 256
    assert kwargs["max_running_requests"] == 64 and kwargs["seed"] == 3 and kwargs["device"] == "cpu"
    assert kwargs["weight_version"] == "v0" and kwargs["disable_radix_cache"] is True
    assert kwargs["decode_attention_backend"] == "flashinfer" and kwargs["quantization"] == "fp8"
    assert kwargs["cuda_graph_max_bs"] == 512 and kwargs["schedule_conservativeness"] == 0.3
    assert kwargs["disable_cascade_attn"] is True and kwargs["decode_balance_ratio"] == 8.0
    assert kwargs["enable_piecewise_cuda_graph"] is True and kwargs["piecewise_cuda_graph_max_tokens"] == 4096
    from rollout.config import EngineConfig

    assert set(kwargs) - {"model_path", "tp_size", "dtype", "device"} <= EngineConfig.field_names()
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--model-path", "/m", "--dtype", "float64"])


def test_loopback_rule():
    from rollout.server.server_args import ServerArgs, is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.4.5", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "example.org"))
    assert ServerArgs("/m").control_refusal is None
    assert ServerArgs("/m", host="0.0.0.0", api_key="k").control_refusal is None
    assert "--api-key" in ServerArgs("/m", host="0.0.0.0").control_refusal


def test_control_endpoints_refuse_a_non_loopback_bind_without_a_key():
    """Checked in process (ASGI, no socket is opened): the app as built for ``--host 0.0.0.0``."""
    import asyncio

    import httpx

    from rollout.server.app import create_app
    from rollout.server.server_args import ServerArgs

    async def call(app, path, body=None, headers=None):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return await client.post(path, json=body, headers=headers) if body is not None \
                else await client.get(path, headers=headers)

    open_app = create_app(ServerArgs("/m", host="0.0.0.0"))  # the engine is never started here
    spec = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[4, 4]]}
    for path, body in [("/update_weights_from_distributed", spec), ("/init_weights_update_group",
                       {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2}),
                       ("/pause_generation", {}), ("/update_weights_from_disk", {"model_path": "/m"}),
                       ("/get_weight_version", None)]:
        r = asyncio.run(call(open_app, path, body))
        assert r.status_code == 403, (path, r.text)
        assert r.json()["success"] is False and "--api-key" in r.json()["message"]
    assert asyncio.run(call(open_app, "/health")).status_code == 503  # serving endpoints are not refused

    keyed = create_app(ServerArgs("/m", host="0.0.0.0", api_key="k"))
    assert asyncio.run(call(keyed, "/update_weights_from_distributed", spec)).status_code == 401
    r = asyncio.run(call(keyed, "/update_weights_from_distributed", spec, {"Authorization": "Bearer k"}))
    assert r.status_code == 503 and "starting" in r.json()["message"]  # allowed; the engine is just not up


def test_engine_start_failure_exits_nonzero_with_the_reason(tmp_path):
    server = ServerProcess(str(tmp_path / "no-such-model"))
    try:
        code = server.proc.wait(90)
        log = server.log()
    finally:
        server.stop()
    assert code == 1, log
    assert "the engine failed to start" in log and "config.json" in log


def test_help_lists_the_flags():
    out = subprocess.run([sys.executable, "-m", "rollout.launch_server", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--model-path", "--tp-size", "--host", "--port", "--api-key", "--dtype", "--mem-fraction-static",
                 "--context-length", "--max-running-requests", "--device"):
        assert flag in out.stdout
