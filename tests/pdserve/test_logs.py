"""--log-format json: one JSON object per line, with the request id when a line concerns one
(extra= on nodes, the request being served on the proxy); text stays the default."""

from __future__ import annotations

import io
import json
import logging

import pytest

from pdserve.logs import configure
from proxy.log_context import current_request_id, install_record_factory


@pytest.fixture
def captured():
    """A stream to log to; the root logger is put back after the test (tests/conftest.py)."""
    return io.StringIO()


def test_json_lines_carry_time_level_logger_message_and_request_id(captured):
    configure("INFO", "json", captured)
    install_record_factory()
    log = logging.getLogger("node.server")
    log.info("plain %s", "line")
    log.warning("KV pull for request %s failed", "r-1", extra={"request_id": "r-1"})
    token = current_request_id.set("proxy-req-7")
    try:
        logging.getLogger("proxy.service").info("multi\nline")
    finally:
        current_request_id.reset(token)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    lines = captured.getvalue().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 4  # the newline inside a message stays inside its JSON string
    assert {"time", "level", "logger", "message", "process"} <= set(records[0]) and "request_id" not in records[0]
    assert records[0]["time"].endswith("Z") and records[0]["level"] == "INFO"
    assert records[1]["request_id"] == "r-1" and records[1]["level"] == "WARNING"
    assert records[2] == {**records[2], "request_id": "proxy-req-7", "message": "multi\nline"}
    assert "RuntimeError: boom" in records[3]["exc_info"]


def test_text_stays_the_default_with_the_request_id_in_brackets(captured):
    configure("INFO", "text", captured)
    logging.getLogger("proxy.x").info("hello", extra={"request_id": "abc"})
    line = captured.getvalue().strip()
    assert line.endswith("proxy.x INFO [abc] hello") and not line.startswith("{")
    with pytest.raises(ValueError, match="log format"):
        configure("INFO", "xml", captured)
