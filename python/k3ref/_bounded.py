"""The one bounded way the Python package reads the files it is given (registries, manifests,
policy tables, safetensors headers): a regular file only (never a FIFO or a device, which
could block or never end), its size checked before it is read, and JSON that is UTF-8
without NUL, nests at most MAX_DEPTH deep, has no duplicate keys and nothing after its value.
Every refusal is a ValueError of one line naming the file. The standard library's json has
no depth limit or duplicate-key rule of its own, hence the checks here."""
import json
import os
import re
import stat

MAX_DEPTH = 64
MAX_JSON_BYTES = 16 * 1024 * 1024


def read_bytes(path, what, limit):
    """The bytes of the regular file `path` (at most `limit` bytes), else ValueError."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} {path}: not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{what} {path}: {st.st_size} bytes, more than the {limit}-byte limit")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise ValueError(f"{what} {path}: grew past the {limit}-byte limit while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:80]!r}")
        out[key] = value
    return out


# Characters a terminal acts on or that break a line (io::printable's set in C++): C0, DEL, C1,
# the line and paragraph separators, the bidirectional overrides and isolates.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028-\u202e\u2066-\u2069]")


def _plain_keys(pairs):
    """_no_duplicates, and no key holding a character of _UNPRINTABLE: the keys of a table or a
    registry are names, which messages quote."""
    for key, _ in pairs:
        if _UNPRINTABLE.search(key):
            raise ValueError(f"key {key[:80]!r} holds a control character")
    return _no_duplicates(pairs)


def _no_constant(name):
    # Python's json takes NaN, Infinity and -Infinity; JSON (and the C++ readers) do not.
    raise ValueError(f"{name} is not JSON (non-finite numbers have no JSON form)")


def _float(text):
    # As nlohmann::json (the C++ readers): a number past double's range is an error
    # ("number overflow"), not infinity.
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number overflow parsing {text[:40]!r}")
    return value


def _integer(text):
    # As nlohmann::json: an integer that fits in 64 bits (signed, or unsigned when positive) is
    # an integer; a longer one becomes a double (an error past double's range), never a Python
    # int of thousands of digits.
    if len(text) <= 20:
        value = int(text)
        if -(1 << 63) <= value < (1 << 64):
            return value
    return _float(text)


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_LONE_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _depth_of_brackets(brackets):
    """The deepest nesting of bytes of [ ] { } only."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency of the package
        np = None
    if np is None or len(brackets) < 4096:
        depth = deepest = 0
        for ch in brackets:
            if ch in b"[{":
                depth += 1
                if depth > deepest:
                    deepest = depth
            else:
                depth -= 1
        return deepest
    raw = np.frombuffer(brackets, dtype=np.uint8)
    deepest, carry, step = 0, 0, 1 << 22
    for start in range(0, raw.size, step):  # in pieces: a cumulative sum of 100 MB would take 800 MB
        piece = raw[start:start + step]
        # '[' 0x5b and '{' 0x7b have bit 1 set, ']' 0x5d and '}' 0x7d do not: +1 or -1
        level = np.cumsum((piece & 2).astype(np.int32) - 1, dtype=np.int32) + carry
        deepest = max(deepest, int(level.max()))
        carry = int(level[-1])
    return deepest


def _depth(text):
    """The deepest nesting of [ and { outside strings, at C speed: strings are cut out by one
    regular expression, everything but brackets by str.translate, and the running depth summed
    in pieces (a 100 MB header is scanned in about a second)."""
    if not any(ch in text for ch in "[{"):
        return 0
    stripped = _STRING.sub("", text) if '"' in text else text
    # (UTF-8 bytes of other characters are never bracket bytes)
    return _depth_of_brackets(stripped.encode("utf-8", "surrogatepass").translate(None, _NOT_BRACKETS))


def _check_strings(value):
    """ValueError on a string (key or value) holding a lone UTF-16 surrogate: JSON's \\ud800
    escape without its pair, which Python's json takes and the C++ readers (and UTF-8) do not."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"a string holds a lone surrogate escape (U+{ord(v[e.start]):04X})") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


_SCALAR = re.compile(r"[-+.0-9a-zA-Z]+")
_BIG_NUMBER = re.compile(r"[0-9]{20}|[eE][-+]?[0-9]{3}")


def _value_count(text):
    """The number of JSON values in `text` as the C++ manifest reader counts them (every
    scalar, string value, object and array; keys are not values), at C speed: strings are
    replaced by one character each, keys are the strings before a colon."""
    stripped, strings = _STRING.subn('"', text)
    return (strings - stripped.count(":") + stripped.count("[") + stripped.count("{")
            + _SCALAR.subn("", stripped)[1])


def parse_json(data, what, max_depth=MAX_DEPTH, max_values=None, plain_keys=False):
    """The JSON value of `data` (bytes or str) under the rules above; `what` names its source.
    `max_depth`: the deepest nesting allowed (a safetensors header's schema has 3 levels);
    `max_values`: the most JSON values (counted before any is built), or None; `plain_keys`:
    refuse keys with control characters (tables and registries, whose keys are names)."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: not UTF-8 (byte {e.start})") from None
    if "\0" in text:
        raise ValueError(f"{what}: holds a NUL character (at {text.index(chr(0))})")
    if _depth(text) > max_depth:
        raise ValueError(f"{what}: nested more than {max_depth} deep")
    if max_values is not None and _value_count(text) > max_values:
        raise ValueError(f"{what}: more than {max_values} JSON values (the limit)")
    try:
        # (the number hooks cost a call per number: only when some number may pass 64 bits or
        # double's range)
        big = _BIG_NUMBER.search(text) is not None
        value = json.loads(text, object_pairs_hook=_plain_keys if plain_keys else _no_duplicates,
                           parse_constant=_no_constant, parse_int=_integer if big else None,
                           parse_float=_float if big else None)
        if _LONE_SURROGATE_ESCAPE.search(text):
            _check_strings(value)
        return value
    except RecursionError:
        raise ValueError(f"{what}: nested more than {max_depth} deep") from None
    except ValueError as e:
        raise ValueError(f"{what}: not valid JSON: {str(e).splitlines()[0][:200] if str(e) else 'invalid'}") from None


def load_json(path, what, limit=MAX_JSON_BYTES, max_values=None, plain_keys=True):
    """The JSON value of the regular file `path` (a table or a registry: keys are names without
    control characters, unless plain_keys=False, as for a golden manifest's free-form params)."""
    return parse_json(read_bytes(path, what, limit), f"{what} {path}", max_values=max_values, plain_keys=plain_keys)
