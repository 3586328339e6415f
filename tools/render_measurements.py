#!/usr/bin/env python3
"""Render the measurements of measurements/*.json into the docs' marked blocks.

Each file measurements/ID.json records one measurement (device, versions, date, the k3ref
commit, the commands that produced it) and its numbers as tables of rows and columns. A doc
holds a rendered part of it between marker comments on lines of their own:

    <!-- measurements:ID/source begin -->   where, when, with what, by which command
    <!-- measurements:ID/source end -->
    <!-- measurements:ID/TABLE begin -->    one table of the measurement
    <!-- measurements:ID/TABLE end -->

    python3 tools/render_measurements.py            rewrite every block of docs/*.md
    python3 tools/render_measurements.py --check    exit 1, with one line naming the first
                                                    stale block, when a doc differs

A marker naming an unknown measurement or table, an unclosed block, a malformed file, or a
table that no doc renders is an error (exit 1) in both modes. Standard library only.

A measurement file:

    {"schema": 1, "id": "ID" (= the file's name), "title": "...", "device": "...",
     "date": "YYYY-MM-DD" or null, "date_note": optional text shown beside a null date,
     "k3ref_commit": "hex" or null, "goldens_generator_version": int or null,
     "versions": {"torch", "triton", "cuda", "fla", "flashkda": text or null, ...others},
     "commands": ["..."] (empty: not recorded), "tool": optional text, "notes": [...],
     "tables": {"TABLE": {"columns": [{"key", "title", "format"?}], "rows": [{key: cell}],
                          "params"?: {...}, "caption"?: text, "null"?: text}}}

A cell is null (the table's "null" text, default "-"), a string, a number (through its
column's "format", a str.format template such as "{:.2f}x"), or an object
{"fmt": template, field: value, ...} formatted with its own fields. Exponents are written
without padding (2.5e-2, not 2.5e-02). Titles and the caption are templates over "params".
"""

import argparse
import json
import re
import string
import sys
from pathlib import Path

SCHEMA = 1
REQUIRED_VERSIONS = ("torch", "triton", "cuda", "fla", "flashkda")
VERSION_LABELS = {"torch": "torch", "triton": "Triton", "cuda": "CUDA", "fla": "FLA",
                  "flashkda": "FlashKDA", "driver": "driver", "liger": "Liger-Kernel",
                  "torchtitan": "torchtitan"}
NOT_RECORDED = "not recorded"
MARKER = re.compile(r"^<!-- measurements:([A-Za-z0-9_.-]+)/([A-Za-z0-9_.-]+) (begin|end) -->$")


class RenderError(Exception):
    pass


class _Formatter(string.Formatter):
    def format_field(self, value, format_spec):
        if value is None:
            return NOT_RECORDED
        text = format(value, format_spec)
        if format_spec and format_spec[-1] in "eEg":
            text = re.sub(r"([eE])([+-])0*(\d)",
                          lambda m: m.group(1) + ("-" if m.group(2) == "-" else "") + m.group(3), text)
        return text


_FMT = _Formatter()


def _template(template, where, *args, **kwargs):
    try:
        return _FMT.format(template, *args, **kwargs)
    except (KeyError, IndexError, ValueError, TypeError) as e:
        raise RenderError(f"{where}: template {template!r}: {e!r}") from None


def load_measurements(root):
    out = {}
    for path in sorted((root / "measurements").glob("*.json")):
        where = f"measurements/{path.name}"
        try:
            m = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise RenderError(f"{where}: {e}") from None
        if not isinstance(m, dict) or m.get("schema") != SCHEMA:
            raise RenderError(f"{where}: not a measurement of schema {SCHEMA}")
        if m.get("id") != path.stem:
            raise RenderError(f"{where}: id {m.get('id')!r} is not the file's name")
        for key in ("title", "device", "date", "k3ref_commit", "versions", "commands", "tables"):
            if key not in m:
                raise RenderError(f"{where}: no {key!r}")
        missing = [v for v in REQUIRED_VERSIONS if v not in m["versions"]]
        if missing:
            raise RenderError(f"{where}: versions lack {', '.join(missing)} (null when not recorded)")
        if not isinstance(m["commands"], list) or not isinstance(m["tables"], dict):
            raise RenderError(f"{where}: commands must be a list and tables an object")
        for name, table in m["tables"].items():
            keys = [c.get("key") for c in table.get("columns", [])]
            if not keys or None in keys or len(set(keys)) != len(keys):
                raise RenderError(f"{where}: table {name}: columns need distinct keys")
            for i, row in enumerate(table.get("rows", [])):
                extra = set(row) - set(keys)
                if extra:
                    raise RenderError(f"{where}: table {name} row {i}: unknown columns {sorted(extra)}")
        out[path.stem] = m
    return out


def render_source(m):
    date = m["date"] or NOT_RECORDED
    if m["date"] is None and m.get("date_note"):
        date += f" ({m['date_note']})"
    versions = []
    for key, value in m["versions"].items():
        versions.append(f"{VERSION_LABELS.get(key, key)} {value if value is not None else NOT_RECORDED}")
    lines = [f"- device: {m['device']}; date: {date}; k3ref commit: "
             f"{'`' + m['k3ref_commit'] + '`' if m['k3ref_commit'] else NOT_RECORDED}",
             f"- versions: {', '.join(versions)}"]
    if "goldens_generator_version" in m:
        g = m["goldens_generator_version"]
        lines.append(f"- goldens: {'generator version ' + str(g) if g is not None else NOT_RECORDED}")
    if m.get("tool"):
        lines.append(f"- produced by: {m['tool']}")
    lines.append(f"- data: `measurements/{m['id']}.json`"
                 + ("" if m["commands"] else f"; command: {NOT_RECORDED}"))
    if m["commands"]:
        lines += ["", "```sh"] + list(m["commands"]) + ["```"]
    return "\n".join(lines)


def _cell(value, column, table, where):
    if value is None:
        return table.get("null", "-")
    if isinstance(value, bool):
        raise RenderError(f"{where}: a boolean cell")
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return _template(column.get("format", "{}"), where, value)
    if isinstance(value, dict) and "fmt" in value:
        fields = {k: v for k, v in value.items() if k != "fmt"}
        return _template(value["fmt"], where, **fields)
    raise RenderError(f"{where}: a cell must be null, text, a number or {{\"fmt\": ...}}")


def render_table(m, name):
    table = m["tables"][name]
    where = f"measurements/{m['id']}.json: table {name}"
    params = table.get("params", {})
    cols = table["columns"]
    titles = [_template(c.get("title", c["key"]), where, **params) for c in cols]
    lines = []
    if table.get("caption"):
        lines += [_template(table["caption"], where, **params), ""]
    lines.append("| " + " | ".join(titles) + " |")
    lines.append("|" + "|".join(" --- " for _ in cols) + "|")
    for i, row in enumerate(table["rows"]):
        cells = [_cell(row.get(c["key"]), c, table, f"{where} row {i} column {c['key']}") for c in cols]
        lines.append("| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |")
    return "\n".join(lines)


def render_doc(text, doc, measurements, used):
    """(new text, [(block name, old body, new body)])."""
    out, blocks, lines, i = [], [], text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        hit = MARKER.match(line)
        if hit is None:
            if line.startswith("<!-- measurements:"):
                raise RenderError(f"{doc}:{i + 1}: malformed marker {line!r}")
            out.append(line)
            i += 1
            continue
        mid, part, kind = hit.groups()
        block = f"measurements:{mid}/{part}"
        if kind == "end":
            raise RenderError(f"{doc}:{i + 1}: {block} ends without a begin")
        end = f"<!-- {block} end -->"
        try:
            j = lines.index(end, i + 1)
        except ValueError:
            raise RenderError(f"{doc}:{i + 1}: {block} has no end marker") from None
        inner = lines[i + 1:j]
        if any(MARKER.match(x) for x in inner):
            raise RenderError(f"{doc}:{i + 1}: {block} holds another marker before its end")
        if mid not in measurements:
            raise RenderError(f"{doc}:{i + 1}: no measurements/{mid}.json")
        m = measurements[mid]
        if part == "source":
            body = render_source(m)
        elif part in m["tables"]:
            body = render_table(m, part)
        else:
            raise RenderError(f"{doc}:{i + 1}: measurements/{mid}.json has no table {part!r}")
        used.add((mid, part))
        new = [body]
        blocks.append((block, "\n".join(inner), "\n".join(new)))
        out += [line] + new + [end]
        i = j + 1
    return "\n".join(out), blocks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a rendered block is stale")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                    help="the repository root (default: this script's parent's parent)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    try:
        measurements = load_measurements(root)
        used, stale, rewrites, nblocks = set(), [], [], 0
        for path in sorted((root / "docs").glob("*.md")):
            doc = f"docs/{path.name}"
            text = path.read_text(encoding="utf-8")
            new, blocks = render_doc(text, doc, measurements, used)
            nblocks += len(blocks)
            stale += [f"{doc}: {name}" for name, old, body in blocks if old != body]
            if new != text:
                rewrites.append((path, doc, new))
        unused = [f"{mid}/{part}" for mid, m in measurements.items()
                  for part in ["source"] + list(m["tables"]) if (mid, part) not in used]
        if unused:
            raise RenderError(f"not rendered in any doc: {', '.join(unused)}")
    except RenderError as e:
        print(f"render_measurements: {e}", file=sys.stderr)
        return 1
    if args.check:
        if rewrites:
            what = stale[0] if stale else f"{rewrites[0][1]}: its blocks"
            more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
            print(f"render_measurements: stale block {what}{more}; run tools/render_measurements.py",
                  file=sys.stderr)
            return 1
        print(f"render_measurements: {nblocks} blocks of {len(measurements)} measurements up to date")
        return 0
    for path, doc, new in rewrites:
        path.write_text(new, encoding="utf-8")
        print(f"render_measurements: wrote {doc}")
    print(f"render_measurements: {nblocks} blocks of {len(measurements)} measurements rendered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
