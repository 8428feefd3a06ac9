"""Log lines an operator can use: ``--log-format text|json`` on the node and on ``diffuse serve``.

``json`` writes one JSON object per line: ``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``,
``message``, and the event's own fields, given as ``extra=`` where the line is logged (``event``: what
happened, ``session``: the session id as the node says it, 8 hex digits, ``request_id``: the request that
opened it where known, ``node``: the node's control address, ``reason`` of a refusal, ...). A request id
is a short string of ``[A-Za-z0-9._-]`` (``clean_request_id``): the service makes one per HTTP request (or
takes the client's ``X-Request-Id``), the client carries it to every node in the sealed session open,
and each node logs it with that session's events, so one request's lines can be found on every machine.

>>> clean_request_id("req-1.a_B"), clean_request_id("no spaces"), clean_request_id("x" * 65), clean_request_id(7)
('req-1.a_B', None, None, None)
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

FORMATS = ("text", "json")
REQUEST_ID_MAX = 64  # characters
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,%d}" % REQUEST_ID_MAX)
_RECORD_KEYS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def clean_request_id(value) -> str | None:
    """``value`` if it is a usable request id (1 to 64 of ``A-Z a-z 0-9 . _ -``), else None."""
    return value if isinstance(value, str) and _REQUEST_ID.fullmatch(value) else None


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``fields``: what every line of this process carries (a node's address)."""

    def __init__(self, fields: dict | None = None):
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage(), **self.fields}
        for key, value in vars(record).items():
            if key not in _RECORD_KEYS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level, log_format: str, text_format: str, datefmt: str | None = None, stream=None):
    """The root logger's one handler (to ``stream``, standard error by default) in ``log_format``; returns
    its formatter (a ``JsonFormatter``'s ``fields`` may be filled in later, once the node knows its address)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(text_format, datefmt)
    handler.setFormatter(formatter)
    logging.basicConfig(level=level, handlers=[handler])
    return formatter


def add_flag(ap, what: str) -> None:
    """``--log-format`` on a command's parser."""
    ap.add_argument("--log-format", choices=FORMATS, default="text",
                    help=f"{what}'s log lines: text (default) or json, one object a line with the event's fields "
                    "(docs/operating.md, \"Logs\")")
