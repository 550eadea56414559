"""A request body's bytes as JSON, with every bound checked before or while it is parsed, so that no body is a 500.

`json.loads` recurses once per level of nesting: 100,000 `[` were a RecursionError. The depth is counted on
the raw bytes first, brackets inside strings left out, in C-speed passes: escaped backslashes and quotes
dropped, then strings, then all but brackets. The body must be UTF-8 (RFC 8259), without NaN or Infinity,
its strings whole characters, and an object's keys unique: parsers disagree on which of two equal keys counts.
(A number past a double's range is infinite, and the schema's range of that field refuses it.)
"""

from __future__ import annotations

import codecs
import json
import re
import sys
from collections import Counter
from itertools import accumulate
from typing import Any

from kvserve.http.schema import BadRequest, short

MAX_DEPTH = 64  # levels of arrays and objects; a chat body with content parts nests 5
_STRING = re.compile(rb'"[^"]*+"')  # a string, once its escaped quotes are gone
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256)]  # a byte's change to the depth
_CHUNK = 4096  # brackets summed at a time: 100,000 `[` stop after the first chunk
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def loads(data: bytes) -> Any:
    """`data` as JSON, or BadRequest (code "invalid_json") saying what is wrong with it."""
    data = data.removeprefix(codecs.BOM_UTF8)  # a byte order mark, which RFC 8259 lets a parser ignore
    if not data.strip():
        raise _invalid("the body is empty: send a JSON object")
    depth = nesting_depth(data) if data.count(b"[") + data.count(b"{") > MAX_DEPTH else 0  # most: no count
    if depth > MAX_DEPTH:
        raise _invalid(f"the body nests arrays and objects more than {MAX_DEPTH} levels deep (at least {depth}); "
                       "a chat body needs 5")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(f"the body is not UTF-8, as JSON must be (RFC 8259): byte {data[exc.start]:#04x} at offset "
                       f"{exc.start}") from None
    try:
        value = json.loads(text, parse_constant=_constant, object_pairs_hook=_object)
    except BadRequest:
        raise
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # Python's bound on an int's digits, with its own advice
            raise _invalid(f"the body has an integer of more than {sys.get_int_max_str_digits()} digits") from None
        raise _invalid(f"the body is not valid JSON ({exc})") from None
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):  # pairs are fine: \ud83d\ude00 is one emoji
        raise _invalid("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff without its pair), which is not a "
                       "character")
    return value


def nesting_depth(data: bytes) -> int:
    """How deeply `data`'s arrays and objects nest; past MAX_DEPTH, at least that (the count stops). Brackets
    after a syntax error may be counted otherwise than a parser would see them, but json.loads stops there."""
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")  # left to right, as JSON reads escapes
    brackets = _STRING.sub(b"", unescaped).translate(None, _NOT_BRACKET)
    level = deepest = 0
    for start in range(0, len(brackets), _CHUNK):
        levels = list(accumulate(map(_STEP.__getitem__, brackets[start:start + _CHUNK]), initial=level))
        deepest, level = max(deepest, *levels), levels[-1]
        if deepest > MAX_DEPTH:
            break
    return deepest


def _invalid(message: str) -> BadRequest:
    return BadRequest(message, code="invalid_json")


def _constant(name: str) -> Any:
    raise _invalid(f"{name} is not a JSON number (RFC 8259); send a finite number")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) < len(pairs):
        key = next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise _invalid(f"the key {short(key)!r} appears more than once in one object; give each key once")
    return value


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False
