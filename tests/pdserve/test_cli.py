"""The pdserve command: every subcommand listed, modules imported only when chosen."""

from __future__ import annotations

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
