"""Logging for every pdserve process, set up once by the command line (pdserve.cli) before the
subcommand runs: text (the default) or, with --log-format json, one JSON object per line that
log collectors (Loki, Elasticsearch, Cloud Logging) parse without rules of their own.

A JSON line has time (UTC, ISO 8601 with milliseconds), level, logger, message, process, and
request_id whenever the line concerns one request: from the record's `request_id` attribute
(`logger.info(..., extra={"request_id": rid})`) or, on the proxy, from the request being
served (proxy.log_context puts it on every record made while a request runs). Exceptions go
into "exc_info" as text. The proxy and the nodes may not import this package (see
tests/test_layering.py): they only name the request, this module prints it.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# Record attributes that carry a request id; the first one set wins.
_REQUEST_ID_ATTRIBUTES = ("request_id", "context_request_id")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages are escaped by JSON)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        request_id = request_id_of(record)
        if request_id is not None:
            line["request_id"] = request_id
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc_info"] = record.exc_text
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """The plain format, with " [request_id]" after the level when a record names a request."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        request_id = request_id_of(record)
        if request_id is None:
            return text
        head = f"{record.name} {record.levelname}"
        return text.replace(head, f"{head} [{request_id}]", 1)


def request_id_of(record: logging.LogRecord) -> str | None:
    for name in _REQUEST_ID_ATTRIBUTES:
        value = getattr(record, name, None)
        if value:
            return str(value)
    return None


def configure(level: str = "INFO", log_format: str = "text", stream=None) -> None:
    """Route every logger (uvicorn's too, when it is started with log_config=None) to one
    handler on stderr in log_format. Replaces handlers set before; raises ValueError for an
    unknown format or level."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)
