"""No engine subprocess survives its parent by more than a few seconds, whenever the parent dies: at any
point of start-up (before, during and after the children's imports) or while it is generating."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import psutil
import pytest

GRACE_S = 5.0

_PARENT = textwrap.dedent("""
    import sys
    from rollout import Engine
    engine = Engine(sys.argv[1], device="cpu", tp_size=int(sys.argv[3]))
    print("ready", flush=True)
    if sys.argv[2] == "busy":
        engine.generate(prompt_token_ids=[[5, 6, 7]] * 8, use_tqdm=False,
                        sampling_params={"max_tokens": 400, "ignore_eos": True})
    import time
    time.sleep(600)
""")


def _tagged(tag: str) -> list[psutil.Process]:
    """Live processes (not zombies) whose environment carries ``tag``: the parent's descendants."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("ROLLOUT_FAULT_TAG") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _is_python(proc: psutil.Process) -> bool:
    try:
        return proc.name().startswith("python")
    except psutil.Error:
        return False


def _run_and_kill(path: str, mode: str, delay_s: float | None, tp_size: int) -> tuple[int, float]:
    """Start a parent holding an engine, SIGKILL it ``delay_s`` after its first child appeared (or once it is
    ready / busy); returns how many descendants it had and how long the last one outlived it."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "ROLLOUT_FAULT_TAG": tag}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, path, mode, str(tp_size)], env=env, stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True)
    try:
        if delay_s is not None:
            deadline = time.monotonic() + 120
            while not [p for p in _tagged(tag) if p.pid != parent.pid and _is_python(p)]:  # not, e.g., ldconfig
                assert time.monotonic() < deadline and parent.poll() is None, "the parent started no child"
                time.sleep(0.02)
            time.sleep(delay_s)
        else:
            assert parent.stdout.readline().strip() == "ready"
            time.sleep(1.0)  # busy: generating
        children = [p for p in _tagged(tag) if p.pid != parent.pid and _is_python(p)]
        assert parent.poll() is None, "the parent exited by itself"
        parent.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        parent.wait(10)
        while _tagged(tag) and time.monotonic() - killed < 30:
            time.sleep(0.1)
        survived = time.monotonic() - killed
        assert not _tagged(tag), f"engine subprocesses still alive 30 s after the parent died: {_tagged(tag)}"
        return len(children), survived
    finally:
        for p in _tagged(tag):
            p.kill()


@pytest.mark.parametrize("delay_s", [0.0, 0.5, 1.5, 3.0])
def test_parent_killed_during_start_up(delay_s):
    """Killed as its first child starts, during the children's imports, and while they load the default model
    (SmolLM2-135M: a real load takes seconds, as in the reported fault)."""
    from rollout.default_model import ensure_default_model

    count, survived = _run_and_kill(ensure_default_model(), "idle", delay_s, tp_size=1)
    assert count >= 1
    assert survived < GRACE_S, f"{count} children outlived the parent by {survived:.1f} s"


@pytest.mark.parametrize("mode", ["idle", "busy"])
def test_parent_killed_when_ready_or_busy(tiny_dir, mode):
    count, survived = _run_and_kill(tiny_dir("llama"), mode, None, tp_size=2)
    assert count >= 3, "expected two schedulers and a detokenizer"
    assert survived < GRACE_S, f"{count} children outlived the parent by {survived:.1f} s"
