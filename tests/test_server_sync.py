"""Live weight sync over HTTP: a real trainer process drives the server's engine through ``rollout.client``
(SGLang-style control endpoints) and gloo broadcasts; afterwards ``/generate`` equals transformers on the
new weights and reports the new weight version."""

from __future__ import annotations

import multiprocessing as mp
import queue
from typing import Any

import httpx
import pytest
import torch

from sync_trainer import CHECK_PROMPTS
from rollout.ipc import free_port
from server_harness import API_KEY as KEY, ServerProcess, metrics

CTX = mp.get_context("spawn")


def run_trainer(url: str, api_key: str, path: str, port: int, commands: Any, results: Any) -> None:
    """Process target: join the group through the server, then run each command and report what it saw."""
    from transformers import AutoModelForCausalLM

    import weight_sync
    from reference import hf_greedy
    from rollout.client import EngineClient
    from sync_trainer import bad_update, join_group, train_step

    client = EngineClient(url, api_key=api_key)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    group_name = f"http-{port}"
    group = join_group([client], [1], port, group_name)
    while (cmd := commands.get(timeout=300)) is not None:
        try:
            if cmd["kind"] == "push":
                loss = train_step(model, seed=cmd["seed"])
                sender = weight_sync.WeightSender([client], group, group_name, bucket_bytes=64 << 10,
                                                  mode=cmd["mode"])
                report = sender.send(model.named_parameters(), weight_version=cmd["version"])
                results.put({"loss": loss, "buckets": report.num_buckets, "summary": report.summary(),
                             "trainer_fp": weight_sync.fingerprint(model),
                             "hf_greedy": [hf_greedy(model, p, 10) for p in CHECK_PROMPTS]})
            else:
                results.put({"error_seen": bad_update(cmd["case"], model, client, group, group_name)})
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.put({"error": f"{type(e).__name__}: {e}"})
    leaving = client.destroy_process_group(group_name, async_op=True)
    weight_sync.destroy_process_group(group)
    results.put({"left": leaving.result(timeout=60)})


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as c:
        yield c


class Trainer:
    def __init__(self, server: ServerProcess, path: str) -> None:
        self.commands, self.results = CTX.Queue(), CTX.Queue()
        self.proc = CTX.Process(target=run_trainer, args=(server.url, KEY, path, free_port(), self.commands,
                                                          self.results), daemon=True)
        self.proc.start()

    def do(self, **cmd: Any) -> dict[str, Any]:
        self.commands.put(cmd)
        return self.result()

    def result(self, timeout: float = 180) -> dict[str, Any]:
        for _ in range(int(timeout)):
            try:
                out = self.results.get(timeout=1)
            except queue.Empty:
                assert self.proc.is_alive(), f"the trainer died (exit {self.proc.exitcode})"
                continue
            assert "error" not in out, out["error"]
            return out
        raise AssertionError("the trainer did not answer")


def served(http: httpx.Client) -> tuple[list[list[int]], set[str]]:
    """Greedy outputs of CHECK_PROMPTS over /generate, and the weight versions they report."""
    items = http.post("/generate", json={"input_ids": CHECK_PROMPTS, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}).json()
    return [it["output_ids"] for it in items], {it["meta_info"]["weight_version"] for it in items}


def fingerprint(http: httpx.Client) -> str:
    return http.get("/weights_fingerprint").json()["fingerprint"]


def test_trainer_syncs_weights_over_http_and_outputs_equal_transformers(server, http, path, hf_reference):
    original = [hf_reference(path).greedy(p, 10) for p in CHECK_PROMPTS]
    assert served(http) == (original, {"0"})
    trainer = Trainer(server, path)
    try:
        step = trainer.do(kind="push", mode="bucket", seed=1, version="v1")
        assert step["buckets"] > 1, step["summary"]  # several announcements, kept in order by the client
        assert served(http) == (step["hf_greedy"], {"v1"})
        assert step["hf_greedy"] != original, "the training step changed the greedy outputs"
        assert fingerprint(http) == step["trainer_fp"]

        step = trainer.do(kind="push", mode="per_tensor", seed=2, version="v2")  # OpenRLHF's update_weight path
        assert served(http) == (step["hf_greedy"], {"v2"})
        assert fingerprint(http) == step["trainer_fp"]

        bad = trainer.do(kind="bad", case="unknown_name")
        assert "unknown parameter name" in bad["error_seen"] and "HTTP 400" in bad["error_seen"]
        assert served(http) == (step["hf_greedy"], {"v2"}), "a rejected update changed the served weights"
        assert fingerprint(http) == step["trainer_fp"]

        trainer.commands.put(None)
        assert trainer.result()["left"] is True
        trainer.proc.join(30)
    finally:
        if trainer.proc.is_alive():
            trainer.proc.kill()
    m = metrics(http)
    assert m["rollout_weight_updates_total"] == 2 and m["rollout_last_weight_sync_seconds"] > 0
    assert m["rollout_weight_version_info{version=v2}"] == 1
    assert http.get("/get_weight_version").json() == {"weight_version": "v2"}
    assert http.get("/get_weight_state").json()["groups"] == []


def test_reload_from_disk_over_http_restores_the_checkpoint(server, http, path, hf_reference):
    answer = http.post("/update_weights_from_disk", json={"model_path": path, "weight_version": "from-disk"}).json()
    assert answer["success"] is True and answer["complete"] is True, answer
    assert served(http) == ([hf_reference(path).greedy(p, 10) for p in CHECK_PROMPTS], {"from-disk"})
