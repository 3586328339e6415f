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

from conftest import needs_core


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


@needs_core  # the correct kernel is k3ref's own recurrence
def test_own_inputs_to_a_verdict(tmp_path):
    # A newcomer's path: own tensors -> k3ref.save -> `k3ref kda` -> its golden -> the verdict.
    exe = os.environ.get("K3REF_EXE")
    if not exe:
        pytest.skip("K3REF_EXE not set (meson test sets it)")
    from k3ref.testing import assert_kda_close

    g = torch.Generator().manual_seed(11)
    bf = lambda *s, lo=-1.0, hi=1.0: (torch.rand(*s, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(torch.bfloat16)
    mine = dict(q=bf(1, 20, 1, 16), k=bf(1, 20, 1, 16), v=bf(1, 20, 1, 16), g=bf(1, 20, 1, 16, lo=-0.5, hi=0.0),
                beta=bf(1, 20, 1, lo=0.0, hi=1.0))
    k3ref.save(tmp_path / "mine.safetensors", mine)
    r = subprocess.run([exe, "kda", "--in", str(tmp_path / "mine.safetensors"), "--out", str(tmp_path / "ref.safetensors"),
                        "--no-final-state"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    case = goldens.load_case(tmp_path / "ref.safetensors")
    assert case.op == "kda.recurrent" and case.recommended_policies == {"o": "recurrent"}
    kernel_o = k3ref.kda(mine)["o"].to(torch.bfloat16)  # a correct bf16 kernel
    assert_kda_close((kernel_o,), case)
    with pytest.raises(AssertionError, match="o: "):
        assert_kda_close((-kernel_o,), case)
