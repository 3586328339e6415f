"""Writes the results as JUnit XML, JSON and a self-contained HTML report with plots."""
import base64
import html
import io
import json
import math
import xml.etree.ElementTree as ET
from dataclasses import asdict


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


def write_junit(path, results):
    suites = ET.Element("testsuites")
    by_adapter = {}
    for r in results:
        by_adapter.setdefault(r.adapter, []).append(r)
    for adapter, rs in by_adapter.items():
        mutant = adapter.startswith("mutant.")
        suite = ET.SubElement(suites, "testsuite", name=adapter, tests=str(len(rs)),
                              failures=str(sum(r.status == "fail" and not mutant for r in rs)),
                              errors=str(sum(r.status == "error" and not mutant for r in rs)),
                              skipped=str(sum(r.status == "skip" for r in rs)))
        for r in rs:
            tc = ET.SubElement(suite, "testcase", classname=adapter, name=f"{r.check}[{r.case}]", time=f"{r.seconds:.3f}")
            if mutant:
                # A mutant's failing check is the check working; the test case records it as output.
                ET.SubElement(tc, "system-out").text = f"{r.status}: {r.reason}"
            elif r.status == "fail":
                ET.SubElement(tc, "failure", message=r.reason[:500]).text = r.reason
            elif r.status == "error":
                ET.SubElement(tc, "error", message=r.reason[:500]).text = r.extra.get("traceback", r.reason)
            elif r.status == "skip":
                ET.SubElement(tc, "skipped", message=r.reason[:500])
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def _plot(results):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    rs = [r for r in results if r.check == "golden" and r.windows and not r.adapter.startswith("mutant.")]
    if not rs:
        return None
    cases = sorted({r.case for r in rs})
    cols = 4
    rows = (len(cases) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.6 * rows), squeeze=False)
    for ax, case in zip(axes.flat, cases):
        for r in rs:
            if r.case != case:
                continue
            xs = [i * r.window_tokens for i in range(len(r.windows))]
            ys = [max(w, 1e-18) for w in r.windows]
            ax.semilogy(xs, ys, marker=".", label=r.adapter)
        ax.set_title(case, fontsize=8)
        ax.set_xlabel("token", fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(cases):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.suptitle("relative RMS error of o by token window", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def table(results, adapters=None):
    """Rows: adapters; columns: checks; cells: status and ratio (golden: worst ratio over cases)."""
    checks = ["golden", "causality", "suffix", "varlen", "split", "determinism", "poisoned_memory", "inputs_unchanged"]
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


def write_html(path, results, summary):
    img = _plot(results)
    checks, rows = table(results)
    colour = {"pass": "#cfc", "fail": "#fcc", "error": "#f99", "skip": "#eee"}
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>k3ref gpu_check</title>",
           "<style>body{font-family:sans-serif;font-size:13px}td,th{border:1px solid #999;padding:3px 6px}"
           "table{border-collapse:collapse}</style></head><body>",
           "<h1>k3ref gpu_check report</h1>", "<pre>" + html.escape(json.dumps(summary, indent=1)) + "</pre>",
           "<h2>kernels x checks</h2><p>golden: cases passed / run, worst ratio to the bf16 output-rounding floor "
           "(fp64 reference: worst rel RMS); metamorphic: ratio of the difference to the nominal floor. Mutants are "
           "meant to fail.</p><table><tr><th>kernel</th>" + "".join(f"<th>{c}</th>" for c in checks) + "</tr>"]
    for adapter, row in rows.items():
        out.append(f"<tr><td>{html.escape(adapter)}</td>")
        for c in checks:
            st, ratio, n_pass, n_total = row.get(c, ("-", None, 0, 0))
            txt = st + (f" {n_pass}/{n_total}" if c == "golden" and n_total else "")
            if ratio is not None and math.isfinite(ratio) and ratio > 0:
                txt += f" ({ratio:.3g})"
            out.append(f"<td style='background:{colour.get(st, '#fff')}'>{html.escape(txt)}</td>")
        out.append("</tr>")
    out.append("</table>")
    if img:
        out.append(f"<h2>error by token position</h2><img src='data:image/png;base64,{img}'>")
    out.append("<h2>all results</h2><table><tr><th>kernel</th><th>check</th><th>case</th><th>status</th><th>reason</th></tr>")
    for r in results:
        out.append(f"<tr><td>{html.escape(r.adapter)}</td><td>{r.check}</td><td>{html.escape(r.case)}</td>"
                   f"<td style='background:{colour.get(r.status, '#fff')}'>{r.status}</td><td>{html.escape(r.reason)}</td></tr>")
    out.append("</table></body></html>")
    with open(path, "w") as f:
        f.write("\n".join(out))
