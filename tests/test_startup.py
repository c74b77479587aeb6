"""An Engine starts the way people call it: a script's top level with no main guard, ``python -c``, a
script read from stdin, and a Jupyter kernel (the children never re-import the caller's ``__main__``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_BODY = textwrap.dedent("""
    from rollout import Engine
    engine = Engine({path!r}, device="cpu")
    out = engine.generate(prompt_token_ids=[[4, 5, 6, 7]], sampling_params={{"max_tokens": 5, "temperature": 0}},
                          use_tqdm=False)
    print("TOKENS", out[0].outputs[0].token_ids, flush=True)
    engine.shutdown()
""")


def _tokens(stdout: str) -> list[int]:
    line = next(line for line in stdout.splitlines() if line.startswith("TOKENS"))
    return eval(line.split(" ", 1)[1])  # noqa: S307 - our own printed list


@pytest.fixture(scope="module")
def expected(tiny_dir, hf_reference):
    path = tiny_dir("llama")
    return path, hf_reference(path).greedy([4, 5, 6, 7], 5)


@pytest.mark.parametrize("how", ["script", "python -c", "stdin"])
def test_engine_at_top_level_without_main_guard(expected, tmp_path, how):
    path, tokens = expected
    body = _BODY.format(path=path)
    if how == "script":
        script = tmp_path / "top_level.py"
        script.write_text(body)
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    elif how == "python -c":
        proc = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=300)
    else:
        proc = subprocess.run([sys.executable, "-"], input=body, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bootstrapping phase" not in proc.stderr
    assert _tokens(proc.stdout) == tokens


def test_engine_in_a_jupyter_kernel(expected):
    import jupyter_client.manager  # the test extra installs it, with ipykernel

    path, tokens = expected
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:
        printed: list[str] = []

        def on_output(msg):
            if msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                printed.append("\n".join(msg["content"]["traceback"]))

        reply = kc.execute_interactive(_BODY.format(path=path), timeout=300, output_hook=on_output)
        assert reply["content"]["status"] == "ok", "".join(printed)
        assert _tokens("".join(printed)) == tokens
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
