"""What both HTTP front ends promise of a request's head and body, and the httptools
front end's requests and answers as its connections hold and write them
(server/front.py: a Parsed request, a Refused one, a Scanned one; status lines and
header fields).

    the request target       at most TARGET_MAX bytes       else 414 URI Too Long
    a header field           name and value, FIELD_MAX      else 431 Request Header
    the header fields        at most FIELDS_MAX of them          Fields Too Large
    the head in all          target, names and values,
                             HEAD_MAX

A refused head is answered after the answers to the requests before it on the
connection, and the connection then ends (server/front.py; the aiohttp front end
of server/app.py sets its parser's limits to the same numbers).  The C scanner
(server/_front.c) declines what is past them, so httptools refuses it alike.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

from .routes import Request, Response

__all__ = ["FIELDS_MAX", "FIELD_MAX", "HEAD_MAX", "LINGER", "MAX_BODY", "STATUS_LINES",
           "TARGET_MAX", "Head", "Parsed", "Refusal", "Refused", "Scanned", "TooLarge",
           "fields", "head_refusal", "head_size", "unseen_field"]

#: the request target's bytes (aiohttp's max_line_size)
TARGET_MAX = 16 << 10
#: a header field's name and value (aiohttp's max_field_size)
FIELD_MAX = 8 << 10
#: header fields in one request (aiohttp's max_headers)
FIELDS_MAX = 128
#: the target and every field's name and value together
HEAD_MAX = 64 << 10
#: the largest request body accepted (C scanner: server/_front.c's MAX_BODY)
MAX_BODY = 1 << 30
#: seconds a connection that is ending goes on reading (and dropping) what its client
#: still sends after the last answer, so that no reset overtakes the answers
LINGER = 2.0

_REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 403: "Forbidden",
           404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
           413: "Request Entity Too Large", 414: "URI Too Long",
           431: "Request Header Fields Too Large", 500: "Internal Server Error",
           503: "Service Unavailable", 504: "Gateway Timeout"}

STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, reason.encode())
                for code, reason in _REASONS.items()}


class Refusal(Exception):
    """A request the front end will not read further: its status and why."""

    def __init__(self, status: int, message: str):
        super().__init__(status, message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"


class Head:
    """One request head's size as the parser hands it over, checked against the
    limits: the target's pieces, then each field whole."""

    __slots__ = ("target", "count", "size")

    def __init__(self):
        self.target = 0
        self.count = 0
        self.size = 0

    def url(self, piece: bytes) -> None:
        self.target += len(piece)
        self.size += len(piece)
        if self.target > TARGET_MAX:
            raise Refusal(414, f"the request target is longer than {TARGET_MAX} bytes")

    def field(self, name: bytes, value: bytes) -> None:
        n = len(name) + len(value)
        self.count += 1
        self.size += n
        if n > FIELD_MAX:
            raise Refusal(431, f"the header field {name[:64]!r} is {n} bytes: the limit "
                          f"is {FIELD_MAX} (its name and value)")
        if self.count > FIELDS_MAX:
            raise Refusal(431, f"more than {FIELDS_MAX} header fields")
        if self.size > HEAD_MAX:
            raise head_refusal()


def head_refusal() -> Refusal:
    """The refusal of a head over HEAD_MAX in all."""
    return Refusal(431, f"the request head is over {HEAD_MAX} bytes (its target and its "
                   "fields' names and values)")


def head_size(target: str, raw: Sequence[Tuple[bytes, bytes]]) -> int:
    """A parsed head's size as Head counts it: its target and its fields' names and
    values."""
    return len(target) + sum(len(n) + len(v) for n, v in raw)


def unseen_field(size: int) -> Optional[Refusal]:
    """The refusal of a field the parser still holds, ``size`` bytes on (at least)."""
    if size > FIELD_MAX:
        return Refusal(431, f"a header field is over {FIELD_MAX} bytes")
    return None


def fields(ctype: Optional[str], headers: Dict[str, object], size: int,
           keep_alive: bool) -> bytes:
    """A response's header fields after its Date, and the blank line."""
    head = [b"Server: neuronmp\r\nContent-Length: %d\r\n" % size]
    if ctype is not None:
        head.append(b"Content-Type: %s\r\n" % ctype.encode("latin-1"))
    for k, v in headers.items():
        head.append(b"%s: %s\r\n" % (k.encode("latin-1"), str(v).encode("latin-1")))
    if not keep_alive:
        head.append(b"Connection: close\r\n")
    head.append(b"\r\n")
    return b"".join(head)


class Parsed(Request):
    """A request httptools parsed, with what its connection reads of it beyond the
    handlers' Request: whether the connection stays open after its answer, and its
    Inference-Header-Content-Length field (the fast infer path reads no other)."""

    __slots__ = ("keep_alive", "binary_len")

    def __init__(self):
        super().__init__()
        self.keep_alive = True
        self.binary_len: Optional[bytes] = None


class TooLarge(Exception):
    pass


class Refused:
    """A request refused unread, in the queue behind the requests before it: its
    answer is the refusal's plain-text status, and the connection then ends."""

    __slots__ = ("answer",)
    method = "GET"
    keep_alive = False

    def __init__(self, refused: Refusal):
        body = f"{refused.status}: {refused.message}".encode()
        self.answer = Response(refused.status, "text/plain; charset=utf-8", {}, [body])


class Scanned:
    """A request the scanner read, with what its answer's writing reads of it."""

    __slots__ = ("keep_alive",)
    method = "POST"

    def __init__(self, keep_alive: bool):
        self.keep_alive = keep_alive
