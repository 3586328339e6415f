"""The one bounded way the Python package reads the files it is given (registries, manifests,
policy tables, safetensors headers): a regular file only (never a FIFO or a device, which
could block or never end), its size checked before it is read, and JSON that is UTF-8
without NUL, nests at most MAX_DEPTH deep, has no duplicate keys and nothing after its value.
Every refusal is a ValueError of one line naming the file. The standard library's json has
no depth limit or duplicate-key rule of its own, hence the checks here."""
import json
import os
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


def _depth(text):
    """The deepest nesting of [ and { outside strings."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_json(data, what):
    """The JSON value of `data` (bytes or str) under the rules above; `what` names its source."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: not UTF-8 (byte {e.start})") from None
    if "\0" in text:
        raise ValueError(f"{what}: holds a NUL character (at {text.index(chr(0))})")
    if _depth(text) > MAX_DEPTH:
        raise ValueError(f"{what}: nested more than {MAX_DEPTH} deep")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except ValueError as e:
        raise ValueError(f"{what}: not valid JSON: {str(e)[:200]}") from None


def load_json(path, what, limit=MAX_JSON_BYTES):
    """The JSON value of the regular file `path`."""
    return parse_json(read_bytes(path, what, limit), f"{what} {path}")
