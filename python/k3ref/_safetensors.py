"""The project's one safetensors reader: pure Python and NumPy, no torch.

k3ref.goldens uses the `safetensors` package when it is installed and this reader otherwise
(Debian 12 packages no `safetensors`); the NumPy cross-checks in tests/ use it directly, so
the files are read by one piece of code everywhere. The format (docs/golden-format.md):
8 bytes little-endian header length n, n bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
then the data, little-endian, row-major. Every structural rule is checked, and a violation
raises SafetensorsError (a ValueError) naming the file and the tensor, in one line.

API
---
read(path) -> SafetensorsFile      .tensors {name: RawTensor(dtype, shape, data)}, in the
                                   file's data order; .metadata {str: str}
load(path) -> (arrays, metadata)   {name: numpy array}: F64 F32 F16 I64 I32 U8 BOOL as
                                   stored (native byte order); BF16, F8_E4M3, F8_E5M2 widened
                                   exactly to float64
to_numpy(raw, widen=True)          one RawTensor; widen=False gives BF16 as float32 (exact) and
                                   F8 as float32 (exact)
bf16_bits(raw) -> uint16 array     the raw BF16 bit patterns (for a lossless torch.bfloat16 view)
save(path, tensors, metadata=None)  the one writer (k3ref.save): {name: torch tensor or NumPy
                                   array}, in order; str metadata; written as k3ref's C++
                                   writer lays files out, through an exclusive temporary
"""
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# dtype name -> (NumPy storage dtype, bytes per element): the dtypes k3ref's C++ reader reads
# (include/k3ref/tensor/dtype.h); a file with another (I16, I8, ...) is refused by both.
DTYPES = {
    "F64": ("<f8", 8), "F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2),
    "F8_E4M3": ("u1", 1), "F8_E5M2": ("u1", 1),
    "I64": ("<i8", 8), "I32": ("<i4", 4), "U8": ("u1", 1),
    "BOOL": ("?", 1),
}
# The C++ reader's limits (include/k3ref/io/safetensors.h), so that both take the same files.
MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit
MAX_TENSORS = 131_072
MAX_RANK = 64
MAX_HEADER_DEPTH = 3            # top object, tensor entry, shape array: nothing nests deeper
MAX_FILE_BYTES = 1 << 40                # read whole into memory: no file of that size is a golden


class SafetensorsError(ValueError):
    """A file that is not a valid safetensors file; the message names the file and the tensor."""


@dataclass(frozen=True)
class RawTensor:
    dtype: str          # one of DTYPES
    shape: tuple
    data: memoryview    # the tensor's bytes, little-endian


@dataclass
class SafetensorsFile:
    path: str
    tensors: dict       # name -> RawTensor, in data order
    metadata: dict      # str -> str


def _bounded():
    """k3ref._bounded, also when this file is loaded by path on its own (the NumPy oracle of
    tests/ does, to import nothing else of the package)."""
    try:
        from . import _bounded as module
    except ImportError:
        import importlib.util
        import sys

        module = sys.modules.get("k3ref_bounded_by_path")
        if module is None:
            spec = importlib.util.spec_from_file_location("k3ref_bounded_by_path", Path(__file__).with_name("_bounded.py"))
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules["k3ref_bounded_by_path"] = module
    return module


def _fail(path, what):
    raise SafetensorsError(f"{path}: {what}")


def read(path):
    """Reads and validates a whole file (see the module docstring)."""
    parse_json, read_bytes = _bounded().parse_json, _bounded().read_bytes
    path = str(path)
    try:  # a regular file only: a FIFO or a device is refused at once, never read until it ends
        raw = read_bytes(path, "safetensors file", MAX_FILE_BYTES)
    except ValueError as e:
        raise SafetensorsError(str(e)) from None
    if len(raw) < 8:
        _fail(path, f"{len(raw)} bytes: too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(raw):
        _fail(path, f"header length {n} exceeds the file ({len(raw)} bytes) or the {MAX_HEADER_BYTES}-byte limit")
    try:  # no duplicate keys (the C++ reader refuses them too), no NUL, the schema's nesting
        header = parse_json(bytes(raw[8:8 + n]), "header", max_depth=MAX_HEADER_DEPTH)
    except ValueError as e:
        _fail(path, f"header is not JSON ({str(e).splitlines()[0]})")
    if not isinstance(header, dict):
        _fail(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        _fail(path, "__metadata__ must map strings to strings")
    if len(header) > MAX_TENSORS:
        _fail(path, f"header declares more than {MAX_TENSORS} tensors (the limit)")
    data = memoryview(raw)[8 + n:]
    entries = []
    for name, e in header.items():
        where = f"tensor '{name}'"
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            _fail(path, f"{where}: entry must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            _fail(path, f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if isinstance(shape, list) and len(shape) > MAX_RANK:  # first: a shape of 20 million extents
            _fail(path, f"{where}: shape has more than {MAX_RANK} dimensions (the rank limit)")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            _fail(path, f"{where}: shape must be a list of non-negative integers, not {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= len(data)):
            _fail(path, f"{where}: data_offsets {offsets!r} outside the {len(data)} data bytes")
        # Every extent, and the product of the non-zero ones, fits in 63 bits (the C++ reader's
        # rule: a stride or a product of some extents of a zero-element shape must not overflow).
        nonzero = 1
        for d in shape:
            if d >= 1 << 63:
                _fail(path, f"{where}: extent {d} in shape does not fit in 63 bits")
            nonzero *= d or 1
            if nonzero >= 1 << 63:
                _fail(path, f"{where}: element count of shape {shape} overflows 63 bits")
        count = 0 if 0 in shape else nonzero
        if offsets[1] - offsets[0] != count * DTYPES[dtype][1]:
            _fail(path, f"{where}: {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype} "
                        f"(needs {count * DTYPES[dtype][1]})")
        entries.append((offsets[0], offsets[1], name, dtype, tuple(shape)))
    entries.sort()
    end = 0
    for begin, stop, name, _, _ in entries:
        if begin != end:
            _fail(path, f"tensor '{name}': data starts at byte {begin}, expected {end} (gap or overlap)")
        end = stop
    if end != len(data):
        _fail(path, f"{len(data) - end} trailing data bytes after the last tensor")
    tensors = {name: RawTensor(dtype, shape, data[begin:stop]) for begin, stop, name, dtype, shape in entries}
    return SafetensorsFile(path, tensors, metadata)


def _f8_table(exponent_bits, mantissa_bits, bias, e4m3):
    """float32 value of each of the 256 codes of an 8-bit float (OCP FP8: E4M3 has no
    infinities and one NaN per sign, S.1111.111; E5M2 is IEEE-like)."""
    out = np.empty(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
        m = code & ((1 << mantissa_bits) - 1)
        top = (1 << exponent_bits) - 1
        if e4m3 and e == top and m == (1 << mantissa_bits) - 1:
            v = float("nan")
        elif not e4m3 and e == top:
            v = float("inf") if m == 0 else float("nan")
        elif e == 0:
            v = m / (1 << mantissa_bits) * 2.0 ** (1 - bias)
        else:
            v = (1 + m / (1 << mantissa_bits)) * 2.0 ** (e - bias)
        out[code] = sign * v
    return out


_F8 = {}


def _f8(dtype):
    if dtype not in _F8:
        _F8[dtype] = _f8_table(4, 3, 7, True) if dtype == "F8_E4M3" else _f8_table(5, 2, 15, False)
    return _F8[dtype]


def bf16_bits(raw):
    """The BF16 tensor's bit patterns as a uint16 array of its shape."""
    if raw.dtype != "BF16":
        raise TypeError(f"bf16_bits: tensor is {raw.dtype}, not BF16")
    return np.frombuffer(raw.data, dtype="<u2").astype(np.uint16).reshape(raw.shape)


def to_numpy(raw, widen=True):
    """A NumPy array (a copy, native byte order) of one RawTensor; see the module docstring."""
    storage = np.dtype(DTYPES[raw.dtype][0])
    a = np.frombuffer(raw.data, dtype=storage)
    if raw.dtype == "BF16":
        a = (a.astype(np.uint32) << 16).view(np.float32)  # bf16 is the top half of a float32: exact
    elif raw.dtype in ("F8_E4M3", "F8_E5M2"):
        a = _f8(raw.dtype)[a]
    else:
        a = a.astype(storage.newbyteorder("="))
    if widen and raw.dtype in ("BF16", "F8_E4M3", "F8_E5M2"):
        a = a.astype(np.float64)
    return a.reshape(raw.shape)


def load(path):
    """(arrays, metadata) of a whole file; see the module docstring."""
    f = read(path)
    return {name: to_numpy(t) for name, t in f.tensors.items()}, dict(f.metadata)


# NumPy dtype -> safetensors dtype (the writer's direction; BF16 and F8 come from torch).
_NUMPY_CODES = {np.dtype("float64"): "F64", np.dtype("float32"): "F32", np.dtype("float16"): "F16",
                np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("uint8"): "U8",
                np.dtype("bool"): "BOOL"}  # (int16 and int8: no dtype k3ref's C++ reader reads)


def _as_stored(name, t):
    """(dtype name, shape, little-endian bytes) of one tensor: a torch tensor (any device,
    bfloat16 and float16 by their bits) or anything NumPy takes."""
    if type(t).__module__.startswith("torch"):
        import torch

        from ._data import torch_code  # here: the NumPy oracle loads this file by path, to read

        t = t.detach().cpu().contiguous()
        code = torch_code(t.dtype)
        if code not in DTYPES:
            raise TypeError(f"k3ref.save: tensor {name!r}: dtype {t.dtype} has no safetensors name here")
        raw = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
        return code, tuple(t.shape), np.ascontiguousarray(raw.numpy()).astype(DTYPES[code][0], copy=False).tobytes()
    a = np.asarray(t)
    if a.dtype not in _NUMPY_CODES:
        raise TypeError(f"k3ref.save: tensor {name!r}: NumPy dtype {a.dtype} has no safetensors name here")
    code = _NUMPY_CODES[a.dtype]
    return code, tuple(a.shape), np.ascontiguousarray(a).astype(DTYPES[code][0], copy=False).tobytes()


def save(path, tensors, metadata=None):
    """Writes `tensors` ({name: tensor}, in the given order) and string `metadata` to `path`
    as a safetensors file laid out as k3ref's own writer lays it out (contiguous data in
    order, the JSON header with sorted keys, padded with spaces to a multiple of 8 bytes), through a temporary
    created exclusively beside it and renamed into place. Raises TypeError / ValueError (one
    line) on a name, dtype or metadata value it cannot write."""
    import os
    import secrets

    if not hasattr(tensors, "items"):
        raise TypeError(f"k3ref.save: tensors must be a mapping of names to tensors, not {type(tensors).__name__}")
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"k3ref.save: metadata must map str to str (key {k!r} has a {type(v).__name__})")
    header = {"__metadata__": meta} if meta else {}
    blobs, offset = [], 0
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"k3ref.save: {name!r} is not a tensor name")
        code, shape, data = _as_stored(name, t)
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    # Keys sorted and UTF-8 unescaped, as the C++ writer's JSON library writes them, so that a
    # file k3ref wrote and rewritten here is the same bytes.
    text = json.dumps(header, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for b in blobs:
                f.write(b)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
