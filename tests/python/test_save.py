"""k3ref.save, the documented writer: torch (bf16 by its bits) and NumPy tensors in, a file
that both readers read back bit for bit and the `k3ref` command takes; a write goes through an
exclusive temporary and leaves nothing else behind; bad names and dtypes are one-line errors."""
import os
import subprocess

import numpy as np
import pytest
import torch

import k3ref
from k3ref import _safetensors, goldens


def test_torch_and_numpy_tensors_round_trip_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(5)
    tensors = {"q": torch.randn(1, 3, 1, 4, generator=g).to(torch.bfloat16),
               "h": torch.randn(2, 2, generator=g, dtype=torch.float64), "n": np.arange(6, dtype=np.int64),
               "f": np.float32([1.5, -0.0, np.inf])}
    path = tmp_path / "x.safetensors"
    k3ref.save(path, tensors, {"note": "mine"})
    got, meta = goldens.read_tensors(path, reader="k3ref")
    assert meta["note"] == "mine" and list(got) == ["q", "h", "n", "f"]
    assert got["q"].dtype == torch.bfloat16 and torch.equal(got["q"].view(torch.int16), tensors["q"].view(torch.int16))
    assert torch.equal(got["h"], tensors["h"])
    assert np.array_equal(np.asarray(got["n"]), tensors["n"])
    assert np.array_equal(np.asarray(got["f"]), tensors["f"]) and np.signbit(np.asarray(got["f"])[1])
    assert os.listdir(tmp_path) == ["x.safetensors"]


def test_every_golden_rewritten_by_save_is_the_same_file(tmp_path):
    # The C++ writer made these files; save writes the same bytes from what the reader gives.
    for name in goldens.case_names():
        path = goldens.directory() / f"{name}.safetensors"
        raw = _safetensors.read(path)
        tensors, _ = goldens.read_tensors(path, reader="k3ref")
        k3ref.save(tmp_path / "y.safetensors", tensors, raw.metadata)
        assert (tmp_path / "y.safetensors").read_bytes() == path.read_bytes(), name


def test_the_command_takes_what_save_writes(tmp_path):
    case = goldens.load_case("kda_t1")
    k3ref.save(tmp_path / "in.safetensors", case.inputs)
    exe = os.environ.get("K3REF_EXE")
    if not exe:
        pytest.skip("K3REF_EXE not set (meson test sets it)")
    r = subprocess.run([exe, "kda", "--in", str(tmp_path / "in.safetensors"), "--out", str(tmp_path / "o.safetensors")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("tensors, message", [({"__metadata__": np.zeros(1)}, "is not a tensor name"),
                                              ({"x": np.zeros(1, dtype=np.complex64)}, "complex64 has no"),
                                              ([np.zeros(1)], "must be a mapping")])
def test_what_cannot_be_written_is_a_one_line_error(tmp_path, tensors, message):
    with pytest.raises((TypeError, ValueError), match=message):
        k3ref.save(tmp_path / "z.safetensors", tensors)
    assert os.listdir(tmp_path) == []
