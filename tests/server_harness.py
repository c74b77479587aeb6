"""The test harness for the HTTP server: the real server as a subprocess (``ServerProcess``), started and stopped
around a block (``running_server``, ``server_client``), and its Prometheus metrics parsed (``metrics``)."""

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

from rollout.ipc import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "test-key"  # the key of the module-wide ``server`` fixture (conftest.py)


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
