"""Process lifecycle: readiness errors reach the caller, shutdown and parent death leave no children."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

from rollout import Engine, SamplingParams


def _gone(pids: list[int], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def test_shutdown_leaves_no_children(tiny_dir):
    engine = Engine(tiny_dir("llama"), device="cpu", tp_size=2)
    pids = [p.pid for p in engine._procs.procs]
    assert len(pids) == 3
    ipc_dir = engine._procs.paths.root
    assert engine.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=SamplingParams(max_new_tokens=3),
                           use_tqdm=False)[0].finished
    engine.shutdown()
    assert _gone(pids)
    assert not os.path.exists(ipc_dir)
    engine.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(prompt_token_ids=[[4, 5, 6]], use_tqdm=False)
    segments = set(glob.glob("/dev/shm/psm_*"))
    with pytest.raises(RuntimeError, match="shut down"):
        engine.update_weights_from_tensor({"model.norm.weight": torch.ones(64)})
    assert set(glob.glob("/dev/shm/psm_*")) <= segments, "the refused push left its shared-memory segment behind"


def test_a_cancelled_start_stops_its_children_and_removes_its_ipc_directory(tiny_dir, tmp_path, monkeypatch):
    """``start_cancelled`` turning true while the subprocesses start (here: as soon as they exist) abandons the
    start at once with StartCancelled, and leaves neither children nor the IPC directory behind."""
    from rollout.launcher import StartCancelled

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where IPCPaths.create puts the IPC directory
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    started: list[int] = []

    def cancelled() -> bool:
        started[:] = [p.pid for p in me.children() if p.pid not in before]
        return bool(started)

    t0 = time.monotonic()
    with pytest.raises(StartCancelled, match="cancelled"):
        Engine(tiny_dir("llama"), device="cpu", start_cancelled=cancelled)
    assert time.monotonic() - t0 < 30 and started
    assert _gone(started)
    assert not glob.glob(str(tmp_path / "rollout-ipc-*"))


def test_child_startup_error_reaches_the_caller(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir("llama"), broken)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    before = set(p.pid for p in psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match="missing 1 parameters"):
        Engine(str(broken), device="cpu")
    new = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert _gone(new)


_SCRIPT = textwrap.dedent("""
    import sys, time
    from rollout import Engine
    if __name__ == "__main__":
        engine = Engine(sys.argv[1], device="cpu", tp_size=int(sys.argv[2]))
        print(" ".join(str(p.pid) for p in engine._procs.procs), flush=True)
        if sys.argv[3] == "exit":
            sys.exit(0)
        time.sleep(600)
""")


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_children_exit_when_the_parent_dies_or_exits(tiny_dir, tmp_path, how):
    script = tmp_path / "parent.py"
    script.write_text(_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), tiny_dir("llama"), "2", how], stdout=subprocess.PIPE,
                              text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 3
    if how == "sigkill":
        parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=60)
    assert _gone(pids), "engine subprocesses outlived their parent"


_CONCURRENT_TOKENIZERS = textwrap.dedent("""
    import sys, threading
    from rollout.config import EngineConfig
    from rollout.engine import _load_tokenizer
    config, errors = EngineConfig(model_path=sys.argv[1], device="cpu"), []
    def load():
        try:
            _load_tokenizer(config)
        except Exception as e:
            errors.append(repr(e))
    threads = [threading.Thread(target=load) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(errors)
""")


def test_engines_started_at_once_from_threads_load_their_tokenizers(tiny_dir):
    """Engines started at once from several threads of a process that has not imported transformers yet: each
    loads its tokenizer (``Engine.__init__`` → ``_load_tokenizer``). transformers' first import is not thread-safe;
    unguarded, 2 or 3 of 4 threads failed with "ImportError: cannot import name 'AutoTokenizer'"."""
    out = subprocess.run([sys.executable, "-c", _CONCURRENT_TOKENIZERS, tiny_dir("llama")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.mark.parametrize("tp_size", [2.0, "2"])
def test_bad_tp_size_is_a_value_error_and_leaves_no_ipc_directory(tiny_dir, tp_size, tmp_path, monkeypatch):
    """A tp_size that is not a positive int (2.0 from a YAML or JSON config) is refused before anything starts;
    2.0 raised a bare TypeError in ``launch`` ("'float' object cannot be interpreted as an integer") after the
    engine's IPC directory was made, and left that directory behind; "2" a TypeError from the comparison."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # IPCPaths.create's mkdtemp
    with pytest.raises(ValueError, match="tp_size must be an int >= 1"):
        Engine(tiny_dir("llama"), device="cpu", tp_size=tp_size)
    assert list(tmp_path.glob("rollout-ipc-*")) == []
