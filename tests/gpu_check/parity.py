"""The verdicts and figures of a CPU run of the harness, in a form two runners can be compared by.

`record(report_json)` reads a run's report.json and returns {test id: {verdict, status, ratio,
figures}}, figures to 12 significant digits. The committed record (data/cpu_parity.json) was
taken from the runner before the harness moved onto pytest (commit 57806f9: `python3 -m
k3ref.gpu_check run` with its own worker pool); test_runner_parity.py runs today's runner on
the same adapters and inputs and asserts the same record.
"""
import json

FIGURES = ("rel_rms", "floor_rel_rms", "max_abs")
ADAPTER_SPECS = ("examples/torch_kda_adapter.py:TorchKda", "k3ref.gpu_check.adapters:torch_test_kernels",
                 "k3ref.gpu_check.cp_check:cp_adapters")
CP_SETTINGS = ("cp.ranks=2,4", "cp.backend=gloo", "cp.kernel=torch")  # the run's --set


def _digits(x):
    return None if x is None else float(f"{float(x):.12g}")


def record(report_json):
    data = json.loads(open(report_json).read()) if isinstance(report_json, str) else report_json
    out = {}
    for r in data["results"]:
        key = f"{r['adapter']}|{r['check']}|{r['case']}"
        m = r.get("metrics") or {}
        out[key] = {"status": r["status"], "ratio": _digits(r.get("ratio")),
                    "figures": {f: _digits(m.get(f)) for f in FIGURES if m.get(f) is not None}}
    return dict(sorted(out.items()))


def verdicts(junit_xml):
    """{test id: pass | fail | skip} of a run's JUnit file (a strict xfail reads as skip there)."""
    import xml.etree.ElementTree as ET

    out = {}
    for tc in ET.parse(junit_xml).getroot().iter("testcase"):
        name = tc.get("name").rpartition("::")[2]
        state = "pass"
        for child in tc:
            if child.tag in ("failure", "error"):
                state = "fail"
            elif child.tag == "skipped":
                state = "skip"
        out[name] = state
    return dict(sorted(out.items()))


def snapshot(out_dir):
    """The record of a run's report directory: verdicts per test and results per check."""
    from pathlib import Path

    out_dir = Path(out_dir)
    return {"verdicts": verdicts(out_dir / "report.xml"), "results": record(str(out_dir / "report.json"))}
