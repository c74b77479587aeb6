"""A trainer that stops or dies at any point of a weight update never hangs the engine: an abandoned
session turns inconsistent within the group timeout (held requests fail with that reason, the group is torn
down), and a complete update from a new trainer restores exact weights."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollout import Engine, SamplingParams
from weight_sync.remote import serve_engine

import fault_trainer
from sync_trainer import CHECK_PROMPTS

from rollout.ipc import free_port

CTX = mp.get_context("spawn")
GROUP_TIMEOUT_S = 5.0
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)




def _start(engine: Engine, target, *args):
    mine, theirs = CTX.Pipe()
    serve_engine(engine, mine)
    results = CTX.Queue()
    proc = CTX.Process(target=target, args=(theirs, *args, results), daemon=True)
    proc.start()
    return proc, results


def _expect(results, proc, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = results.get(timeout=0.5)
        except queue.Empty:
            assert proc.is_alive(), f"the trainer exited (code {proc.exitcode}) before {what!r}"
            continue
        assert got == what, got
        return
    raise AssertionError(f"no {what!r} from the trainer")


@pytest.mark.parametrize("scenario", fault_trainer.SCENARIOS)
def test_trainer_stopped_at_any_point_never_hangs_the_engine(engine, path, hf_reference, scenario):
    """One engine (the module's) for every scenario: each ends with a complete update, and the next starts from the
    checkpoint's weights again."""
    hf = hf_reference(path)
    assert engine.update_weights_from_disk(path)["complete"]
    for name in engine.get_weight_state()["groups"]:  # the last scenario's healthy trainer left its group
        engine.destroy_process_group(name)
    assert engine.get_weight_state()["state"] == "consistent"
    proc, results = _start(engine, fault_trainer.run, path, free_port(), scenario, GROUP_TIMEOUT_S)
    _expect(results, proc, "joined")
    _expect(results, proc, "stopping")
    proc.join(30)
    stopped = time.monotonic()
    if scenario in ("after_join", "first_bucket_announced"):  # no weight was touched: they keep serving
        out = engine.generate(prompt_token_ids=CHECK_PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [hf.greedy(p, 8) for p in CHECK_PROMPTS]
        deadline = time.monotonic() + GROUP_TIMEOUT_S + 5.0
        while scenario != "after_join" and engine.get_weight_state()["groups"]:  # the failed transfer drops it
            assert time.monotonic() < deadline, engine.get_weight_state()
            time.sleep(0.2)
        assert engine.get_weight_state()["state"] == "consistent"
        if scenario == "after_join":
            engine.destroy_process_group("g")
    else:
        # a request sent now is held by the open session, then fails with the reason, in time
        held = ThreadPoolExecutor(1).submit(engine.generate, prompt_token_ids=CHECK_PROMPTS[:1],
                                            sampling_params=GREEDY, use_tqdm=False)
        with pytest.raises(RuntimeError, match="refuses to generate.*(abandoned|failed mid-update)"):
            held.result(timeout=GROUP_TIMEOUT_S + 5.0)  # a TimeoutError here: the engine still holds it
        waited = time.monotonic() - stopped
        assert waited < GROUP_TIMEOUT_S + 5.0, f"the held request failed only after {waited:.1f} s"
        state = engine.get_weight_state()
        assert state["state"] == "inconsistent" and "mix of two versions" in state["reason"]
        assert state["groups"] == [], "the dead trainer's group is still registered"
        with pytest.raises(RuntimeError, match="refuses to generate"):
            engine.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False)
    # a new trainer in a new group pushes a complete update: exact weights again
    proc, results = _start(engine, fault_trainer.push_complete, path, free_port())
    step = results.get(timeout=300)
    proc.join(30)
    assert "error" not in step, step.get("error")
    eng = step["engines"][0]
    assert eng["fp"] == step["trainer_fp"] and eng["greedy"] == step["hf_greedy"]
    assert eng["state"]["state"] == "consistent"
