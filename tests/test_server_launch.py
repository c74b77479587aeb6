"""The HTTP server's launcher: flags, the loopback/API-key rule, start-up failure (the real server through
``server_harness``)."""

from __future__ import annotations

import glob
import signal
import subprocess
import sys
import time

import pytest

from server_harness import ROOT, ServerProcess


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


def test_a_server_stopped_while_its_engine_loads_leaves_nothing_behind(path, tmp_path, monkeypatch):
    """SIGTERM while the engine's subprocesses start: the server exits cleanly, and neither they nor the engine's
    IPC directory outlive it. The start thread was left running and uvicorn's re-raised SIGTERM ended the process
    under it: the children died by their parent watch and ``rollout-ipc-*`` stayed in the temp directory."""
    import psutil

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the server's temp directory: where its IPC directory goes
    server = ServerProcess(path)
    deadline = time.monotonic() + 120
    while not psutil.Process(server.proc.pid).children():  # the engine's subprocesses are starting
        assert server.proc.poll() is None and time.monotonic() < deadline, server.log()
        time.sleep(0.02)
    children = psutil.Process(server.proc.pid).children(recursive=True)
    try:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
        log = server.log()
    finally:
        assert server.stop(), "the server did not shut down cleanly"
    assert "engine ready" not in log, "the engine was ready before the signal: nothing was checked"
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive
    assert not glob.glob(str(tmp_path / "rollout-ipc-*")), "the engine's IPC directory was left behind"


def test_help_lists_the_flags():
    out = subprocess.run([sys.executable, "-m", "rollout.launch_server", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--model-path", "--tp-size", "--host", "--port", "--api-key", "--dtype", "--mem-fraction-static",
                 "--context-length", "--max-running-requests", "--device"):
        assert flag in out.stdout
