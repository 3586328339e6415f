"""The roofline column of k3ref.gpu_check.bench on the CPU: its table and its measurements/
file from a run's rows (the timings themselves need a GPU: gpu_check/device_layers.sh). The
fractions are the model's work over the measured time over the measured peak, and the file
renders with tools/render_measurements.py."""
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
from k3ref import cost  # noqa: E402
from k3ref.gpu_check import bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_measurements", ROOT / "tools" / "render_measurements.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_run():
    peaks = {"bf16_flops": 800e12, "fp32_flops": 50e12, "copy_bytes": 4e12, "tf32_allowed": False}
    work = cost.prefill(tokens=4096, head_dim=128, chunk=64, heads=96)["total"]
    ms = 2.0
    row = {"kernel": "fla.chunk_kda", "mode": "prefill", "T": 4096, "heads": 96, "K": 128, "V": 128,
           "model": "prefill C=64", "flops": work["flops"], "bytes": work["bytes"], "ms": ms}
    sec = ms / 1e3
    row.update({"flops_per_second": work["flops"] / sec, "bytes_per_second": work["bytes"] / sec,
                "fraction_bf16_peak": work["flops"] / sec / peaks["bf16_flops"],
                "fraction_fp32_peak": work["flops"] / sec / peaks["fp32_flops"],
                "fraction_copy_bandwidth": work["bytes"] / sec / peaks["copy_bytes"]})
    return {"device": "stand-in", "heads": 96, "peaks": peaks,
            "rows": [row, {"kernel": "flashkda.fwd", "error": "not loaded: ModuleNotFoundError: No module named 'flash_kda'"}]}


def test_the_table_names_every_row_and_the_peaks():
    text = bench.roofline_table(fake_run())
    assert "bf16 800 TFLOP/s" in text and "copy 4000 GB/s" in text
    assert "fla.chunk_kda" in text and "T=4096" in text and "flashkda.fwd" in text and "not loaded" in text


def test_the_measurement_file_renders(tmp_path):
    m = bench.roofline_measurement(fake_run(), "python3 -m k3ref.gpu_check.bench --roofline")
    (tmp_path / "measurements").mkdir()
    (tmp_path / "measurements" / f"{m['id']}.json").write_text(json.dumps(m))
    r = _renderer()
    loaded = r.load_measurements(tmp_path)
    rows = loaded[m["id"]]["tables"]["roofline"]["rows"]
    assert rows[0]["gflop"] == pytest.approx(cost.prefill(tokens=4096, head_dim=128, chunk=64, heads=96)["total"]["flops"] / 1e9)
    assert rows[1]["model"].startswith("not loaded")
    text = r.render_table(loaded[m["id"]], "roofline")
    assert "fla.chunk_kda" in text and "%" in text
