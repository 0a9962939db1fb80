"""Settings from a YAML file and PDSERVE_* variables: one precedence order (command line >
environment > config file > default), errors that name the key, secrets masked when printed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve import cli
from pdserve.settings import SettingsError, apply_settings, describe


def parse(command: str, argv: list[str], environ: dict[str, str]):
    parser, _, sub = cli._parser(command)
    taken = apply_settings(sub, command, [command, *argv], environ)
    return parser.parse_args([command, *argv]), sub, taken


def test_config_file_env_and_command_line_in_that_order_of_strength(tmp_path):
    config = tmp_path / "pdserve.yaml"
    config.write_text("model: /models/a\ndecode: 127.0.0.1:7001\nport: 9000\nheartbeat-timeout-s: 2.5\n"
                      "proxy:\n  port: 9100\nprefill:\n  port: 1234\n")
    args, _, _ = parse("proxy", ["--config", str(config)], {})
    assert (args.model, args.decode, args.port, args.heartbeat_timeout_s) == ("/models/a", "127.0.0.1:7001", 9100, 2.5)
    args, _, _ = parse("proxy", ["--config", str(config)], {"PDSERVE_PORT": "9200"})
    assert args.port == 9200  # environment over the file
    args, _, _ = parse("proxy", ["--config", str(config), "--port", "9300"], {"PDSERVE_PORT": "9200"})
    assert args.port == 9300  # command line over both


def test_environment_alone_satisfies_required_flags_and_reads_booleans(tmp_path):
    args, _, _ = parse("decode", [], {"PDSERVE_MODEL": "/m", "PDSERVE_COLOCATED": "yes", "PDSERVE_MAX_NUM_SEQS": "7"})
    assert (args.model, args.colocated, args.max_num_seqs) == ("/m", True, 7)
    # --enable-prefix-caching / --no-enable-prefix-caching (BooleanOptionalAction): "false" is False
    args, _, _ = parse("decode", [], {"PDSERVE_MODEL": "/m", "PDSERVE_ENABLE_PREFIX_CACHING": "false"})
    assert args.enable_prefix_caching is False
    args, _, _ = parse("proxy", [], {"PDSERVE_CONFIG": "", "PDSERVE_MODEL": "/m", "PDSERVE_DECODE": "h:1"})
    assert args.decode == "h:1"


@pytest.mark.parametrize(("text", "environ", "message"), [
    ("no_such_flag: 1\n", {}, "unknown setting 'no_such_flag'"),
    ("port: eighty\n", {}, "port = 'eighty'"),
    ("colocated: maybe\n", {}, "not a boolean"),
    ("dtype: float8\n", {}, "not one of"),
    ("- a list\n", {}, "must be a mapping"),
    ("", {"PDSERVE_MAX_NUM_SEQS": "many"}, "env PDSERVE_MAX_NUM_SEQS"),
])
def test_bad_settings_name_the_key_and_the_source(tmp_path, text, environ, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SettingsError, match=message):
        parse("decode", ["--config", str(config)], environ)


def test_printed_settings_show_sources_and_mask_secrets(tmp_path):
    config = tmp_path / "s.yaml"
    config.write_text("api_key: hunter2\nport: 9001\n")
    args, sub, taken = parse("proxy", ["--config", str(config), "--decode", "h:1", "--model", "/m"],
                             {"PDSERVE_HEARTBEAT_TIMEOUT_S": "4"})
    node_args, node_sub, node_taken = parse("decode", ["--model", "/m", "--max-num-batched-tokens", "99"], {})
    assert "max_num_batched_tokens = 99 (command line)" in describe(node_args, node_sub, node_taken)
    text = describe(args, sub, taken)
    assert "command line > PDSERVE_* environment > --config file > built-in default" in text
    assert f"port = 9001 (config {config})" in text
    assert "heartbeat_timeout_s = 4.0 (env PDSERVE_HEARTBEAT_TIMEOUT_S)" in text
    assert "decode = 'h:1' (command line)" in text
    assert "hunter2" not in text and "api_key = '***'" in text


def test_a_bad_config_file_exits_2_before_anything_starts(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("model: /m\ndecode: h:1\nprot: 1\n")
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", "proxy", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "unknown setting 'prot'" in result.stderr
