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
import xml.etree.ElementTree as ET
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


def write_junit(path, rows, properties=None):
    """JUnit XML with one test case per collected test (rows of cli.execute: test, verdict,
    reason, results), judged as the run judges it: a verdict 'fail' is a failure (or an
    error when a check crashed or raised), 'skip' and 'xfail' (a known limitation) are
    skipped with their reason, so a JUnit consumer agrees with the exit code. A mutant is
    one test case; what each of its checks did is in system-out."""
    suites = ET.Element("testsuites")
    by_adapter = {}
    for row in rows:
        by_adapter.setdefault(row[0].adapter.name, []).append(row)
    for adapter, rs in by_adapter.items():
        failures = sum(v == "fail" and not any(r.status == "error" for r in res) for _, v, _, res in rs)
        errors = sum(v == "fail" and any(r.status == "error" for r in res) for _, v, _, res in rs)
        suite = ET.SubElement(suites, "testsuite", name=adapter, tests=str(len(rs)), failures=str(failures),
                              errors=str(errors), skipped=str(sum(v in ("skip", "xfail") for _, v, _, _ in rs)))
        if properties:  # what the verdict depends on (versions), for a CI that keeps only the XML
            props = ET.SubElement(suite, "properties")
            for key, value in properties.items():
                ET.SubElement(props, "property", name=str(key), value=str(value))
        for t, v, reason, res in rs:
            seconds = sum(r.seconds for r in res)
            tc = ET.SubElement(suite, "testcase", classname=adapter, name=t.id, time=f"{seconds:.3f}")
            if len(res) > 1:
                ET.SubElement(tc, "system-out").text = "\n".join(f"{r.check}[{r.case}] {r.status}: {r.reason}"
                                                                 for r in res)
            if v == "fail":
                crashed = next((r for r in res if r.status == "error"), None)
                kind = "error" if crashed is not None else "failure"
                detail = (crashed.extra.get("traceback") or crashed.extra.get("stderr_tail") or reason) if crashed \
                    else reason
                ET.SubElement(tc, kind, message=reason[:500]).text = detail
            elif v == "skip":
                ET.SubElement(tc, "skipped", message=reason[:500])
            elif v == "xfail":
                ET.SubElement(tc, "skipped", type="xfail", message=reason[:500])
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


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
    from .adapters import source_identity

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


def summary(rows, results, runner, adapters, requested, device, seconds, passed, failures, n_goldens,
            golden_dir=None):
    from .collection import MutantTest

    verdicts = [v for _, v, _, _ in rows]
    kernels = {}
    for a in adapters:
        loaded = runner.availability(a) or {}
        kernels[a.name] = {"family": a.family, "kind": a.kind, "policy": a.policy, "policy_reason": a.policy_reason,
                           "contract": a.contract, "asked_for": a.name in requested,
                           "available": loaded.get("available"), "unavailable_reason": loaded.get("reason") or
                           loaded.get("error") or "", "version": loaded.get("version", ""),
                           "timing": runner.timing.get(a.name)}
    mutants = {t.adapter.name: {"verdict": v, "reason": reason} for t, v, reason, _ in rows if isinstance(t, MutantTest)}
    return {
        "verdict": "PASS" if passed else "FAIL",
        "failures": failures,
        "device": device,
        "versions": versions(golden_dir),
        "goldens": n_goldens,
        "seconds": round(seconds, 2),
        "tests": len(rows),
        "results": len(results),
        "executed": sum(r.status != "skip" for r in results),
        "passed": verdicts.count("pass"),
        "failed": verdicts.count("fail"),
        "skipped": verdicts.count("skip"),
        "xfailed": verdicts.count("xfail"),
        "kernels": kernels,
        "mutants": mutants,
        "mutants_caught": sum(m["verdict"] == "pass" for m in mutants.values()),
        "matplotlib": _matplotlib()[1],
    }


def _matplotlib():
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
    """Error by token window of a golden check (o), or None when there is nothing to plot."""
    if not res.windows:
        return None
    fig, ax = plt.subplots(figsize=(6, 2.8))
    xs = [i * res.window_tokens for i in range(len(res.windows))]
    ax.semilogy(xs, [max(w, 1e-18) for w in res.windows], marker=".", label="rel RMS of o per window")
    floor = (res.metrics or {}).get("floor_rel_rms")
    if floor:
        ax.axhline(floor, color="grey", linestyle="--", label="bf16 floor (whole tensor)")
    ax.set_xlabel(f"token (windows of {res.window_tokens})")
    ax.set_ylabel("relative RMS error")
    ax.set_title(f"{res.adapter} {res.case}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_all(out, rows, results, summary):
    out = Path(out)
    write_junit(out / "report.xml", rows, summary.get("versions"))
    write_json(out / "report.json", results, summary)
    write_html(out / "report.html", rows, results, summary)


def _fmt(x):
    if isinstance(x, float):
        return f"{x:.4g}"
    return html.escape(str(x))


def write_html(path, rows, results, summary):
    """The report a person reads. `rows`: (test, verdict, reason, results) of collection."""
    path = Path(path)
    plt, mpl = _matplotlib()
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
           f"JUnit: <a href='report.xml'>report.xml</a>.</p>"]
    if summary.get("failures"):
        out.append("<ul>" + "".join(f"<li><a href='#{_slug(line.split(':')[0][5:])}'>{html.escape(line)}</a></li>"
                                    for line in summary["failures"]) + "</ul>")
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
                txt = "n/a" if unavailable else "skip: " + worst[1].reason[:60]
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
                out.append("<table><tr><th>o</th>" + "".join(f"<th>{k}</th>" for k in keys) + "</tr><tr><td></td>"
                           + "".join(f"<td>{_fmt(r.metrics.get(k))}</td>" for k in keys) + "</tr>")
                fs = r.extra.get("final_state")
                if fs:
                    out.append("<tr><td>final_state</td>" + "".join(f"<td>{_fmt(fs.get(k))}</td>" for k in keys) + "</tr>")
                out.append("</table>")
            for key, label in (("worst_element", "worst element of o"), ("final_state_worst_element",
                                                                           "worst element of the final state")):
                w = r.extra.get(key)
                if w:
                    out.append(f"<p>{label}: index {html.escape(json.dumps(w['index']))}: candidate {w['candidate']!r}, "
                               f"reference {w['reference']!r}, |error| {w['abs_error']:.4g}</p>")
            if r.extra.get("stderr_tail"):
                out.append("<p>last lines of the child's stderr:</p><pre>" + html.escape(r.extra["stderr_tail"]) + "</pre>")
            if r.extra.get("traceback"):
                out.append("<details><summary>traceback</summary><pre>" + html.escape(r.extra["traceback"])
                           + "</pre></details>")
            if plt is not None and r.windows:
                plots_dir.mkdir(parents=True, exist_ok=True)
                stem = t.id if len(rs) == 1 else f"{t.id}-{r.check}-{r.case}"
                png = plot_failure(plt, r, plots_dir / f"{_slug(stem)}.png")
                if png:
                    rel = os.path.relpath(png, path.parent)
                    out.append(f"<p><a href='{rel}'><img src='{rel}' alt='error by token window'></a></p>")
            elif r.windows:
                out.append("<p>plot left out: matplotlib is not importable</p>")
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
