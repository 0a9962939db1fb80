"""The pdserve command: every subcommand listed, modules imported only when chosen."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve import cli


def test_help_lists_every_subcommand_without_importing_torch():
    code = ("import sys\nfrom pdserve import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    for name, _, _ in cli.COMMANDS:
        assert name in result.stdout
    assert result.stdout.strip().endswith("NO-TORCH")


def test_missing_subcommand_module_is_reported_with_exit_code_2(monkeypatch, capsys):
    monkeypatch.setattr(cli, "COMMANDS", cli.COMMANDS + [("ghost", "pdserve.no_such_module", "not written yet")])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["ghost", "--anything"])
    assert exit_info.value.code == 2
    assert "not available: pdserve.no_such_module missing" in capsys.readouterr().err


def test_no_subcommand_prints_help_and_returns_2(capsys):
    assert cli.main([]) == 2
    assert "make-model" in capsys.readouterr().out


def test_make_model_subcommand_writes_a_checkpoint(tmp_path):
    assert cli.main(["make-model", str(tmp_path / "m"), "--preset", "tiny", "--seed", "3"]) == 0
    assert (tmp_path / "m" / "model.safetensors").exists() and (tmp_path / "m" / "tokenizer.json").exists()


def test_up_passes_the_proxy_and_node_flags_it_was_given_and_no_others():
    import argparse

    from pdserve import launcher

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    args = parser.parse_args(["--routing", "least-loaded", "--slo-ttft-ms", "2500", "--max-num-seqs", "8",
                              "--no-enable-prefix-caching"])
    assert launcher._given(args, launcher._PROXY_FLAGS) == ["--routing", "least-loaded", "--slo-ttft-ms", "2500.0"]
    assert launcher._given(args, launcher._NODE_FLAGS, launcher._NODE_SWITCHES) == [
        "--max-num-seqs", "8", "--no-enable-prefix-caching"]


def test_version(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out.startswith("pdserve 0.1.0")


def test_a_device_this_torch_cannot_use_is_one_line_naming_it(tiny_model_dir, capsys):
    """--device cuda on a CPU-only torch (or a GPU index past the visible ones), and a name that is
    no device: exit 2, one line saying what to do, no traceback."""
    import torch

    from engine.config import resolve_device

    bad = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    assert cli.main(["generate", "--model", str(tiny_model_dir), "--device", bad, "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"device {bad!r}" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="is not a device name"):
        resolve_device("gpu")
    assert resolve_device("cpu") == "cpu"


def test_dtype_auto_is_float32_on_the_cpu_and_the_checkpoints_half_type_on_cuda(tmp_path, monkeypatch):
    """--dtype auto (the default): float32 on the CPU, whatever the checkpoint says; on CUDA the
    checkpoint's bfloat16 or float16 (transformers 5's "dtype" or 4's "torch_dtype"), and
    bfloat16 for a float32 checkpoint, float16 where the GPU has no bfloat16."""
    import torch

    from engine.config import resolve_dtype

    def checkpoint(**fields):
        path = tmp_path / "-".join(f"{k}={v}" for k, v in fields.items())
        path.mkdir()
        (path / "config.json").write_text(json.dumps(fields))
        return path

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    for device in ("cpu", "cuda", "cuda:1"):
        for dtype in ("float32", "bfloat16", "float16"):
            assert resolve_dtype(dtype, device, tmp_path / "unread") == dtype  # as given: config.json not read
    for auto in ("auto", None):
        assert resolve_dtype(auto, "cpu", checkpoint(dtype="bfloat16", n=str(auto))) == "float32"
        assert resolve_dtype(auto, "cuda", checkpoint(dtype="float16", n=str(auto))) == "float16"
        assert resolve_dtype(auto, "cuda:1", checkpoint(torch_dtype="bfloat16", n=str(auto))) == "bfloat16"
        assert resolve_dtype(auto, "cuda", checkpoint(dtype="float32", n=str(auto))) == "bfloat16"
        assert resolve_dtype(auto, "cuda", checkpoint(n=str(auto))) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda", checkpoint(dtype="float32", n="old-gpu")) == "float16"
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"):
        resolve_dtype("fp8", "cpu", tmp_path)


def test_help_shows_each_default_once(capsys):
    with pytest.raises(SystemExit):
        cli.main(["decode", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--block-size BLOCK_SIZE default: 16" in text and "--max-num-seqs MAX_NUM_SEQS default: 128" in text
    assert "(default: 0.9)" in text  # --gpu-memory-utilization: its help, then its default
    assert "bfloat16 for a float32 checkpoint) (default: auto) --device" in text  # --dtype's, by the formatter
    assert "default: the checkpoint's --kernel-backend" in text  # --max-model-len's, by its help alone


@pytest.mark.parametrize("command", ["up", "prefill", "decode", "proxy", "generate"])
def test_a_model_directory_without_its_files_is_one_line_saying_what_to_do(command, tmp_path, capsys):
    """A missing directory (a hub id), and one without weights or tokenizer: every command that
    reads the model exits 2 with one line naming it, what is missing and how to get a model."""
    (tmp_path / "config.json").write_text("{}")
    extra = {"proxy": ["--decode", "127.0.0.1:1"], "generate": ["hi"]}.get(command, [])
    for model, words in (("HuggingFaceTB/SmolLM2-135M-Instruct", "does not exist"),
                         (str(tmp_path), "has no *.safetensors weights, no tokenizer.json"
                          if command != "proxy" else "has no tokenizer.json")):
        assert cli.main([command, "--model", model, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert words in err and "pdserve does not download models" in err, err
        if "Hugging" in model:
            assert f"huggingface-cli download {model} --local-dir DIR" in err
