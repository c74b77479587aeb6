"""``rollout-smoke`` on checkpoints unlike the default model's (the MoE ones are in test_moe_weight_sync.py)."""

from __future__ import annotations

import shutil


def test_smoke_passes_on_a_base_model_whose_tokenizer_has_no_chat_template(tiny_dir, tmp_path, capsys):
    """A base model's tokenizer often has no chat template (Qwen3-0.6B-Base, Llama-3.1-8B): the smoke asks its
    questions as plain text there, where it had stopped with "this model's tokenizer has no chat template"."""
    from transformers import AutoTokenizer

    from weight_sync.smoke import main

    path = tmp_path / "base"
    shutil.copytree(tiny_dir("llama"), path)
    for f in path.glob("chat_template*"):
        f.unlink()
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = None
    tok.save_pretrained(path)
    assert not AutoTokenizer.from_pretrained(path).chat_template
    code = main(["--model", str(path), "--device", "cpu", "--mode", "tensor", "--num-prompts", "2",
                 "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "OK: all checks passed" in out
