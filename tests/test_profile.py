"""``Engine.start_profile`` / ``stop_profile`` (SGLang's calls) and the trace summary of ``benchmarks.trace_gaps``."""

from __future__ import annotations

import os

import pytest

from benchmarks.trace_gaps import format_summary, load_events, summarize
from rollout import SamplingParams


def _kernel(ts: float, dur: float, name: str, cat: str = "kernel") -> dict:
    return {"ts": ts, "dur": dur, "name": name, "cat": cat}


def test_summary_merges_overlaps_and_sums_gaps_by_pair():
    events = [_kernel(0, 10, "gemm"), _kernel(15, 5, "norm"), _kernel(18, 10, "attn"),  # attn overlaps norm
              _kernel(40, 2, "copy", "gpu_memcpy"), _kernel(45, 10, "gemm"), _kernel(56, 4, "norm"),
              {"ts": 0, "dur": 100, "name": "aten::mm", "cat": "cpu_op"}]  # host events are not GPU time
    s = summarize(events)
    assert s.events == 6
    assert s.span_us == 60
    assert s.busy_us == 10 + 13 + 2 + 10 + 4  # norm and attn together cover 15..28
    assert s.idle_us == 5 + 12 + 3 + 1
    assert dict(s.gaps) == {("gemm", "norm"): [6, 2], ("attn", "copy"): [12, 1], ("copy", "gemm"): [3, 1]}
    assert s.gaps[0][0] == ("attn", "copy")  # largest first
    assert dict(s.kernels)["gemm"] == [20, 2] and s.kernels[0][0] == "gemm"
    text = format_summary(s)
    assert "busy 0.04 ms, idle 0.02 ms" in text and "attn -> copy" in text
    assert summarize([events[-1]]).events == 0
    assert "no GPU kernels" in format_summary(summarize([]))


def _generate(engine, n: int) -> None:
    engine.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=SamplingParams(
        temperature=0, max_new_tokens=n, ignore_eos=True), use_tqdm=False)


def test_profile_a_window_of_steps(engine, tmp_path):
    base = engine.get_step_stats()["launched_steps"]
    out = engine.start_profile(output_dir=str(tmp_path), start_step=base + 3, num_steps=2, profile_id="win")
    trace = str(tmp_path / "win-TP-0.trace.json.gz")
    assert out == {"traces": [trace], "start_step": base + 3}
    _generate(engine, 2)  # steps base, base + 1: before the window
    assert not os.path.exists(trace)
    with pytest.raises(ValueError, match="already running"):
        engine.start_profile(output_dir=str(tmp_path))
    _generate(engine, 8)  # 8 more steps: the window records 2 and ends at the launch after them
    assert engine.get_step_stats()["launched_steps"] == base + 10
    events = load_events(trace)
    assert any(e.get("cat") == "cpu_op" for e in events)
    with pytest.raises(ValueError, match="no profile is running"):
        engine.stop_profile()


def test_profile_until_stopped_counts_its_steps(engine, tmp_path):
    engine.start_profile(output_dir=str(tmp_path), profile_id="open", activities=["CPU"])
    _generate(engine, 5)  # one prefill step and four decode steps
    out = engine.stop_profile()
    assert out == {"trace": str(tmp_path / "open-TP-0.trace.json.gz"), "steps": 5}
    names = {e["name"] for e in load_events(out["trace"]) if e.get("cat") == "user_annotation"}
    # the scheduler's phases, as named ranges
    assert {"launch extend 1 rows", "launch decode 1 rows", "schedule decode", "wait", "results", "emit"} <= names


def test_profile_defaults_to_the_env_dir(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    out = engine.start_profile(profile_id="e")
    assert out["traces"] == [str(tmp_path / "env" / "e-TP-0.trace.json.gz")]
    assert engine.stop_profile()["steps"] == 0 and os.path.exists(out["traces"][0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(activities=["GPU"]), "needs an engine on CUDA"),
    (dict(activities=["CPU", "MEMORY"]), "unknown profiler activities"),
    (dict(num_steps=0), "num_steps must be at least 1"),
    (dict(start_step=-1), "start_step must be non-negative"),
])
def test_bad_profile_calls_are_value_errors_and_change_nothing(engine, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.start_profile(output_dir=str(tmp_path), **kwargs)
    with pytest.raises(ValueError, match="no profile is running"):
        engine.stop_profile()
    _generate(engine, 2)
