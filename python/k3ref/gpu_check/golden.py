"""Reads k3ref golden files (safetensors) into torch tensors, without the safetensors package."""
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
}
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass
class GoldenCase:
    name: str
    op: str
    params: dict
    tensors: dict
    outputs: list
    metadata: dict = field(default_factory=dict)
    path: str = None

    @property
    def inputs(self):
        return {k: v for k, v in self.tensors.items() if k not in self.outputs}

    @property
    def expected(self):
        return {k: self.tensors[k] for k in self.outputs if k in self.tensors}


def read_safetensors(path):
    """Returns (tensors, metadata). Little-endian data as the format specifies."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        buf = bytearray(data[begin:end])
        if len(buf) == 0:
            t = torch.empty(0, dtype=dtype)
        elif dtype in _BITS:
            t = torch.frombuffer(buf, dtype=_BITS[dtype]).view(dtype)
        else:
            t = torch.frombuffer(buf, dtype=dtype)
        tensors[name] = t.reshape(entry["shape"]).clone()
    return tensors, header.get("__metadata__", {})


def load_case(path):
    tensors, meta = read_safetensors(path)
    return GoldenCase(
        name=meta.get("k3ref.case", Path(path).stem),
        op=meta.get("k3ref.op", ""),
        params=json.loads(meta.get("k3ref.params", "{}")),
        tensors=tensors,
        outputs=[s for s in meta.get("k3ref.outputs", "").split(",") if s],
        metadata=meta,
        path=str(path),
    )


def load_suite(directory, ops=("kda.recurrent",)):
    """All cases of the golden directory whose operator is one of `ops`, by name. The KDA
    checks use the recurrent-form cases (o and final_state of the forward); the chunkwise
    families' files hold per-stage tensors under their own conventions."""
    cases = []
    for path in sorted(Path(directory).glob("*.safetensors")):
        case = load_case(path)
        if case.op in ops:
            cases.append(case)
    return cases


_CODES = {v: k for k, v in _DTYPES.items()}


def write_safetensors(path, tensors, metadata):
    """Writes tensors (name -> torch tensor, in the given order) and string metadata in the
    layout of k3ref's writer (docs/golden-format.md): contiguous data in order, the JSON
    header padded with spaces to a multiple of 8 bytes, written to a temporary file renamed
    into place."""
    header = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        raw = t.view(_BITS[t.dtype]) if t.dtype in _BITS else t
        data = raw.numpy().astype(raw.numpy().dtype.newbyteorder("<"), copy=False).tobytes() if t.numel() else b""
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    tmp.replace(path)
