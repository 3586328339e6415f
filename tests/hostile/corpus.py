"""Hostile inputs for the k3ref command, generated at test time (nothing large is committed).

cases(work, goldens) writes the crafted files of every case into its own directory under
`work` and returns the list of Case records that run_hostile.py executes. Each case names
the class of the issue it reproduces, the k3ref arguments (run in the case's directory),
the exit codes that count as handled, and the one file it may create or change.

The classes: crashes (deep nesting in a header value or in the manifest), hangs (FIFOs,
huge head counts with no tokens, headers with very many tensors), memory bombs (huge
zero-element shapes, /dev/zero as the manifest, huge headers), undefined behaviour
(overflowing products, huge --window, empty files), accepted garbage (NUL in the header,
NaN/Inf options, escape codes in names), data loss (outputs onto devices, FIFOs, symlinks,
the input, a committed suite) and misleading messages.
"""

import json
import os
import shutil
import stat
import struct
from dataclasses import dataclass, field
from typing import Callable, List, Optional

# Exit codes that count as handled: 0 a correct result, 1 a difference found (compare,
# golden verify), 2 unusable input with one line on stderr.
OK, DIFFERENT, UNUSABLE = 0, 1, 2


@dataclass
class Case:
    name: str                      # unique, also the directory name
    klass: str                     # the class of the issue it reproduces
    args: List[str]                # k3ref arguments, run in the case directory
    expect: List[int]              # exit codes that count as handled
    output: Optional[str] = None   # the only path the run may create or change
    must_mention: List[str] = field(default_factory=list)  # each must appear in the error line
    check: Optional[Callable[[str], Optional[str]]] = None  # after a 0 exit: problem text or None
    must_mention_stdout: List[str] = field(default_factory=list)  # each must appear in the output (exit 1)
    setup_command: Optional[List[str]] = None  # k3ref arguments run (unchecked) before the case
    directory: str = ""


# ---- safetensors building blocks ------------------------------------------------------------

def safetensors_bytes(header_text, data=b""):
    header = header_text.encode("utf-8") if isinstance(header_text, str) else header_text
    return struct.pack("<Q", len(header)) + header + data


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def dumps(obj):
    return json.dumps(obj, separators=(",", ":"))


def kda_inputs(B=1, T=1, H=1, HV=1, K=2, V=2, dtype="F64"):
    """A valid kda input file (every value 0.25, g = -0.5) as (header dict, data)."""
    size = {"F64": 8, "F32": 4}[dtype]
    fmt = {"F64": "<d", "F32": "<f"}[dtype]
    shapes = {"q": [B, T, H, K], "k": [B, T, H, K], "v": [B, T, HV, V], "g": [B, T, HV, K], "beta": [B, T, HV]}
    header, data = {}, b""
    for name, shape in shapes.items():
        n = 1
        for e in shape:
            n *= e
        value = -0.5 if name == "g" else 0.25
        header[name] = entry(dtype, shape, len(data), len(data) + n * size)
        data += struct.pack(fmt, value) * n
    return header, data


def nested(depth, open_="[", close="]", inner="0"):
    return open_ * depth + inner + close * depth


def write(path, content):
    with open(path, "wb") as f:
        f.write(content)


# ---- checks after a successful run ---------------------------------------------------------

def reads_as_safetensors(path, expected_tensors):
    def check(directory):
        full = os.path.join(directory, path)
        try:
            raw = open(full, "rb").read()
            n = struct.unpack("<Q", raw[:8])[0]
            header = json.loads(raw[8:8 + n])
        except Exception as e:  # noqa: BLE001 - any failure is the finding
            return f"{path} is not a readable safetensors file: {e}"
        missing = [t for t in expected_tensors if t not in header]
        return f"{path} lacks tensors {missing}" if missing else None
    return check


def manifest_lists(expected_names):
    def check(directory):
        manifest = json.load(open(os.path.join(directory, "out", "MANIFEST.json")))
        names = [c["name"] for c in manifest["cases"]]
        return None if names == expected_names else f"manifest lists {names}, expected {expected_names}"
    return check


# ---- the cases -----------------------------------------------------------------------------

def cases(work, goldens, scale=1.0):
    """`scale` < 1 shrinks the cases that are hostile only by their volume (many tensors,
    long values), never below what they exercise (a limit is still crossed): the sanitizer
    build, whose -O0 instrumented parsing is 5-20 times slower, runs them at 1/4."""
    out = []

    def n(count, at_least=1):
        return max(at_least, int(count * scale))

    def case(name, klass, args, expect, files=(), **kw):
        directory = os.path.join(work, name)
        os.makedirs(directory)
        for file_name, content in files:
            write(os.path.join(directory, file_name), content)
        c = Case(name, klass, args, expect, directory=directory, **kw)
        out.append(c)
        return c

    golden_t1 = os.path.join(goldens, "kda_t1.safetensors")
    golden_b2 = os.path.join(goldens, "kda_b2_t37.safetensors")
    valid_header, valid_data = kda_inputs()
    valid = safetensors_bytes(dumps(valid_header), valid_data)
    kda_out = ["--out", "out.safetensors", "--threads", "2"]

    # Every reader of a safetensors file: kda --in, compare --golden, compare --candidate.
    def every_reader(name, klass, content, must_mention=(), expect=(UNUSABLE,)):
        case(f"{name}.kda", klass, ["kda", "--in", "x.safetensors"] + kda_out, list(expect),
             [("x.safetensors", content)], output="out.safetensors", must_mention=list(must_mention))
        case(f"{name}.compare_golden", klass, ["compare", "--golden", "x.safetensors", "--candidate", golden_t1],
             list(expect), [("x.safetensors", content)], must_mention=list(must_mention))
        case(f"{name}.compare_candidate", klass, ["compare", "--golden", golden_t1, "--candidate", "x.safetensors"],
             list(expect), [("x.safetensors", content)], must_mention=list(must_mention))

    # -- crashes: values nested tens of thousands deep, and deep manifest params
    for field_name in ("dtype", "shape", "data_offsets"):
        h = {name: dict(e) for name, e in valid_header.items()}
        h["q"][field_name] = "PLACEHOLDER"
        text = dumps(h).replace('"PLACEHOLDER"', nested(50000))
        every_reader(f"deep_{field_name}", "crash: deep nesting", safetensors_bytes(text, valid_data),
                     ["x.safetensors", "'q'", field_name])
    meta = dumps({"__metadata__": {"k": "PLACEHOLDER"}, **valid_header}).replace('"PLACEHOLDER"', nested(50000))
    every_reader("deep_metadata", "crash: deep nesting", safetensors_bytes(meta, valid_data), ["__metadata__"])
    every_reader("deep_objects", "crash: deep nesting",
                 safetensors_bytes('{"q":' + '{"a":' * 50000 + "0" + "}" * 50001), ["x.safetensors"])

    # -- accepted garbage: a NUL inside the declared header, NaN/Inf options, escape codes in names
    text = dumps(valid_header)
    every_reader("nul_in_header", "garbage: NUL in header",
                 safetensors_bytes(text.encode() + b"\0" + b"garbage" * 3, valid_data), ["NUL"])
    every_reader("nul_padding", "garbage: NUL in header", safetensors_bytes(text.encode() + b"\0" * 8, valid_data), ["NUL"])
    escape_name = "\x1b]0;owned\x07\x1b[2J\u009b31m"
    h = dict(valid_header)
    h[escape_name] = entry("Q4", [0], len(valid_data), len(valid_data))
    every_reader("escape_codes_in_name", "garbage: terminal escapes", safetensors_bytes(json.dumps(h), valid_data),
                 ["\\x1b"])
    for option, value in (("--scale", "nan"), ("--scale", "inf"), ("--scale", "-inf"), ("--scale", "NaN"),
                          ("--lower-bound", "nan"), ("--lower-bound", "-inf"), ("--scale", "1e999")):
        extra = ["--gate", "lower_bound"] if option == "--lower-bound" else []
        case(f"option{option}={value}", "garbage: NaN/Inf option",
             ["kda", "--in", "x.safetensors"] + kda_out + extra + [option, value], [UNUSABLE],
             [("x.safetensors", valid)], output="out.safetensors", must_mention=[option])

    # -- hangs: FIFOs as inputs, huge head counts with no tokens, very many tensors
    def fifo_case(name, args, fifo_name, output=None):
        c = case(name, "hang: FIFO", args, [UNUSABLE], output=output, must_mention=["FIFO"])
        os.mkfifo(os.path.join(c.directory, fifo_name))
    fifo_case("fifo.kda", ["kda", "--in", "x.safetensors"] + kda_out, "x.safetensors", "out.safetensors")
    fifo_case("fifo.compare_golden", ["compare", "--golden", "x.safetensors", "--candidate", golden_t1], "x.safetensors")
    fifo_case("fifo.compare_candidate", ["compare", "--golden", golden_t1, "--candidate", "x.safetensors"],
              "x.safetensors")
    c = case("fifo.manifest", "hang: FIFO", ["golden", "verify", "--dir", "suite", "--generated", "suite", "-q"],
             [UNUSABLE], must_mention=["MANIFEST.json", "FIFO"])
    os.makedirs(os.path.join(c.directory, "suite"))
    os.mkfifo(os.path.join(c.directory, "suite", "MANIFEST.json"))

    for heads_log2 in (36, 40):
        HV = 2 ** heads_log2
        h = {"q": entry("F64", [1, 0, 1, 1], 0, 0), "k": entry("F64", [1, 0, 1, 1], 0, 0),
             "v": entry("F64", [1, 0, HV, 1], 0, 0), "g": entry("F64", [1, 0, HV, 1], 0, 0),
             "beta": entry("F64", [1, 0, HV], 0, 0)}
        for flags in ([], ["--no-final-state"]):
            case(f"no_tokens_2^{heads_log2}_heads{''.join(flags)}", "hang: huge head count, T = 0",
                 ["kda", "--in", "x.safetensors"] + kda_out + flags, [UNUSABLE],
                 [("x.safetensors", safetensors_bytes(dumps(h)))], output="out.safetensors", must_mention=["x.safetensors"])

    def many_tensors(count):
        h = dict(valid_header)
        for i in range(count):
            h[f"t{i}"] = entry("U8", [0], len(valid_data), len(valid_data))
        return safetensors_bytes(dumps(h), valid_data)
    for count in (n(40000), 200000):
        content = many_tensors(count)
        case(f"many_tensors_{count}.kda", "hang: many tensors", ["kda", "--in", "x.safetensors"] + kda_out,
             [OK, UNUSABLE], [("x.safetensors", content)], output="out.safetensors")
        case(f"many_tensors_{count}.compare", "hang: many tensors",
             ["compare", "--golden", "x.safetensors", "--candidate", "x.safetensors"], [OK, UNUSABLE],
             [("x.safetensors", content)])
    # A golden and a candidate with 40k tensors besides the outputs: compare's lookups must
    # not be quadratic.
    golden_header_length = struct.unpack("<Q", open(golden_t1, "rb").read()[:8])[0]
    t1 = open(golden_t1, "rb").read()
    h = json.loads(t1[8:8 + golden_header_length])
    data = t1[8 + golden_header_length:]
    extra_count = n(40000)
    for i in range(extra_count):
        h[f"extra{i}"] = entry("U8", [1], len(data) + i, len(data) + i + 1)
    case(f"many_tensors_{extra_count}.compare_golden", "hang: many tensors",
         ["compare", "--golden", "x.safetensors", "--candidate", "x.safetensors", "--policy", "exact"], [OK],
         [("x.safetensors", safetensors_bytes(dumps(h), data + b"\1" * extra_count))])

    # A candidate tensor with a 1 MB name, and one with terminal escapes: neither is an
    # output, the message must quote them briefly and printably.
    t1_bytes = open(golden_t1, "rb").read()
    t1_header = json.loads(t1_bytes[8:8 + struct.unpack("<Q", t1_bytes[:8])[0]])
    t1_data = t1_bytes[8 + struct.unpack("<Q", t1_bytes[:8])[0]:]
    for label, name in (("long_name", "n" * n(1_000_000)), ("escape_name", "\x1b[2J\x1b]0;x\x07")):
        h = dict(t1_header)
        h[name] = entry("U8", [0], len(t1_data), len(t1_data))
        case(f"candidate_{label}.compare", "misleading: huge echoed value",
             ["compare", "--golden", golden_t1, "--candidate", "y.safetensors"], [DIFFERENT, UNUSABLE],
             [("y.safetensors", safetensors_bytes(json.dumps(h), t1_data))])

    # A golden's output list with brace groups that expand to 2^40 names.
    for label, outputs in (("braces_2^40", "{a,b}" * 40), ("commas_many", ",".join(["o"] * n(5_000_000, 200_000)))):
        h = {"__metadata__": {"k3ref.op": "kda.recurrent", "k3ref.outputs": outputs}, "o": entry("F64", [1], 0, 8)}
        case(f"outputs_{label}.compare", "memory bomb: output list expansion",
             ["compare", "--golden", "x.safetensors", "--candidate", "x.safetensors"], [UNUSABLE],
             [("x.safetensors", safetensors_bytes(dumps(h), b"\0" * 8))], must_mention=["k3ref.outputs"])

    # -- memory bombs: zero-element tensors with huge other extents, huge headers, /dev/zero
    for label, (B, K, V) in {"B2^40_K15000": (2 ** 40, 15000, 15000), "B2^20_K15000": (2 ** 20, 15000, 15000),
                             "B2^30_K1": (2 ** 30, 1, 1)}.items():
        h = {"q": entry("F64", [B, 0, 1, K], 0, 0), "k": entry("F64", [B, 0, 1, K], 0, 0),
             "v": entry("F64", [B, 0, 1, V], 0, 0), "g": entry("F64", [B, 0, 1, K], 0, 0),
             "beta": entry("F64", [B, 0, 1], 0, 0)}
        content = safetensors_bytes(dumps(h))
        case(f"zero_elements_{label}.kda", "memory bomb: zero-element huge shape",
             ["kda", "--in", "x.safetensors"] + kda_out, [UNUSABLE], [("x.safetensors", content)],
             output="out.safetensors", must_mention=["x.safetensors"])
    h = {"__metadata__": {"k3ref.op": "kda.recurrent", "k3ref.outputs": "o"}, "o": entry("F64", [1, 2 ** 62, 1, 0], 0, 0)}
    case("zero_elements_T2^62.compare_window", "memory bomb: zero-element huge shape",
         ["compare", "--golden", "x.safetensors", "--candidate", "x.safetensors", "--tensors", "o", "--window", "1"],
         [OK, DIFFERENT, UNUSABLE], [("x.safetensors", safetensors_bytes(dumps(h)))])
    # Products of extents that overflow 63 bits although a zero makes the count 0.
    for shape in ([0, 2 ** 62, 2 ** 62], [2 ** 62, 2 ** 62, 0], [2 ** 63 - 1, 2, 0]):
        h = dict(valid_header)
        h["z"] = entry("F64", shape, len(valid_data), len(valid_data))
        every_reader(f"zero_elements_overflow_{'x'.join(map(str, shape))}", "ub: overflow in zero-element shape",
                     safetensors_bytes(dumps(h), valid_data), ["'z'", "63 bits"])
    # B * HV overflows though every tensor is empty (the recurrence's offsets).
    h = {"q": entry("F64", [2 ** 40, 0, 1, 1], 0, 0), "k": entry("F64", [2 ** 40, 0, 1, 1], 0, 0),
         "v": entry("F64", [2 ** 40, 0, 2 ** 36, 1], 0, 0), "g": entry("F64", [2 ** 40, 0, 2 ** 36, 1], 0, 0),
         "beta": entry("F64", [2 ** 40, 0, 2 ** 36], 0, 0)}
    case("recurrence_offsets_overflow.kda", "ub: overflow in the recurrence's offsets",
         ["kda", "--in", "x.safetensors"] + kda_out, [UNUSABLE], [("x.safetensors", safetensors_bytes(dumps(h)))],
         output="out.safetensors")
    # Headers of 100 MB: arrays nested inside a shape, and one huge string value.
    big = '{"q":{"dtype":"F64","shape":[' + "[]," * 33_000_000 + '[]],"data_offsets":[0,0]}}'
    case("header_100MB_nested_arrays.kda", "memory bomb: huge header", ["kda", "--in", "x.safetensors"] + kda_out,
         [UNUSABLE], [("x.safetensors", safetensors_bytes(big))], output="out.safetensors", must_mention=["'q'", "shape"])
    big = '{"__metadata__":{"k":"' + "A" * n(20_000_000) + '"}}'
    case("header_100MB_string.kda", "memory bomb: huge header", ["kda", "--in", "x.safetensors"] + kda_out,
         [UNUSABLE], [("x.safetensors", safetensors_bytes(big))], output="out.safetensors")
    big = '{"q":{"dtype":"F64","shape":[' + "1," * n(20_000_000) + '1],"data_offsets":[0,8]}}'
    case("shape_rank_20M.kda", "memory bomb: huge header", ["kda", "--in", "x.safetensors"] + kda_out,
         [UNUSABLE], [("x.safetensors", safetensors_bytes(big, b"\0" * 8))], output="out.safetensors",
         must_mention=["'q'", "rank"])
    c = case("manifest_dev_zero", "memory bomb: /dev/zero manifest",
             ["golden", "verify", "--dir", "suite", "--generated", "suite", "-q"], [UNUSABLE],
             must_mention=["MANIFEST.json"])
    os.makedirs(os.path.join(c.directory, "suite"))
    os.symlink("/dev/zero", os.path.join(c.directory, "suite", "MANIFEST.json"))
    c = case("manifest_huge", "memory bomb: huge manifest",
             ["golden", "verify", "--dir", "suite", "--generated", "suite", "-q"], [UNUSABLE],
             must_mention=["MANIFEST.json"])
    os.makedirs(os.path.join(c.directory, "suite"))
    write(os.path.join(c.directory, "suite", "MANIFEST.json"), b"[" + b"{}," * 7_000_000 + b"{}]")
    c = case("manifest_many_values", "memory bomb: huge manifest",
             ["golden", "verify", "--dir", "suite", "--generated", "suite", "-q"], [UNUSABLE],
             must_mention=["MANIFEST.json"])
    os.makedirs(os.path.join(c.directory, "suite"))
    write(os.path.join(c.directory, "suite", "MANIFEST.json"), b'{"cases":[' + b"{}," * n(5_000_000, 1_100_000) + b"{}]}")

    # -- manifests: deep params, hostile fields; golden files that are empty or FIFOs
    manifest = json.load(open(os.path.join(goldens, "MANIFEST.json")))
    entry_t1 = next(c for c in manifest["cases"] if c["name"] == "kda_t1")

    def suite_case(name, klass, manifest_text, files=(), expect=(DIFFERENT, UNUSABLE), must_mention=()):
        c = case(name, klass, ["golden", "verify", "--dir", "suite", "--generated", "suite", "-q"], list(expect),
                 must_mention=list(must_mention))
        os.makedirs(os.path.join(c.directory, "suite"))
        write(os.path.join(c.directory, "suite", "MANIFEST.json"), manifest_text.encode())
        for file_name, content in files:
            write(os.path.join(c.directory, "suite", file_name), content)
        return c

    def one_case_manifest(**changes):
        e = dict(entry_t1)
        e.update(changes)
        return json.dumps({"format": "k3ref-golden-manifest", "suite": "default",
                           "generator_version": manifest["generator_version"], "cases": [e]}, indent=2)

    suite_case("manifest_deep_params", "crash: deep manifest params",
               one_case_manifest(params={"x": "PLACEHOLDER"}).replace('"PLACEHOLDER"', nested(100000)),
               expect=(UNUSABLE,), must_mention=["MANIFEST.json", "deep"])
    suite_case("manifest_deep_objects", "crash: deep manifest params",
               one_case_manifest(params={"x": "PLACEHOLDER"}).replace('"PLACEHOLDER"', nested(100000, '{"a":', "}")),
               expect=(UNUSABLE,), must_mention=["MANIFEST.json", "deep"])
    suite_case("manifest_nul", "garbage: NUL in manifest", one_case_manifest() + "\0garbage", expect=(UNUSABLE,),
               must_mention=["MANIFEST.json"])
    suite_case("manifest_escape_name", "garbage: terminal escapes", one_case_manifest(name="\x1b[2Jx"),
               expect=(UNUSABLE,), must_mention=["MANIFEST.json"])
    suite_case("manifest_huge_value_echo", "misleading: huge echoed value",
               one_case_manifest(sha256="f" * n(10_000_000)), expect=(UNUSABLE,), must_mention=["sha256"])
    suite_case("manifest_huge_suite_name", "misleading: huge echoed value",
               one_case_manifest().replace('"suite": "default"', '"suite": "' + "s" * n(5_000_000) + '"'),
               expect=(UNUSABLE,), must_mention=["'suite'"])
    suite_case("manifest_huge_generator_version", "misleading: huge echoed value",
               one_case_manifest().replace('"generator_version": "' + manifest["generator_version"] + '"',
                                           '"generator_version": "' + "\\u001b" * n(1_000_000) + '"', 1),
               expect=(UNUSABLE,), must_mention=["generator_version"])
    suite_case("empty_golden_file", "ub: hashing an empty file", one_case_manifest(), [("kda_t1.safetensors", b"")],
               expect=(DIFFERENT,))
    c = suite_case("fifo_golden_file", "hang: FIFO", one_case_manifest(), expect=(DIFFERENT, UNUSABLE),
                   must_mention=[])
    os.mkfifo(os.path.join(c.directory, "suite", "kda_t1.safetensors"))
    c = suite_case("dev_zero_golden_file", "memory bomb: /dev/zero golden", one_case_manifest(),
                   expect=(DIFFERENT, UNUSABLE))
    os.symlink("/dev/zero", os.path.join(c.directory, "suite", "kda_t1.safetensors"))
    deep_golden = safetensors_bytes('{"o":' + "[" * 50000 + "]" * 50000 + "}")
    suite_case("deep_golden_file", "crash: deep nesting", one_case_manifest(), [("kda_t1.safetensors", deep_golden)],
               expect=(DIFFERENT,))

    # A regenerated file that is bad is named by its own path, not the committed one.
    c = case("bad_generated_file", "misleading: regenerated file named",
             ["golden", "verify", "--dir", "suite", "--generated", "generated", "-q"], [DIFFERENT],
             must_mention=[])
    os.makedirs(os.path.join(c.directory, "suite"))
    os.makedirs(os.path.join(c.directory, "generated"))
    shutil.copy(os.path.join(goldens, "MANIFEST.json"), os.path.join(c.directory, "suite"))
    shutil.copy(golden_t1, os.path.join(c.directory, "suite"))
    write(os.path.join(c.directory, "generated", "kda_t1.safetensors"), safetensors_bytes('{"o":[1]}'))
    c.must_mention_stdout = ["generated/kda_t1.safetensors"]
    c.must_mention = []

    # -- undefined behaviour and silent clamping in numeric options
    for window in ("9223372036854775807", "9223372036854775808", "99999999999999999999", "-1", "0x10", "1.5", "nan"):
        case(f"window={window}", "ub: --window", ["compare", "--golden", golden_b2, "--candidate", golden_b2,
                                                  "--window", window], [OK, UNUSABLE],
             must_mention=["--window"] if window != "9223372036854775807" else [])
    for option, value in (("--threads", "9223372036854775808"), ("--threads", "4294967297"), ("--threads", "0"),
                          ("--threads", "2.5")):
        case(f"kda{option}={value}", "ub: integer option", ["kda", "--in", golden_t1, "--out", "out.safetensors",
                                                             option, value], [UNUSABLE], output="out.safetensors",
             must_mention=[option])
    case("jobs=2^63", "ub: integer option", ["golden", "verify", "--dir", goldens, "-j", "9223372036854775808"],
         [UNUSABLE], must_mention=["-j"])

    # -- data loss: outputs onto devices, FIFOs, symlinks, the input; generate into a suite
    c = case("out_is_fifo", "data loss: --out a FIFO", ["kda", "--in", "x.safetensors", "--out", "fifo"],
             [UNUSABLE], [("x.safetensors", valid)], must_mention=["--out", "fifo"])
    os.mkfifo(os.path.join(c.directory, "fifo"))
    c = case("out_is_symlink", "data loss: --out a symlink", ["kda", "--in", "x.safetensors", "--out", "link"],
             [UNUSABLE], [("x.safetensors", valid), ("target", b"keep me")], must_mention=["--out", "symbolic link"])
    os.symlink("target", os.path.join(c.directory, "link"))
    c = case("out_is_device", "data loss: --out a device", ["kda", "--in", "x.safetensors", "--out", "null"],
             [UNUSABLE], [("x.safetensors", valid)], must_mention=["--out", "null"])
    if os.geteuid() == 0:
        os.mknod(os.path.join(c.directory, "null"), 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    else:  # not root: the real /dev/null, which an unprivileged writer cannot replace anyway
        c.args[-1] = "/dev/null"
    case("out_is_input", "data loss: --out the input", ["kda", "--in", "x.safetensors", "--out", "x.safetensors"],
         [UNUSABLE], [("x.safetensors", valid)], must_mention=["--out", "input"])
    c = case("out_is_hard_link_to_input", "data loss: --out the input",
             ["kda", "--in", "x.safetensors", "--out", "y.safetensors"], [UNUSABLE], [("x.safetensors", valid)],
             must_mention=["--out", "input"])
    os.link(os.path.join(c.directory, "x.safetensors"), os.path.join(c.directory, "y.safetensors"))
    case("out_is_directory", "data loss: --out a directory", ["kda", "--in", "x.safetensors", "--out", "."],
         [UNUSABLE], [("x.safetensors", valid)], must_mention=["--out"])
    case("out_not_utf8", "misleading: non-UTF-8 --out", ["kda", "--in", "x.safetensors", "--out", "o\udcff.st"],
         [UNUSABLE], [("x.safetensors", valid)], must_mention=["UTF-8"])
    case("out_in_missing_directory", "misleading: unwritable --out",
         ["kda", "--in", "x.safetensors", "--out", "missing/o.safetensors"], [UNUSABLE], [("x.safetensors", valid)],
         must_mention=["--out", "missing"])

    def suite_copy(directory, name="goldens"):
        os.makedirs(os.path.join(directory, name))
        shutil.copy(os.path.join(goldens, "MANIFEST.json"), os.path.join(directory, name))
        shutil.copy(golden_t1, os.path.join(directory, name))

    c = case("generate_only_default_out", "data loss: --only rewrites the manifest",
             ["golden", "generate", "--only", "kda_t1", "-q"], [UNUSABLE], must_mention=["--only"])
    suite_copy(c.directory)
    c = case("generate_only_into_suite", "data loss: --only rewrites the manifest",
             ["golden", "generate", "--only", "kda_t1", "--out", "goldens", "-q", "--force"], [UNUSABLE],
             must_mention=["--only"])
    suite_copy(c.directory)
    c = case("generate_collides_with_user_file", "data loss: generate overwrites user files",
             ["golden", "generate", "--only", "kda_t1", "--out", "mine", "-q"], [UNUSABLE],
             must_mention=["mine", "kda_t1.safetensors"])
    os.makedirs(os.path.join(c.directory, "mine"))
    write(os.path.join(c.directory, "mine", "kda_t1.safetensors"), b"my own notes")
    c = case("generate_into_foreign_directory", "data loss: generate overwrites user files",
             ["golden", "generate", "--only", "kda_t1", "--out", "mine", "-q"], [UNUSABLE], must_mention=["mine"])
    os.makedirs(os.path.join(c.directory, "mine"))
    write(os.path.join(c.directory, "mine", "thesis.tex"), b"\\documentclass{article}")
    c = case("generate_manifest_symlink", "data loss: generate overwrites user files",
             ["golden", "generate", "--only", "kda_t1", "--out", "mine", "-q"], [UNUSABLE], must_mention=["mine"],
             files=[("precious", b"keep")])
    os.makedirs(os.path.join(c.directory, "mine"))
    os.symlink("../precious", os.path.join(c.directory, "mine", "MANIFEST.json"))
    for label, mutate in (("edited", lambda b: b[:-1] + bytes([b[-1] ^ 1])), ("truncated", lambda b: b[:-8])):
        c = case(f"generate_over_{label}_golden", "data loss: generate overwrites user files",
                 ["golden", "generate", "--only", "kda_t1", "--out", "suite", "-q"], [UNUSABLE],
                 must_mention=["kda_t1.safetensors", "--force"])
        os.makedirs(os.path.join(c.directory, "suite"))
        write(os.path.join(c.directory, "suite", "MANIFEST.json"),
              json.dumps({"format": "k3ref-golden-manifest", "suite": "default",
                          "generator_version": manifest["generator_version"], "subset": True,
                          "cases": [entry_t1]}).encode())
        write(os.path.join(c.directory, "suite", "kda_t1.safetensors"), mutate(open(golden_t1, "rb").read()))
    case("generate_only_twice", "data loss: --only X --only X",
         ["golden", "generate", "--only", "kda_t1", "--only", "kda_t1", "--out", "out", "-q"], [OK, UNUSABLE],
         output="out", check=manifest_lists(["kda_t1"]))
    case("generate_only_unknown", "misleading: unknown case", ["golden", "generate", "--only", "no_such_case",
                                                               "--out", "out", "-q"], [UNUSABLE],
         must_mention=["no_such_case"])
    case("generate_out_not_utf8", "misleading: non-UTF-8 --out",
         ["golden", "generate", "--only", "kda_t1", "--out", "d\udcff", "-q"], [UNUSABLE], must_mention=["UTF-8"])

    # -- misleading messages: an I64 golden, dtypes named as they are
    h = {"__metadata__": {"k3ref.op": "kda.recurrent", "k3ref.outputs": "o"}, "o": entry("I64", [2], 0, 16)}
    c = case("i64_golden", "misleading: I64 golden", ["compare", "--golden", "x.safetensors", "--candidate", "y.safetensors"],
             [OK, DIFFERENT, UNUSABLE], [("x.safetensors", safetensors_bytes(dumps(h), struct.pack("<qq", 1, 2))),
                                     ("y.safetensors", safetensors_bytes(dumps({"o": entry("F64", [2], 0, 16)}),
                                                                         struct.pack("<dd", 1, 2)))],
             must_mention=["I64"])
    c.must_mention_stdout = ["I64"]

    # -- the well-formed control cases: correct results
    case("valid.kda", "control: valid input", ["kda", "--in", "x.safetensors"] + kda_out, [OK],
         [("x.safetensors", valid)], output="out.safetensors", check=reads_as_safetensors("out.safetensors", ["o"]))
    case("valid.kda_overwrite_own_output", "control: valid input",
         ["kda", "--in", "x.safetensors"] + kda_out, [OK], [("x.safetensors", valid), ("out.safetensors", valid)],
         output="out.safetensors", check=reads_as_safetensors("out.safetensors", ["o", "final_state"]))
    case("valid.kda_force_onto_input", "control: --force", ["kda", "--in", "x.safetensors", "--out", "x.safetensors",
                                                            "--force"], [OK], [("x.safetensors", valid)],
         output="x.safetensors", check=reads_as_safetensors("x.safetensors", ["o"]))
    case("valid.compare_self", "control: valid input", ["compare", "--golden", golden_b2, "--candidate", golden_b2,
                                                         "--policy", "exact", "--window", "8"], [OK])
    case("valid.generate_fresh", "control: valid input", ["golden", "generate", "--only", "kda_t1", "--out", "out", "-q"],
         [OK], output="out", check=manifest_lists(["kda_t1"]))
    c = case("valid.generate_over_own_subset", "control: valid input",
             ["golden", "generate", "--only", "kda_t1", "--out", "out", "-q"], [OK], output="out",
             check=manifest_lists(["kda_t1"]))
    c.setup_command = ["golden", "generate", "--only", "kda_t1", "--out", "out", "-q"]

    # Truncations and bit flips of a valid file: every reader, correct result or one line.
    base = open(golden_t1, "rb").read()
    for cut in (0, 1, 7, 8, 9, 100, len(base) // 2, len(base) - 1):
        every_reader(f"truncated_{cut}", "mutation: truncated", base[:cut], expect=(UNUSABLE,))
    header_length = struct.unpack("<Q", base[:8])[0]
    for position in (0, 3, 7, 8, 20, 200, header_length + 7, header_length + 8, len(base) - 1):
        flipped = bytearray(base)
        flipped[position] ^= 0x40
        every_reader(f"bitflip_{position}", "mutation: bit flip", bytes(flipped), expect=(OK, DIFFERENT, UNUSABLE))
    for length in (2 ** 64 - 1, 2 ** 63, max(0, header_length - 1), header_length + 1):
        every_reader(f"header_length_{length}", "mutation: header length", struct.pack("<Q", length) + base[8:],
                     expect=(UNUSABLE,))
    return out
