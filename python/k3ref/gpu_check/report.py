"""The reports of a run: report.html (what a person reads: the verdict, the kernels x checks
table, then each failure with its numbers, its worst element and its plot), report.json (the
raw results and the summary), report.xml (JUnit), plots/*.png (matplotlib; when matplotlib
cannot be imported the report says that plots were left out)."""
import html
import json
import math
import os
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path


def _finite(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def write_json(path, results, summary):
    def clean(o):
        if isinstance(o, float):
            return o if math.isfinite(o) else str(o)
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, list):
            return [clean(v) for v in o]
        return o

    with open(path, "w") as f:
        json.dump(clean({"summary": summary, "results": [asdict(r) for r in results]}), f, indent=1)


def table(results, adapters=None):
    """Rows: adapters; columns: checks; cells: status and ratio (golden: worst ratio over cases)."""
    checks = _checks_present(results)
    rows = {}
    for r in results:
        row = rows.setdefault(r.adapter, {})
        if r.check == "all":
            for c in checks:
                row[c] = ("skip", None, 0, 0)
            continue
        st, ratio, n_pass, n_total = row.get(r.check, ("pass", None, 0, 0))
        if r.status == "skip":
            row.setdefault(r.check, ("skip", None, 0, 0))
            continue
        order = {"pass": 0, "skip": 0, "fail": 2, "error": 3}
        new_st = r.status if order[r.status] > order.get(st, 0) else (st if st != "skip" else r.status)
        new_ratio = ratio if r.ratio is None else (r.ratio if ratio is None else max(ratio, r.ratio))
        row[r.check] = (new_st, new_ratio, n_pass + (r.status == "pass"), n_total + 1)
    return checks, rows


def markdown_table(results):
    checks, rows = table(results)
    lines = ["| kernel | " + " | ".join(checks) + " |", "|---" * (len(checks) + 1) + "|"]
    for adapter, row in rows.items():
        cells = []
        for c in checks:
            st, ratio, n_pass, n_total = row.get(c, ("-", None, 0, 0))
            cell = st
            if c == "golden" and n_total:
                cell = f"{st} {n_pass}/{n_total}"
            if ratio is not None and math.isfinite(ratio) and ratio > 0:
                cell += f" ({ratio:.3g}x)" if c != "golden" or "reference" not in adapter else f" ({ratio:.1e})"
            cells.append(cell)
        lines.append(f"| {adapter} | " + " | ".join(cells) + " |")
    return "\n".join(lines)



CHECK_ORDER = ["load", "golden", "causality", "suffix", "varlen", "split", "determinism", "poisoned_memory",
               "inputs_unchanged"]


def _checks_present(results):
    seen = [c for c in CHECK_ORDER if any(r.check == c for r in results)]
    return seen + sorted({r.check for r in results} - set(seen) - {"all"})


def reference_versions(golden_dir=None):
    """What the verdict was judged against: k3ref (version and source: the git commit of its
    checkout, else a hash of its files), the golden suite (generator version and the sha256
    of its MANIFEST.json) and the policy table (its sha256)."""
    import k3ref
    from .. import goldens, policy
    from .protocol import source_identity

    v = {"k3ref": f"{getattr(k3ref, '__version__', '?')}, {source_identity(k3ref)}"}
    try:
        directory = goldens.directory(golden_dir)
        generator = (goldens.manifest(directory) or {}).get("generator_version", "?")  # the bounded reader
        digest = goldens.sha256_of_file(directory / "MANIFEST.json")
        v["golden_suite"] = f"{directory}: generator version {generator}, MANIFEST.json sha256 {digest}"
    except (OSError, ValueError) as e:
        v["golden_suite"] = f"unknown ({e})"
    try:
        v["policy_table"] = f"{policy.table_path()}: sha256 {goldens.sha256_of_file(policy.table_path())}"
    except (OSError, ValueError) as e:
        v["policy_table"] = f"unknown ({e})"
    return v


def versions(golden_dir=None):
    """Versions the verdict depends on: k3ref, the golden suite and the policy table it judged
    by, Python, PyTorch, Triton, the CUDA driver and runtime, the GPU."""
    v = {**reference_versions(golden_dir), "python": platform.python_version(), "torch": torch_version(),
         "triton": None, "cuda_driver": None, "cuda_runtime": None, "gpu": None, "host": platform.node(),
         "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR", "(Triton's default, ~/.triton/cache)")}
    try:
        from importlib.metadata import version

        v["triton"] = version("triton")
    except Exception:
        v["triton"] = "absent (not installed)"
    try:
        import torch

        v["cuda_runtime"] = torch.version.cuda
        if torch.cuda.is_available():
            v["gpu"] = torch.cuda.get_device_name()
    except Exception:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        v["cuda_driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else \
            f"unknown (nvidia-smi exit {out.returncode})"
    except (OSError, subprocess.SubprocessError):
        v["cuda_driver"] = "absent (no nvidia-smi)"
    return v


def torch_version():
    try:
        import torch

        return torch.__version__
    except Exception:
        return None


def summary(rows, results, kernels, device, seconds, passed, failures, n_goldens, golden_dir=None, versions_=None):
    """The run's summary: verdict, counts, kernels (static facts, availability and time split),
    mutants, versions."""
    verdicts = [v for _, v, _, _ in rows]
    mutants = {t.adapter.name: {"verdict": v, "reason": reason} for t, v, reason, _ in rows if t.mutant}
    return {
        "verdict": "PASS" if passed else "FAIL",
        "failures": failures,
        "device": device,
        "versions": versions_ or versions(golden_dir),
        "goldens": n_goldens,
        "seconds": round(seconds, 2),
        "tests": len(rows),
        "results": len(results),
        "executed": sum(r.status != "skip" and not (r.extra or {}).get("no_result") for r in results),
        "passed": verdicts.count("pass"),
        "failed": verdicts.count("fail"),
        "skipped": verdicts.count("skip"),
        "xfailed": verdicts.count("xfail"),
        "kernels": kernels,
        "mutants": mutants,
        "mutants_caught": sum(m["verdict"] == "pass" for m in mutants.values()),
        "matplotlib": _matplotlib_status(),
    }


# --------------------------------------------------------------------------- from pytest's reports

def stderr_summary(tail):
    """One line from a process's stderr: Python's fatal-error line and the innermost frame when
    faulthandler printed them (abort, segfault), else the last line that is not empty."""
    lines = [l.strip() for l in tail.splitlines() if l.strip()]
    if not lines:
        return "(nothing on stderr)"
    at = next((i for i, l in enumerate(lines) if l.startswith("Fatal Python error")), None)
    if at is not None:
        # faulthandler lists the thread that failed first ("Current thread"), most recent call first
        current = next((i for i in range(at, len(lines)) if lines[i].startswith("Current thread")), at)
        frames = [l for l in lines[current:] if l.startswith("File ")]
        # What the process printed just before it died (a C++ assertion, a CUDA error).
        said = [l for l in lines[:at] if not l.startswith(("File ", "Thread ", "Current thread", "Extension modules"))]
        return ((said[-1] + "; ") if said else "") + lines[at] + (f"; innermost frame: {frames[0]}" if frames else "")
    return lines[-1]


def crash_excerpt(text, limit=3000):
    """What a report keeps of a dead worker's stderr: with a fatal-error report, what was
    printed just before it and the failing thread's stack (other threads' stacks come after
    and would push both out of a plain tail); else the tail."""
    at = text.find("Fatal Python error")
    if at < 0:
        return text[-limit:]
    current = text.find("Current thread", at)
    end = text.find("\nThread 0x", current) if current >= 0 else -1
    end = len(text) if end < 0 else end
    before = text[max(0, at - limit // 3):at]
    fatal = text[at:text.find("\n", at) + 1 or len(text)]
    stack = text[current:end] if current >= 0 else text[at + len(fatal):end]
    return (before + fatal + stack)[: limit]


def crash_reason(stderr_text, check_timeout=None):
    """Why a worker died while running a test, in one line, from the end of its stderr."""
    if "Timeout (" in stderr_text and "Fatal Python error" not in stderr_text:  # faulthandler's timer
        return (f"timed out: the check ran past its limit of {check_timeout:g} s (run: --check-timeout, pytest: "
                f"--k3ref-check-timeout; plus the load timeout when it loaded its kernel); its worker was stopped"
                if check_timeout else "timed out; its worker was stopped")
    if not stderr_text.strip():
        return "the worker process ended while running this check, with nothing on stderr (os._exit or a kill)"
    return f"the worker process died while running this check: {stderr_summary(stderr_text)}"


def result_record(r):
    """A CheckResult as JSON-able data (what a worker sends the controller)."""
    def clean(o):
        if isinstance(o, float):
            return o if math.isfinite(o) else str(o)
        if isinstance(o, dict):
            return {str(k): clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        if o is None or isinstance(o, (str, int, bool)):
            return o
        return str(o)

    return clean(asdict(r))


def _result_of(d):
    """The CheckResult of a record (result_record's inverse: non-finite numbers, which JSON
    carries as strings, are numbers again; reasons and names stay text)."""
    from .protocol import CheckResult

    def restore(o):
        if isinstance(o, str) and o in ("nan", "inf", "-inf"):
            return float(o)
        if isinstance(o, list):
            return [restore(x) for x in o]
        if isinstance(o, dict):
            return {k: (v if k in ("reason", "traceback", "stderr_tail") else restore(v)) for k, v in o.items()}
        return o

    d = dict(d)
    for key in ("ratio", "metrics", "windows", "seconds", "extra"):
        d[key] = restore(d.get(key))
    return CheckResult(**d)


class _Row:
    """What the report reads of a test: its id, adapter name, check, case and whether it is a
    mutant's test."""

    def __init__(self, entry):
        self.id = entry["id"]
        self.check, self.case = entry["check"], entry["case"]
        self.mutant = entry.get("mutant") is not None

        class _A:
            name = entry["adapter"]

        self.adapter = _A


def _timing_of(results, loaded, crashed=()):
    t = {"children_started": 0, "startup_and_import_s": 0.0, "compile_s": 0.0, "compiles": 0, "autotune_s": 0.0,
         "configs_benchmarked": 0, "check_s": 0.0, "checks_run": 0, "wall_s": 0.0, "triton": None,
         "compile_timing": "", "autotune_timing": ""}
    # The processes that loaded it: those that sent a record of their load, and those that died
    # with it (a crash sends none), each counted once by its process id.
    t["children_started"] = len({str(info.get("pid")) for info in loaded} | {str(p) for p in crashed})
    for info in loaded:
        t["startup_and_import_s"] += info.get("import_s", 0.0)
        status = info.get("timing") or {}
        t["triton"], t["compile_timing"], t["autotune_timing"] = (status.get("triton"), status.get("compile", ""),
                                                                  status.get("autotune", ""))
    for r in results:
        cost = (r.extra or {}).get("timing")
        if not cost:
            continue
        t["compile_s"] += cost.get("compile_s", 0.0)
        t["compiles"] += cost.get("compiles", 0)
        t["autotune_s"] += cost.get("autotune_s", 0.0)
        t["configs_benchmarked"] += cost.get("configs_benchmarked", 0)
        t["check_s"] += max(0.0, cost.get("wall_s", 0.0) - cost.get("compile_s", 0.0) - cost.get("autotune_s", 0.0))
        t["checks_run"] += 1
        t["wall_s"] += cost.get("wall_s", 0.0)
    t["wall_s"] += t["startup_and_import_s"]
    return t


def test_rows(plan, reports, wanted):
    """(rows, results, loaded_by) of the plan's tests in `wanted` (node ids), in the plan's
    order: each row (test, verdict, one-line reason, its CheckResults) from pytest's reports of
    it; a test without any is an error with no result."""
    from .protocol import CheckResult

    rows, results = [], []
    loaded_by = {}   # adapter -> [what loading gave, one per process that loaded it]
    for e in plan["tests"]:
        if e["nodeid"] not in wanted:
            continue  # deselected (-k, --deselect)
        row = _Row(e)
        reps = reports.get(e["nodeid"], [])
        record = None
        for rep in reps:
            record = record_of(rep) or record
        failed = [rep for rep in reps if rep.failed]
        skipped = [rep for rep in reps if rep.skipped and not hasattr(rep, "wasxfail")]
        xfailed = [rep for rep in reps if hasattr(rep, "wasxfail") and rep.skipped]
        if record is not None:
            rs = [_result_of(d) for d in record["results"]]
            if record.get("loaded") is not None:
                loaded_by.setdefault(e["adapter"], {})[json.dumps(record["loaded"], sort_keys=True)] = record["loaded"]
        elif failed or (xfailed and record is None):  # the worker died (or setup failed): pytest's report says why
            text = str((failed or xfailed)[0].longrepr)
            rs = [CheckResult(e["adapter"], e["check"], e["case"], "error", text.splitlines()[0][:600] if text else
                              "failed without a result", extra={"crash": True, "stderr_tail": text[-3000:]})]
        elif skipped:
            rs = [CheckResult(e["adapter"], e["check"], e["case"], "skip", _skip_reason(skipped[0]))]
        else:
            rs = [CheckResult(e["adapter"], e["check"], e["case"], "error", "no result: the test did not run to the "
                              "end (the run was stopped, or its worker could not be replaced)",
                              extra={"crash": True, "no_result": True})]
        if failed:
            verdict = "fail"
            reason = record["reason"] if record and record["verdict"] == "fail" else (
                f"{e['xfail']} -- but it passed: the limitation is gone, remove its entry" if e.get("xfail") and record
                and record["verdict"] == "pass" else rs[0].reason)
        elif xfailed:
            verdict, reason = "xfail", f"{e['xfail']} ({rs[0].status}: {(record or {}).get('reason') or rs[0].reason})"
        elif skipped or (record and record["verdict"] == "skip"):
            verdict, reason = "skip", (record or {}).get("reason") or rs[0].reason
        elif record is not None and record["verdict"] == "pass":
            verdict, reason = "pass", record["reason"]
        else:
            verdict, reason = "fail", rs[0].reason
        for r in rs:
            r.extra["test_id"] = e["id"]
        rows.append((row, verdict, reason, rs))
        results += rs
    return rows, results, loaded_by


def from_pytest(plan, reports, collected, seconds, versions_=None, crashes=None):
    """The run as the report shows it, from the plan and pytest's reports of its tests
    (reports: node id -> [TestReport], each call report carrying the worker's record in
    `report.k3ref`). A collected test with no result, or a run in which no check executed,
    fails the run. Returns {rows, results, failures, passed, summary}."""
    wanted = set(collected) if collected is not None else {e["nodeid"] for e in plan["tests"]}
    rows, results, loaded_by = test_rows(plan, reports, wanted)
    failures = [f"FAIL {t.id}: {reason}" for t, v, reason, _ in rows if v == "fail"]
    if sum(r.status != "skip" and not r.extra.get("no_result") for r in results) == 0:
        failures.append("FAIL: no check was executed (every test was skipped or nothing was collected)")
    kernels = {}
    for name, facts in plan["adapters"].items():
        loaded = list(loaded_by.get(name, {}).values())
        first = loaded[0] if loaded else {}
        kernels[name] = {**{k: facts[k] for k in ("family", "kind", "policy", "policy_reason", "contract",
                                                  "asked_for")},
                         "available": first.get("available"), "unavailable_reason": first.get("reason") or "",
                         "version": first.get("version", ""),
                         "timing": _timing_of([r for r in results if r.adapter == name], loaded,
                                              (crashes or {}).get(name, set())) if loaded or (crashes or {}).get(name)
                         else None}
    passed = not failures
    s = summary(rows, results, kernels, plan["device"], seconds, passed, failures, plan["n_goldens"],
                golden_dir=plan.get("golden_dir"), versions_=versions_)
    s.update(plan.get("speed") or {})
    s["run_options"] = plan.get("run_options")  # what the run was given, as its processes read it
    return {"rows": rows, "results": results, "failures": failures, "passed": passed, "summary": s}


def timeline(reports, t0, marks):
    """Where a run's wall time went, from the spans its workers stamped on their records:
    seconds from the controller's start (t0) to the plan (the mark 'plan ready'), and per
    process its first test's start, its last test's end, its tests and the seconds inside them
    (busy); `marks` (name -> time: the plan ready, the session's start and finish, each
    worker's end of collection and its end) as seconds from t0."""
    workers = {}
    for reps in reports.values():
        for rep in reps:
            span = (record_of(rep) or {}).get("span")
            if not span:
                continue
            name, start, end = span
            w = workers.setdefault(name, {"first_start_s": start - t0, "last_end_s": end - t0, "tests": 0,
                                          "busy_s": 0.0})
            w["first_start_s"], w["last_end_s"] = min(w["first_start_s"], start - t0), max(w["last_end_s"], end - t0)
            w["tests"] += 1
            w["busy_s"] += end - start
    marks_s = {k: round(v - t0, 3) for k, v in sorted(marks.items(), key=lambda kv: kv[1])}
    return {"plan_ready_s": marks_s.get("plan ready"), "marks_s": marks_s,
            "last_end_s": max((round(w["last_end_s"], 3) for w in workers.values()), default=None),
            "workers": {k: {x: round(v, 3) if isinstance(v, float) else v for x, v in w.items()}
                        for k, w in sorted(workers.items())}}


def record_of(rep):
    """The worker's record a test's report carries (None: none, or unreadable)."""
    try:
        return json.loads(rep.k3ref) if getattr(rep, "k3ref", None) else None
    except (TypeError, ValueError):
        return None


def scale_from_pytest(plan, reports, wanted, seconds):
    """What scale.json holds (scale.state: tier, limits, device, results rows, summary, wall_s)
    of a --k3ref-tier scale run, from pytest's reports of the tests in `wanted` (node ids): the
    rows of the reference's and the kernels' cases (a mutant's `caught` test is its verdict
    in the summary)."""
    from .registry import tier

    rows, _, _ = test_rows(plan, reports, wanted)
    results = [r for t, _, _, rs in rows if t.check != "caught" for r in rs]
    kinds = {name: facts["kind"] for name, facts in plan["adapters"].items()}
    s = plan["scale"]
    state = tier("scale").state(results, kinds, set(plan["requested"]), s["limits"], plan["device"], s.get("gpu"), seconds)
    state["run_options"] = plan.get("run_options")
    return state


def write_scale(directory, result):
    """DIR/scale.json, replaced atomically (a reader sees the last whole state)."""
    from .protocol import write_json

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_json(result, directory / "scale.json", indent=1, default=str)
    return directory / "scale.json"


def _skip_reason(rep):
    lr = rep.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2]).removeprefix("Skipped: ")
    return str(lr)


def timing_lines(summary):
    out = []
    for name, k in summary["kernels"].items():
        t = k.get("timing")
        if t and t["checks_run"]:
            out.append(f"time {name}: {t['children_started']} process(es) loaded it, start-up+import "
                       f"{t['startup_and_import_s']:.1f} s, Triton compile {t['compile_s']:.1f} s ({t['compiles']}), "
                       f"autotune {t['autotune_s']:.1f} s ({t['configs_benchmarked']} configs), checks "
                       f"{t['check_s']:.1f} s, wall {t['wall_s']:.1f} s")
    return out


def _matplotlib_status():
    """"available", or why not: found without importing it (pyplot's import is about a second,
    and a run with nothing to plot needs none)."""
    import importlib.util

    try:
        if importlib.util.find_spec("matplotlib") is None:
            raise ImportError("No module named 'matplotlib'")
    except Exception as e:
        return f"not importable ({type(e).__name__}: {e})"
    return "available"


def _matplotlib():
    """(pyplot, "available"), or (None, why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt, "available"
    except Exception as e:
        return None, f"not importable ({type(e).__name__}: {e})"


def _slug(text):
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def plot_failure(plt, res, path):
    """A plot of the failing tensor of a golden check: o's error by token window, or the final
    state's error by (sequence, value head); None when there is nothing to plot."""
    extra = res.extra if isinstance(res.extra, dict) else {}
    rows = extra.get("final_state_rows")
    if extra.get("worst_tensor") == "final_state" and rows:
        ys = [x for seq in rows for x in seq]
        xs, style = list(range(len(ys))), dict(marker="o", linestyle="none")
        label, floor = "rel RMS of the final state per (sequence, head)", extra.get("final_state_floor")
        xlabel, tensor = f"sequence x {len(rows[0])} + value head", "final_state"
    elif res.windows:
        ys, xs, style = res.windows, [i * res.window_tokens for i in range(len(res.windows))], dict(marker=".")
        label, floor = "rel RMS of o per window", (res.metrics or {}).get("floor_rel_rms")
        xlabel, tensor = f"token (windows of {res.window_tokens})", "o"
    else:
        return None
    fig, ax = plt.subplots(figsize=(6, 2.8))
    ax.semilogy(xs, [max(y, 1e-18) for y in ys], label=label, **style)
    if floor:
        ax.axhline(floor, color="grey", linestyle="--", label="bf16 floor (whole tensor)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("relative RMS error")
    ax.set_title(plot_title(res, tensor), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_title(res, tensor):
    """The title of a failure's plot, also the image's title in the HTML (what a reader of the
    page, or a test of it, sees without reading pixels)."""
    return f"{res.adapter} {res.case}: {tensor}"


def failure_groups(rows, least=3):
    """Failures that share a cause, for the report's summary: (adapter, check, failing tensor)
    with at least `least` tests -> their test ids, in order; the rest stay one line each."""
    groups = {}
    for t, v, reason, rs in rows:
        if v != "fail":
            continue
        tensor = next((r.extra.get("worst_tensor") for r in rs if isinstance(r.extra, dict)
                       and r.extra.get("worst_tensor")), None)
        status = "crashed" if any((r.extra or {}).get("crash") for r in rs) else "failed"
        groups.setdefault((t.adapter.name, t.check, tensor, status), []).append((t, rs))
    return {k: g for k, g in groups.items() if len(g) >= least}


def write_all(out, rows, results, summary):
    """report.json and report.html (and plots/) into `out`; the JUnit file is pytest's
    (--junitxml)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "report.json", results, summary)
    write_html(out / "report.html", rows, results, summary)


def _fmt(x):
    if isinstance(x, float):
        return f"{x:.4g}"
    return html.escape(str(x))


def write_html(path, rows, results, summary):
    """The report a person reads. `rows`: (test, verdict, reason, results) of collection."""
    path = Path(path)
    plt, mpl = None, _matplotlib_status()  # pyplot imported at the first plot
    plots_dir = path.parent / "plots"
    verdict_of = {}
    for t, v, reason, rs in rows:
        for r in rs:
            verdict_of[id(r)] = (v, reason, t.id)
    checks = _checks_present(results)
    colour = {"pass": "#cfc", "fail": "#fcc", "error": "#f99", "skip": "#eee", "xfail": "#ffd"}
    ok = summary.get("verdict") == "PASS"
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>k3ref gpu_check</title>",
           "<style>body{font-family:sans-serif;font-size:13px;max-width:1400px}td,th{border:1px solid #999;"
           "padding:3px 6px;vertical-align:top}table{border-collapse:collapse}h1.pass{color:#060}h1.fail{color:#a00}"
           "</style></head><body>",
           f"<h1 class='{'pass' if ok else 'fail'}'>{'PASS' if ok else 'FAIL'}</h1>",
           f"<p>{summary.get('tests', 0)} tests: {summary.get('passed', 0)} passed, {summary.get('failed', 0)} failed, "
           f"{summary.get('skipped', 0)} skipped, {summary.get('xfailed', 0)} known limitations; "
           f"{summary.get('executed', 0)} checks executed in {summary.get('seconds', 0)} s on "
           f"{html.escape(str(summary.get('device')))}. Raw results: <a href='report.json'>report.json</a>, "
           f"JUnit: <a href='report.xml'>report.xml</a> (when --junitxml wrote it there).</p>"]
    if summary.get("failures"):
        grouped = failure_groups(rows)
        in_group = {t.id for g in grouped.values() for t, _ in g}
        items = []
        for (adapter, check, tensor, status), g in grouped.items():
            ratios = [r.ratio for _, rs in g for r in rs if isinstance(r.ratio, float) and math.isfinite(r.ratio)]
            span = f", {min(ratios):.3g}x to {max(ratios):.3g}x" if ratios else ""
            links = ", ".join(f"<a href='#{_slug(t.id)}'>{html.escape(t.case)}</a>" for t, _ in g)
            items.append(f"<li>{len(g)} {html.escape(check)} tests of {html.escape(adapter)} {status}"
                         + (f" on {html.escape(tensor)}" if tensor else "") + f"{span}: {links}</li>")
        for line in summary["failures"]:
            tid = line.split(":")[0][5:]
            if tid not in in_group:
                items.append(f"<li><a href='#{_slug(tid)}'>{html.escape(line)}</a></li>")
        out.append("<ul>" + "".join(items) + "</ul>")
    if plt is None:
        out.append(f"<p><b>Plots were left out:</b> matplotlib is {html.escape(mpl)}.</p>")
    # kernels x checks
    cells = {}
    for r in results:
        v, reason, tid = verdict_of.get(id(r), (r.status, r.reason, ""))
        if r.adapter.startswith("mutant.") or (v == "pass" and r.status in ("fail", "error")):
            v = r.status  # a mutant's cells show what the check did; its verdict is its row's
        cells.setdefault((r.adapter, r.check), []).append((v, r, tid))
    out.append("<h2>kernels x checks</h2><p>golden: tests passed / run and the worst ratio to the policy's floor "
               "over every output (o, the final state), with the tensor it is of; "
               "other checks: ratio of the difference to the nominal floor. Cells link to the failures. Mutants are "
               "meant to be caught (their cells fail).</p><table><tr><th>kernel</th>"
               + "".join(f"<th>{c}</th>" for c in checks) + "</tr>")
    for name in dict.fromkeys(r.adapter for r in results):
        out.append(f"<tr><td>{html.escape(name)}</td>")
        for c in checks:
            entries = cells.get((name, c), [])
            if not entries:
                out.append("<td>-</td>")
                continue
            order = {"error": 4, "fail": 3, "xfail": 2, "pass": 1, "skip": 0}
            worst = max(entries, key=lambda e: order.get(e[0], 0))
            ran = [e for e in entries if e[0] != "skip"]
            ratios = [e[1].ratio for e in ran if e[1].ratio is not None and math.isfinite(e[1].ratio)]
            txt = worst[0] + (f" {sum(e[0] == 'pass' for e in ran)}/{len(ran)}" if len(entries) > 1 else "")
            if ratios:
                # the worst ratio over every output of every case, and the tensor it is of
                at = max((e for e in ran if e[1].ratio is not None and math.isfinite(e[1].ratio)),
                         key=lambda e: e[1].ratio)
                tensor = at[1].extra.get("worst_tensor") if isinstance(at[1].extra, dict) else None
                txt += f" ({max(ratios):.3g}x{' ' + tensor if tensor else ''})"
            title = ""
            if worst[0] == "skip":
                unavailable = isinstance(worst[1].extra, dict) and worst[1].extra.get("unavailable")
                # A kernel that could not load ran nothing: its cells are not applicable (the
                # reason on hover), not skips that read like a pass.
                txt = "n/a" if unavailable or worst[1].reason.startswith("n/a") else "skip: " + worst[1].reason[:60]
                title = f" title='{html.escape(worst[1].reason, quote=True)}'"
            cell = html.escape(txt)
            if worst[0] in ("fail", "error", "xfail") and worst[2]:
                cell = f"<a href='#{_slug(worst[2])}'>{cell}</a>"
            out.append(f"<td style='background:{colour.get(worst[0], '#fff')}'{title}>{cell}</td>")
        out.append("</tr>")
    out.append("</table>")
    # failures, each with its numbers, worst element and plot
    failing = [(t, v, reason, rs) for t, v, reason, rs in rows if v in ("fail", "xfail")]
    if failing:
        out.append("<h2>failures and known limitations</h2>")
    for t, v, reason, rs in failing:
        out.append(f"<h3 id='{_slug(t.id)}'>{'FAIL' if v == 'fail' else 'known limitation'}: {html.escape(t.id)}</h3>"
                   f"<p>{html.escape(reason)}</p>")
        for r in rs:
            if r.status not in ("fail", "error") and v != "fail":
                continue
            if len(rs) > 1:
                out.append(f"<h4>{html.escape(r.check)}[{html.escape(r.case)}]: {r.status}</h4><p>{html.escape(r.reason)}</p>")
            if r.metrics:
                keys = ("rel_rms", "floor_rel_rms", "floor_ratio", "max_abs", "max_abs_index", "max_ulp",
                        "max_ulp_index", "candidate_nan", "candidate_inf", "first_nonfinite_mismatch", "count")
                named = [("o", r.metrics)] + ([("final_state", r.extra["final_state"])]
                                              if r.extra.get("final_state") else [])
                if r.extra.get("worst_tensor") == "final_state":
                    named.reverse()  # the failing tensor's row first
                out.append("<table><tr><th>tensor</th>" + "".join(f"<th>{k}</th>" for k in keys) + "</tr>"
                           + "".join(f"<tr><td>{name}</td>" + "".join(f"<td>{_fmt(m.get(k))}</td>" for k in keys)
                                     + "</tr>" for name, m in named) + "</table>")
            for key, label in (("worst_element", "worst element of o"), ("final_state_worst_element",
                                                                           "worst element of the final state")):
                w = r.extra.get(key)
                if w:
                    out.append(f"<p>{label}: index {html.escape(str(w['index']))}: candidate {w['candidate']!r}, "
                               f"reference {w['reference']!r}, |error| {w['abs_error']:.4g}</p>")
            if r.extra.get("stderr_tail"):
                out.append("<p>last lines of the worker's stderr:</p><pre>" + html.escape(r.extra["stderr_tail"]) + "</pre>")
            if r.extra.get("traceback"):
                out.append("<details><summary>traceback</summary><pre>" + html.escape(r.extra["traceback"])
                           + "</pre></details>")
            plottable = r.windows or (isinstance(r.extra, dict) and r.extra.get("final_state_rows"))
            if plt is None and mpl == "available" and plottable:
                plt, mpl = _matplotlib()
            if plt is not None and plottable:
                plots_dir.mkdir(parents=True, exist_ok=True)
                stem = t.id if len(rs) == 1 else f"{t.id}-{r.check}-{r.case}"
                png = plot_failure(plt, r, plots_dir / f"{_slug(stem)}.png")
                if png:
                    rel = os.path.relpath(png, path.parent)
                    what = "final_state" if r.extra.get("worst_tensor") == "final_state" and \
                        r.extra.get("final_state_rows") else "o"
                    title = html.escape(plot_title(r, what), quote=True)
                    out.append(f"<p><a href='{rel}'><img src='{rel}' alt='error of {what}' title='{title}'></a></p>")
            elif plottable:
                out.append(f"<p>plot left out: matplotlib is {html.escape(mpl)}</p>")
    # kernels: contract, policy, availability, time split
    out.append("<h2>kernels</h2><table><tr><th>kernel</th><th>kind</th><th>contract</th><th>policy</th>"
               "<th>available</th><th>version</th><th>start-up + import s</th><th>Triton compile s</th>"
               "<th>autotune s</th><th>checking s</th><th>wall s</th><th>timing notes</th></tr>")
    for name, k in (summary.get("kernels") or {}).items():
        t = k.get("timing") or {}
        avail = {True: "yes", False: "no: " + (k.get("unavailable_reason") or ""), None: "not loaded"}[k.get("available")]
        notes = "; ".join(x for x in (f"Triton {t.get('triton')}" if t.get("triton") else "no Triton",
                                     t.get("compile_timing", ""), t.get("autotune_timing", "")) if x) if t else ""
        out.append(f"<tr><td>{html.escape(name)}</td><td>{k['kind']}</td><td>{html.escape(k.get('contract') or '')}</td>"
                   f"<td>{html.escape(str(k.get('policy')))}: {html.escape(k.get('policy_reason') or '')}</td>"
                   f"<td>{html.escape(avail)}</td><td>{html.escape(k.get('version') or '')}</td>"
                   + "".join(f"<td>{t.get(x, 0):.2f}</td>" if t else "<td>-</td>"
                             for x in ("startup_and_import_s", "compile_s", "autotune_s", "check_s", "wall_s"))
                   + f"<td>{html.escape(notes)}</td></tr>")
    out.append("</table>")
    out.append("<h2>versions</h2><table>" + "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
                                                    for k, v in (summary.get("versions") or {}).items()) + "</table>")
    out.append("<h2>all results</h2><table><tr><th>test</th><th>check</th><th>case</th><th>status</th><th>reason</th></tr>")
    for r in results:
        v, _, tid = verdict_of.get(id(r), (r.status, "", ""))
        out.append(f"<tr><td>{html.escape(tid or r.adapter)}</td><td>{r.check}</td><td>{html.escape(r.case)}</td>"
                   f"<td style='background:{colour.get(r.status, '#fff')}'>{r.status}</td><td>{html.escape(r.reason)}</td></tr>")
    out.append("</table></body></html>")
    path.write_text("\n".join(out))
