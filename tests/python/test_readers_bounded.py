"""The Python readers under the bounded rules: the safetensors reader refuses a FIFO or a device
at once, duplicate header keys (as the C++ reader does), deep nesting; the outputs pattern is
bounded in names and in bytes (as check::expand_outputs)."""
import json
import os
import struct

import pytest

from k3ref import _safetensors
from k3ref.policy import expand_outputs


def file_with_header(path, header_text, data=b""):
    raw = header_text.encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_a_fifo_or_a_device_is_refused_at_once(tmp_path):
    fifo = tmp_path / "x.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(_safetensors.SafetensorsError, match="not a regular file"):
        _safetensors.read(fifo)
    with pytest.raises(_safetensors.SafetensorsError, match="not a regular file"):
        _safetensors.read("/dev/zero")


def test_duplicate_keys_and_deep_nesting_are_refused(tmp_path):
    entry = '{"dtype":"F64","shape":[1],"data_offsets":[0,8]}'
    dup = file_with_header(tmp_path / "dup.safetensors", '{"o":' + entry + ',"o":' + entry + '}', bytes(8))
    with pytest.raises(_safetensors.SafetensorsError, match="duplicate key 'o'"):
        _safetensors.read(dup)
    deep = file_with_header(tmp_path / "deep.safetensors", '{"__metadata__":' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(_safetensors.SafetensorsError, match="nested more than"):
        _safetensors.read(deep)
    good = file_with_header(tmp_path / "ok.safetensors", json.dumps({"o": json.loads(entry)}), bytes(8))
    assert list(_safetensors.read(good).tensors) == ["o"]


def test_output_patterns_are_bounded_in_names_and_bytes():
    assert expand_outputs("{qb,sign}_{bias,loads},o") == ["qb_bias", "qb_loads", "sign_bias", "sign_loads", "o"]
    with pytest.raises(ValueError, match="more than 131072 names"):
        expand_outputs("{a,b}" * 40)
    with pytest.raises(ValueError, match=f"more than {16 << 20} bytes of names"):  # check::expand_outputs's limit
        expand_outputs("{" + ",".join(str(i) for i in range(1000)) + "}" + "x" * 100_000)
