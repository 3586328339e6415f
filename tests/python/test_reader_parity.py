"""Parity of the readers: the Python readers equal the C++ ones on a generated hostile corpus.

Every file the hostile corpus (tests/hostile/corpus.py) gives a reader, and some 400 more made
here, class by class (non-regular files: FIFOs, /dev/zero, directories, dangling links;
oversize; nesting 64, 65, 100,000 deep; NUL and trailing garbage; duplicate keys; huge {a,b}
expansions in k3ref.outputs; bad UTF-8 and lone surrogate escapes; truncated headers and bad
length prefixes; overlapping, short and gapped data offsets; non-finite values; bad dtypes and
shapes; many tensors; truncations and bit flips of a golden), is read by both sides:

  safetensors   C++ io::read_safetensors (k3ref._core.read_safetensors)  vs  k3ref._safetensors.read
                (accepted: the same tensors, dtypes, shapes and metadata)
  manifest      `k3ref golden verify --dir D --generated D -q` (exit 2: refused; 0 or 1: the
                manifest was read and the suite judged)  vs  k3ref.goldens.manifest(D)
  policy table  `k3ref compare --golden G --candidate G --policy-table T` (exit 0 or 2)  vs
                k3ref.policy.load_table(T) and its rules for G's operator and outputs
  k3ref.outputs `k3ref compare --golden X --candidate X` refusing in a line naming k3ref.outputs
                vs k3ref.goldens.expand_outputs
  limitations   k3ref.gpu_check.collection.load_limitations (no C++ reader): accepted or one line

They must agree on accepting or refusing, and a refusal must be one line on both sides. Each
read runs in a child process under 30 s and 1 GiB (the command: RLIMIT_AS of 1 GiB; a Python
reader: forked, RLIMIT_AS of its parent's address space at the fork plus 1 GiB). The commands
and both safetensors readers are started from a process without torch (bounded_reads.Server),
the Python readers of manifests, tables, outputs and limitations from this one. Each reader's
files are made once per module: its parity test and the count of classes share them.
"""
import hashlib
import json
import os
import shutil
import stat
import struct
from pathlib import Path

import pytest

from bounded_reads import EXE, TIME_LIMIT_S, Server, in_child
from conftest import GOLDENS, ROOT, needs_core

from hostile import corpus  # tests/hostile/corpus.py (tests/ is on the path: conftest.py)
from hostile.corpus import dumps, entry, kda_inputs, nested, safetensors_bytes

# Imported once here, so that each reader forked from this process (in_child) does not import
# them again.
import k3ref  # noqa: E402
from k3ref import _safetensors, goldens, policy  # noqa: E402,F401
from k3ref.gpu_check import collection as _collection  # noqa: E402,F401

try:
    k3ref._compiled()
except ImportError:
    pass

GOLDEN_T1 = GOLDENS / "kda_t1.safetensors"

# Disagreements of a C++ reader with its Python twin, listed strictly (an entry that agrees
# again fails the test).
KNOWN_CPP_DISAGREEMENTS = {}  # none: golden::parse_manifest follows the shared JSON rules (io/json_rules.h)


# ---- judging the outcomes ----------------------------------------------------------------

def one_line(message):
    return bool(message) and "\n" not in message.rstrip("\n") and "\r" not in message


def disagreement(name, cpp, py):
    """None when the two outcomes agree, else the problem in one line."""
    if cpp[0] == "failed" or py[0] == "failed":
        return f"{name}: C++ {cpp[0]} ({str(cpp[1])[:200]}), Python {py[0]} ({str(py[1])[:200]})"
    if cpp[0] != py[0]:
        return f"{name}: C++ {cpp[0]}, Python {py[0]}: C++ {str(cpp[1])[:200]!r} / Python {str(py[1])[:200]!r}"
    if cpp[0] == "refused":
        for side, (_, message) in (("C++", cpp), ("Python", py)):
            if not one_line(message):
                return f"{name}: {side}'s refusal is not one line: {message[:300]!r}"
    elif cpp[1] is not None and py[1] is not None and cpp[1] != py[1]:
        return f"{name}: both accept, but read different contents ({cpp[1]} / {py[1]})"
    return None


def check_all(cases, read_cpp, read_py, minimum):
    """Runs every case on both sides; fails listing every disagreement."""
    assert len(cases) >= minimum, f"only {len(cases)} cases"
    problems, agreed_known, outcomes = [], [], {}
    for name, klass, target in cases:
        cpp, py = read_cpp(target), read_py(target)
        problem = disagreement(name, cpp, py)
        outcomes.setdefault(klass, {}).setdefault(py[0], 0)
        outcomes[klass][py[0]] += 1
        if name in KNOWN_CPP_DISAGREEMENTS:
            if problem is None:
                agreed_known.append(name)
            continue
        if problem:
            problems.append(f"[{klass}] {problem}")
    print(f"\n{len(cases)} cases: " + "; ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    assert not problems, f"{len(problems)} disagreements of {len(cases)} cases:\n" + "\n".join(problems)
    assert not agreed_known, f"now agree, remove from KNOWN_CPP_DISAGREEMENTS: {agreed_known}"
    return outcomes


# ---- made once per module: the read server and each reader's files ---------------------------

@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("parity")


@pytest.fixture(scope="module")
def cases_of(work):
    """cases_of(make): the cases make(directory) writes (safetensors_cases, manifest_cases, ...),
    made once per module and shared by the reader's parity test and the count of classes."""
    made = {}

    def of(make):
        if make not in made:
            made[make] = make(work / make.__name__)
        return made[make]
    return of


# ---- safetensors ----------------------------------------------------------------------------

def safetensors_cases(work):
    """(name, class, path) of every hostile safetensors file."""
    out, seen = [], {}
    work = Path(work)

    def add(name, klass, content=None, make=None):
        path = work / "st" / f"{name}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        if make:
            make(path)
        else:
            path.write_bytes(content)
        out.append((f"safetensors.{name}", klass, path))

    # Every safetensors file of the hostile corpus (its FIFOs, links and 100 MB headers too),
    # once per distinct content.
    hostile = work / "hostile"
    hostile.mkdir(parents=True)
    for c in corpus.cases(str(hostile), str(GOLDENS)):
        for file_name in sorted(os.listdir(c.directory)):
            path = Path(c.directory) / file_name
            if not file_name.endswith(".safetensors") or file_name == "out.safetensors":
                continue
            st = os.lstat(path)
            key = ("regular", hashlib.sha256(path.read_bytes()).hexdigest()) if stat.S_ISREG(st.st_mode) else (
                "special", stat.S_IFMT(st.st_mode), os.readlink(path) if stat.S_ISLNK(st.st_mode) else "")
            if key in seen:
                continue
            seen[key] = c.name
            out.append((f"corpus.{c.name}.{file_name}", "corpus: " + c.klass.split(":")[0], path))

    header, data = kda_inputs()
    valid_text = dumps(header)

    def with_q(**changes):
        h = {n: dict(e) for n, e in header.items()}
        h["q"].update(changes)
        return safetensors_bytes(dumps(h), data)

    # -- non-regular files
    add("fifo", "non-regular", make=lambda p: os.mkfifo(p))
    add("dev_zero", "non-regular", make=lambda p: os.symlink("/dev/zero", p))
    add("dev_null", "non-regular", make=lambda p: os.symlink("/dev/null", p))
    add("directory", "non-regular", make=lambda p: p.mkdir())
    add("dangling_link", "non-regular", make=lambda p: os.symlink(str(work / "no_such_file"), p))
    add("link_to_valid", "non-regular", make=lambda p: os.symlink(str(GOLDEN_T1), p))
    add("empty", "truncated header", b"")
    # -- valid controls
    add("valid", "control", safetensors_bytes(valid_text, data))
    add("valid_padded", "control", safetensors_bytes(valid_text + " " * 5, data))
    add("valid_whitespace", "control", safetensors_bytes(" \t\r\n" + valid_text + "\n\t ", data))
    add("valid_empty_header", "control", safetensors_bytes("{}"))
    add("valid_metadata_only", "control", safetensors_bytes('{"__metadata__":{"a":"b"}}'))
    add("valid_unicode_names", "control", safetensors_bytes(json.dumps({"q\u00e9\U0001F600": entry("U8", [1], 0, 1)},
                                                                       ensure_ascii=False), b"\1"))
    add("valid_escaped_names", "control", safetensors_bytes(json.dumps({"\x1b[2J\u009b\u202e": entry("U8", [1], 0, 1)}),
                                                            b"\1"))
    add("valid_surrogate_pair", "control", safetensors_bytes('{"\\ud83d\\ude00":' + dumps(entry("U8", [1], 0, 1)) + "}",
                                                             b"\1"))
    add("valid_golden", "control", GOLDEN_T1.read_bytes())
    # -- dtypes
    for dtype in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "U8", "BOOL"):
        size = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4}.get(dtype, 1)
        add(f"dtype_{dtype}", "control", safetensors_bytes(dumps({"t": entry(dtype, [3], 0, 3 * size)}), b"\0" * 3 * size))
    for dtype in ("I16", "I8", "U16", "U32", "U64", "F8_E8M0", "C64", "f64", "", " F64", "F64 ", "F6"):
        add(f"dtype_bad_{dtype.strip() or 'empty'}_{len(dtype)}", "bad dtype",
            safetensors_bytes(dumps({"t": entry(dtype, [2], 0, 2)}), b"\0\0"))
    for label, value in (("number", 8), ("null", None), ("array", ["F64"]), ("object", {"F64": 1}), ("bool", True)):
        add(f"dtype_type_{label}", "bad dtype", with_q(dtype=value))
    # -- shapes
    for label, shape in (("scalar", []), ("zero", [0]), ("max63_zero", [2 ** 63 - 1, 0]), ("2^63_zero", [2 ** 63, 0]),
                         ("2^64_zero", [2 ** 64, 0]), ("2^62x2^62_zero", [0, 2 ** 62, 2 ** 62]),
                         ("2^31x2^31_zero", [2 ** 31, 2 ** 31, 0]), ("2^32x2^31_zero", [2 ** 32, 2 ** 31, 0]),
                         ("negative", [-1]), ("negative_zero", [-1, 0]), ("float", [1.0]), ("exponent", [1e0]),
                         ("bool", [True]), ("null", [None]), ("string", ["1"]), ("nested", [[1]]),
                         ("object", {"a": 1}), ("number", 1), ("rank64", [1] * 64), ("rank65", [1] * 65),
                         ("rank64_zero", [0] * 64), ("huge_int", [10 ** 30, 0])):
        count = 1
        for e in shape if isinstance(shape, list) else []:
            count = count * e if isinstance(e, int) else count
        nbytes = count * 8 if isinstance(shape, list) and all(type(e) is int and e >= 0 for e in shape) and \
            count < 64 else 0
        add(f"shape_{label}", "bad shape" if label not in ("scalar", "zero", "rank64", "rank64_zero") else "control",
            safetensors_bytes(json.dumps({"t": entry("F64", shape, 0, nbytes)}), b"\0" * nbytes))
    # -- data offsets
    for label, offsets, blob in (("short", [0, 7], 8), ("long", [0, 9], 8), ("past_end", [0, 16], 8),
                                 ("reversed", [8, 0], 8), ("one_value", [0], 8), ("three_values", [0, 8, 8], 8),
                                 ("negative", [-8, 0], 8), ("float", [0, 8.0], 8), ("bool", [False, 8], 8),
                                 ("string", ["0", "8"], 8), ("nested", [[0], [8]], 8), ("null", None, 8),
                                 ("huge", [2 ** 64 - 8, 2 ** 64], 8), ("past_2^64", [0, 2 ** 64 + 8], 8),
                                 ("trailing_data", [0, 8], 16), ("gap", [8, 16], 16)):
        add(f"offsets_{label}", "bad offsets", safetensors_bytes(json.dumps({"t": entry("F64", [1], 0, 8) | {
            "data_offsets": offsets}}), b"\0" * blob))
    two = lambda a, b, blob: safetensors_bytes(dumps({"a": entry("F64", [1], *a), "b": entry("F64", [1], *b)}),
                                               b"\0" * blob)
    add("offsets_overlap", "bad offsets", two((0, 8), (4, 12), 12))
    add("offsets_same", "bad offsets", two((0, 8), (0, 8), 8))
    add("offsets_swapped_order", "control", two((8, 16), (0, 8), 16))
    add("offsets_gap_between", "bad offsets", two((0, 8), (16, 24), 24))
    add("offsets_zero_inside", "bad offsets",
        safetensors_bytes(dumps({"a": entry("F64", [2], 0, 16), "z": entry("F64", [0], 8, 8)}), b"\0" * 16))
    add("offsets_zero_at_end", "control",
        safetensors_bytes(dumps({"a": entry("F64", [2], 0, 16), "z": entry("F64", [0], 16, 16)}), b"\0" * 16))
    add("offsets_zero_past_end", "bad offsets",
        safetensors_bytes(dumps({"a": entry("F64", [2], 0, 16), "z": entry("F64", [0], 24, 24)}), b"\0" * 16))
    add("offsets_zero_shared", "control", safetensors_bytes(dumps({"y": entry("U8", [0], 0, 0), "x": entry("U8", [0], 0, 0),
                                                                   "a": entry("U8", [1], 0, 1)}), b"\1"))
    # -- entries
    for label, e in (("missing_dtype", {"shape": [1], "data_offsets": [0, 8]}),
                     ("missing_shape", {"dtype": "F64", "data_offsets": [0, 8]}),
                     ("missing_offsets", {"dtype": "F64", "shape": [1]}),
                     ("extra_key", {"dtype": "F64", "shape": [1], "data_offsets": [0, 8], "x": 1}),
                     ("empty", {}), ("array", ["F64", [1], [0, 8]]), ("string", "F64"), ("null", None)):
        add(f"entry_{label}", "bad entry", safetensors_bytes(json.dumps({"t": e}), b"\0" * 8))
    # -- the header as a whole
    for label, text in (("array", "[]"), ("string", '"x"'), ("number", "1"), ("null", "null"), ("true", "true"),
                        ("empty", ""), ("spaces", "        "), ("open", "{"), ("unclosed", valid_text[:-1]),
                        ("two_objects", "{}{}"), ("comma", '{"a":1,}'), ("single_quotes", "{'a':1}"),
                        ("comment", "{/*x*/}"), ("unquoted_key", "{a:1}")):
        add(f"header_{label}", "bad header", safetensors_bytes(text))
    # -- metadata
    for label, meta in (("number", {"a": 1}), ("null", {"a": None}), ("nested", {"a": {"b": "c"}}),
                        ("array_value", {"a": ["b"]}), ("not_object", ["a"]), ("string", "a"), ("empty", {}),
                        ("many", {f"k{i}": "v" * 10 for i in range(20000)}), ("long_value", {"k": "v" * 1_000_000})):
        add(f"metadata_{label}", "bad metadata" if label not in ("empty", "many", "long_value") else "control",
            safetensors_bytes(json.dumps({"__metadata__": meta}) if not isinstance(meta, dict) or meta is not None
                              else "", b""))
    # -- NUL and trailing garbage
    add("nul_end", "NUL and garbage", safetensors_bytes(valid_text.encode() + b"\0", data))
    add("nul_middle", "NUL and garbage", safetensors_bytes(valid_text.encode()[:10] + b"\0" + valid_text.encode()[10:], data))
    add("nul_padding", "NUL and garbage", safetensors_bytes(valid_text.encode() + b"\0" * 7, data))
    add("nul_in_string", "NUL and garbage", safetensors_bytes(b'{"a\0b":' + dumps(entry("U8", [1], 0, 1)).encode() + b"}", b"\1"))
    add("escaped_nul_in_name", "control", safetensors_bytes('{"a\\u0000b":' + dumps(entry("U8", [1], 0, 1)) + "}", b"\1"))
    add("garbage_after", "NUL and garbage", safetensors_bytes(valid_text + "garbage", data))
    add("garbage_after_space", "NUL and garbage", safetensors_bytes(valid_text + " x", data))
    add("second_value_after", "NUL and garbage", safetensors_bytes(valid_text + " {}", data))
    add("control_char_in_string", "NUL and garbage", safetensors_bytes('{"a\nb":' + dumps(entry("U8", [1], 0, 1)) + "}", b"\1"))
    # -- duplicate keys
    e8 = dumps(entry("F64", [1], 0, 8))
    add("dup_tensor", "duplicate keys", safetensors_bytes('{"a":' + e8 + ',"a":' + e8 + "}", b"\0" * 8))
    add("dup_entry_key", "duplicate keys", safetensors_bytes('{"a":{"dtype":"F64","dtype":"F64","shape":[1],"data_offsets":[0,8]}}',
                                                             b"\0" * 8))
    add("dup_metadata_key", "duplicate keys", safetensors_bytes('{"__metadata__":{"k":"a","k":"b"}}'))
    add("dup_metadata", "duplicate keys", safetensors_bytes('{"__metadata__":{},"__metadata__":{}}'))
    add("dup_escaped", "duplicate keys", safetensors_bytes('{"a":' + e8 + ',"\\u0061":' + e8 + "}", b"\0" * 8))
    # -- bad UTF-8 and surrogates
    for label, raw in (("lone_continuation", b"\x80"), ("overlong_slash", b"\xc0\xaf"), ("overlong_3", b"\xe0\x80\xaf"),
                       ("surrogate_utf8", b"\xed\xa0\x80"), ("above_10ffff", b"\xf4\x90\x80\x80"), ("five_byte", b"\xf8\x88\x80\x80\x80"),
                       ("truncated_2", b"\xc3"), ("truncated_4", b"\xf0\x9f\x98"), ("ff", b"\xff"), ("latin1", b"caf\xe9")):
        add(f"utf8_name_{label}", "bad UTF-8", safetensors_bytes(b'{"' + raw + b'":' + dumps(entry("U8", [1], 0, 1)).encode() + b"}", b"\1"))
        add(f"utf8_meta_{label}", "bad UTF-8", safetensors_bytes(b'{"__metadata__":{"k":"' + raw + b'"}}'))
    add("utf8_outside_string", "bad UTF-8", safetensors_bytes(b'{\xc3\xa9}'))
    add("utf8_at_header_end", "bad UTF-8", safetensors_bytes(valid_text.encode() + b"\xc3", data))
    for label, escape in (("high", "\\ud800"), ("low", "\\udc00"), ("high_high", "\\ud800\\ud800"), ("reversed", "\\udc00\\ud800")):
        add(f"surrogate_name_{label}", "bad UTF-8", safetensors_bytes('{"a' + escape + '":' + dumps(entry("U8", [1], 0, 1)) + "}", b"\1"))
        add(f"surrogate_meta_{label}", "bad UTF-8", safetensors_bytes('{"__metadata__":{"k":"' + escape + '"}}'))
    add("escaped_backslash_u", "control", safetensors_bytes('{"__metadata__":{"k":"\\\\ud800"}}'))
    add("bom", "bad UTF-8", safetensors_bytes(b"\xef\xbb\xbf" + valid_text.encode(), data))
    # -- non-finite and odd numbers
    for label, token in (("nan", "NaN"), ("inf", "Infinity"), ("minus_inf", "-Infinity"), ("1e999", "1e999"),
                         ("minus_zero", "-0"), ("exp", "1E1"), ("leading_zero", "01"), ("plus", "+1"), ("hex", "0x1")):
        add(f"number_shape_{label}", "non-finite values",
            safetensors_bytes('{"t":{"dtype":"U8","shape":[' + token + '],"data_offsets":[0,1]}}', b"\1"))
        add(f"number_meta_{label}", "non-finite values", safetensors_bytes('{"__metadata__":{"k":' + token + "}}"))
    # -- deep nesting
    for depth in (2, 3, 4, 64, 65, 100_000):
        add(f"deep_shape_{depth}", "deep nesting",
            safetensors_bytes('{"t":{"dtype":"U8","shape":' + nested(depth, inner="1") + ',"data_offsets":[0,1]}}', b"\1"))
        add(f"deep_meta_{depth}", "deep nesting", safetensors_bytes('{"__metadata__":{"k":' + nested(depth, '{"a":', "}", '"x"') + "}}"))
    add("deep_top_100000", "deep nesting", safetensors_bytes(nested(100_000)))
    add("deep_string_brackets", "control", safetensors_bytes('{"__metadata__":{"k":"' + "[{" * 50_000 + '"}}'))
    # -- truncated headers and length prefixes
    golden = GOLDEN_T1.read_bytes()
    n = struct.unpack("<Q", golden[:8])[0]
    for cut in sorted({0, 1, 4, 7, 8, 9, 10, 16, 50, n // 2, n + 4, n + 7, n + 8, n + 9, len(golden) // 2,
                       len(golden) - 8, len(golden) - 1}):
        add(f"truncated_{cut}", "truncated header", golden[:cut])
    for length in (0, 1, 2, n - 1, n + 1, n + 8, len(golden) - 8, len(golden) - 7, 100_000_000, 100_000_001,
                   104_857_600, 2 ** 32, 2 ** 63, 2 ** 64 - 1):
        add(f"header_length_{length}", "truncated header", struct.pack("<Q", length) + golden[8:])
    add("appended_byte", "NUL and garbage", golden + b"\0")
    # -- bit flips of a golden (seeded: every build flips the same bits)
    import random
    rnd = random.Random(20261202)
    for i in range(60):
        flipped = bytearray(golden)
        at = rnd.randrange(8 + n) if i < 45 else rnd.randrange(len(golden))
        flipped[at] ^= 1 << rnd.randrange(8)
        add(f"bitflip_{i}_{at}", "mutation: bit flip", bytes(flipped))
    # -- oversize: many tensors
    for count, klass in ((131_071, "control"), (131_072, "control"), (131_073, "oversize")):
        h = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
        add(f"tensors_{count}", klass, safetensors_bytes(dumps(h)))
    add("tensors_131072_and_metadata", "control",
        safetensors_bytes(dumps({"__metadata__": {}, **{f"t{i}": entry("U8", [0], 0, 0) for i in range(131_072)}})))
    return out


@needs_core
def test_the_safetensors_readers_agree_on_the_hostile_corpus(cases_of, server):
    import k3ref
    if not hasattr(k3ref._compiled(), "read_safetensors"):
        pytest.skip("k3ref._core predates read_safetensors: rebuild")
    outcomes = check_all(cases_of(safetensors_cases), server.read_cpp_safetensors, server.read_py_safetensors, minimum=300)
    for klass in ("non-regular", "bad dtype", "bad shape", "bad offsets", "NUL and garbage", "duplicate keys", "bad UTF-8",
                  "non-finite values", "deep nesting", "truncated header", "oversize"):
        assert outcomes[klass].get("refused"), f"no case of {klass} was refused"


# ---- manifests ------------------------------------------------------------------------------

def suite_with(work, name, manifest_bytes=None, make=None, with_file=True):
    d = Path(work) / "manifests" / name
    d.mkdir(parents=True)
    if with_file:
        shutil.copy(GOLDEN_T1, d)
    path = d / "MANIFEST.json"
    if make:
        make(path)
    else:
        path.write_bytes(manifest_bytes)
    return d


def manifest_cases(work):
    m = json.loads((GOLDENS / "MANIFEST.json").read_text())
    e1 = next(c for c in m["cases"] if c["name"] == "kda_t1")
    base = {"format": "k3ref-golden-manifest", "suite": "default", "generator_version": m["generator_version"],
            "cases": [e1]}
    if "schema" in m:
        base["schema"] = m["schema"]
    out = []

    def add(name, klass, obj=None, text=None, raw=None, make=None):
        content = raw if raw is not None else (text if text is not None else json.dumps(obj, indent=1)).encode("utf-8", "surrogatepass")
        out.append((f"manifest.{name}", klass, suite_with(work, name, None if make else content, make)))

    def changed(top=None, case=None, drop_top=(), drop_case=()):
        o = json.loads(json.dumps(base))
        for k in drop_case:
            o["cases"][0].pop(k, None)
        o["cases"][0].update(case or {})
        o.update(top or {})
        for k in drop_top:
            o.pop(k, None)
        return o

    add("valid", "control", base)
    add("committed", "control", raw=(GOLDENS / "MANIFEST.json").read_bytes())
    add("subset", "control", changed(top={"subset": True}))
    add("no_cases", "control", changed(top={"cases": []}))
    add("params_big_int", "control", changed(case={"params": {"x": 2 ** 70}}))
    add("params_1e308", "control", text=json.dumps(changed(case={"params": {"x": 1}})).replace('"x": 1', '"x": 1e308'))
    add("params_1e-400", "control", text=json.dumps(changed(case={"params": {"x": 1}})).replace('"x": 1', '"x": 1e-400'))
    add("params_int_400_digits", "non-finite values",
        text=json.dumps(changed(case={"params": {"x": 1}})).replace('"x": 1', '"x": ' + "9" * 400))
    add("params_1e999", "non-finite values", text=json.dumps(changed(case={"params": {"x": 1}})).replace('"x": 1', '"x": 1e999'))
    add("params_deep_64", "deep nesting", text=json.dumps(changed(case={"params": {"x": "P"}})).replace('"P"', nested(61)))
    add("params_deep_65", "deep nesting", text=json.dumps(changed(case={"params": {"x": "P"}})).replace('"P"', nested(62)))
    add("params_deep_100000", "deep nesting", text=json.dumps(changed(case={"params": {"x": "P"}})).replace('"P"', nested(100_000)))
    add("params_deep_objects", "deep nesting",
        text=json.dumps(changed(case={"params": {"x": "P"}})).replace('"P"', nested(100_000, '{"a":', "}")))
    for key in ("format", "suite", "generator_version", "cases"):
        add(f"missing_{key}", "bad field", changed(drop_top=[key]))
        add(f"wrong_type_{key}", "bad field", changed(top={key: 7}))
    for key in ("name", "op", "file", "sha256", "seed", "params"):
        add(f"case_missing_{key}", "bad field", changed(drop_case=[key]))
        add(f"case_wrong_type_{key}", "bad field", changed(case={key: [1]}))
    add("format_wrong", "bad field", changed(top={"format": "k3ref-golden-manifest-2"}))
    add("suite_unsafe", "bad field", changed(top={"suite": "../x"}))
    add("suite_long", "oversize", changed(top={"suite": "s" * 201}))
    add("suite_escape", "bad field", changed(top={"suite": "\x1b[2J"}))
    add("generator_unsafe", "bad field", changed(top={"generator_version": "1 2"}))
    add("schema_number", "bad field", changed(top={"schema": 2}))
    add("schema_unsafe", "bad field", changed(top={"schema": "a/b"}))
    add("subset_string", "bad field", changed(top={"subset": "true"}))
    add("subset_number", "bad field", changed(top={"subset": 1}))
    for label, name in (("dotdot", ".."), ("dot", "."), ("slash", "a/b"), ("empty", ""), ("long", "n" * 201),
                        ("space", "a b"), ("unicode", "caf\u00e9"), ("max", "n" * 200)):
        add(f"name_{label}", "bad field" if label != "max" else "control",
            changed(case={"name": name, "file": name + ".safetensors"}))
    add("file_other", "bad field", changed(case={"file": "x.safetensors"}))
    for label, sha in (("upper", e1["sha256"].upper()), ("short", e1["sha256"][:63]), ("long", e1["sha256"] + "0"),
                       ("non_hex", "g" * 64), ("huge", "f" * 1_000_000)):
        add(f"sha256_{label}", "bad field", changed(case={"sha256": sha}))
    for label, seed in (("negative", -1), ("float", 1.5), ("bool", True), ("2^64", 2 ** 64), ("max", 2 ** 64 - 1),
                        ("string", "1")):
        add(f"seed_{label}", "bad field" if label != "max" else "control", changed(case={"seed": seed}))
    for label, size in (("negative", -1), ("float", 1.0), ("string", "1"), ("zero", 0)):
        add(f"bytes_{label}", "bad field" if label != "zero" else "control", changed(case={"bytes": size}))
    add("params_array", "bad field", changed(case={"params": [1]}))
    add("case_not_object", "bad field", changed(top={"cases": [1]}))
    add("listed_twice", "duplicate keys", changed(top={"cases": [e1, e1]}))
    add("top_array", "bad field", raw=b"[]")
    add("top_string", "bad field", raw=b'"x"')
    text = json.dumps(base)
    add("dup_key_top", "duplicate keys", text=text.replace('"suite": "default"', '"suite": "default", "suite": "default"'))
    add("dup_key_case", "duplicate keys", text=text.replace('"name": "kda_t1"', '"name": "kda_t1", "name": "kda_t1"'))
    add("dup_key_params", "duplicate keys", text=json.dumps(changed(case={"params": {"x": 1}})).replace('"x": 1', '"x": 1, "x": 1'))
    add("nan", "non-finite values", text=json.dumps(changed(case={"params": {"x": 1}})).replace('"x": 1', '"x": NaN'))
    add("infinity", "non-finite values", text=json.dumps(changed(case={"params": {"x": 1}})).replace('"x": 1', '"x": -Infinity'))
    add("bom", "bad UTF-8", raw=b"\xef\xbb\xbf" + text.encode())
    add("nul", "NUL and garbage", raw=text.encode() + b"\0")
    add("garbage", "NUL and garbage", raw=text.encode() + b" garbage")
    add("two_values", "NUL and garbage", raw=text.encode() + b" {}")
    add("bad_utf8", "bad UTF-8", raw=text.replace('"default"', '"def\xff"').encode("latin-1"))
    add("bad_utf8_params", "bad UTF-8", raw=json.dumps(changed(case={"params": {"x": "P"}})).encode().replace(b'"P"', b'"\xc0\xaf"'))
    add("lone_surrogate", "bad UTF-8", text=json.dumps(changed(case={"params": {"x": "P"}})).replace('"P"', '"\\udc00"'))
    add("truncated", "truncated header", raw=text.encode()[: len(text) // 2])
    add("empty", "truncated header", raw=b"")
    values = 1 << 20
    add("values_at_limit", "control", text=json.dumps(changed(case={"params": {"x": "P"}})).replace('"P"', "[" + "0," * (values - 9) + "0]"))
    add("values_past_limit", "oversize", text=json.dumps(changed(case={"params": {"x": "P"}})).replace('"P"', "[" + "0," * values + "0]"))
    add("empty_objects_past_limit", "oversize", text=json.dumps(changed(case={"params": {"x": "P"}})).replace('"P"', "[" + "{}," * values + "{}]"))
    add("huge_file", "oversize", text=json.dumps(changed(case={"params": {"x": "P"}})).replace('"P"', '"' + "a" * (16 << 20) + '"'))
    add("fifo", "non-regular", make=lambda p: os.mkfifo(p))
    add("dev_zero", "non-regular", make=lambda p: os.symlink("/dev/zero", p))
    add("directory", "non-regular", make=lambda p: p.mkdir())
    add("dangling_link", "non-regular", make=lambda p: os.symlink("no_such_file", p))
    return out


def read_cpp_manifest(server, directory):
    code, output = server.run_command(["golden", "verify", "--dir", str(directory), "--generated", str(directory),
                                       "-q"], directory)
    if code is None:
        return ("failed", f"ran past {TIME_LIMIT_S:.0f} s")
    if code == 2:
        return ("refused", output.decode(errors="replace"))
    if code in (0, 1):
        return ("ok", None)
    return ("failed", f"exit {code}: {output.decode(errors='replace')[:300]}")


def read_py_manifest(directory):
    def read(d):
        from k3ref import goldens
        goldens.manifest(d)
        return None
    return in_child(read, directory)


def test_the_manifest_readers_agree_on_hostile_manifests(cases_of, server):
    if not os.path.exists(EXE):
        pytest.skip(f"no k3ref command at {EXE}")
    outcomes = check_all(cases_of(manifest_cases), lambda d: read_cpp_manifest(server, d), read_py_manifest, minimum=80)
    assert outcomes["control"].get("ok") and outcomes["bad field"].get("refused")


# ---- policy tables ------------------------------------------------------------------------

def policy_cases(work):
    table = json.loads((ROOT / "policy" / "policies.json").read_text())
    text = json.dumps(table, indent=1)
    out = []
    d = Path(work) / "policies"
    d.mkdir(parents=True, exist_ok=True)

    def add(name, klass, obj=None, text_=None, raw=None, make=None):
        path = d / f"{name}.json"
        if make:
            make(path)
        else:
            path.write_bytes(raw if raw is not None else (text_ if text_ is not None else json.dumps(obj)).encode(
                "utf-8", "surrogatepass"))
        out.append((f"policy.{name}", klass, path))

    def changed(fn):
        t = json.loads(text)
        fn(t)
        return t

    op = "kda.recurrent"
    add("valid", "control", table)
    add("valid_no_about", "control", changed(lambda t: t.pop("about", None)))
    add("valid_extra_policy", "control", changed(lambda t: t["policies"].update({"mine": {"rules": {}}})))
    for key in ("format", "version", "operators", "policies"):
        add(f"missing_{key}", "bad field", changed(lambda t, k=key: t.pop(k)))
        add(f"wrong_type_{key}", "bad field", changed(lambda t, k=key: t.update({k: [1]})))
    for label, version in (("2", 2), ("string", "1"), ("float", 1.0), ("bool", True), ("huge", 2 ** 70)):
        add(f"version_{label}", "bad field", changed(lambda t, v=version: t.update({"version": v})))
    add("version_huge_literal", "bad field", text_=text.replace('"version": 1', '"version": ' + "9" * 400, 1))
    add("unknown_top_key", "bad field", changed(lambda t: t.update({"extra": 1})))
    add("format_wrong", "bad field", changed(lambda t: t.update({"format": "x"})))
    add("no_kda_recurrent", "bad field", changed(lambda t: (t["operators"].pop(op), [p.get("rules", {}).pop(op, None)
                                                                                     for p in t["policies"].values()])))
    add("op_unknown_key", "bad field", changed(lambda t: t["operators"][op].update({"x": 1})))
    add("op_outputs_empty", "bad field", changed(lambda t: t["operators"][op].update({"outputs": {}})))
    add("op_inputs_not_names", "bad field", changed(lambda t: t["operators"][op].update({"inputs": [1]})))
    first_output = next(iter(table["operators"][op]["outputs"]))
    add("output_role_bad", "bad field", changed(lambda t: t["operators"][op]["outputs"][first_output].update({"role": "x"})))
    add("output_dtype_bad", "bad field", changed(lambda t: t["operators"][op]["outputs"][first_output].update({"dtype": "fp8"})))
    add("output_unknown_key", "bad field", changed(lambda t: t["operators"][op]["outputs"][first_output].update({"x": 1})))
    add("output_dtype_int", "control", changed(lambda t: t["operators"][op]["outputs"][first_output].update({"dtype": "int"})))
    add("policy_reserved_exact", "bad field", changed(lambda t: t["policies"].update({"exact": {"rules": {}}})))
    add("policy_reserved_floor", "bad field", changed(lambda t: t["policies"].update({"floor:3": {"rules": {}}})))
    add("policy_unknown_key", "bad field", changed(lambda t: t["policies"].update({"p": {"rules": {}, "x": 1}})))
    add("policy_rules_array", "bad field", changed(lambda t: t["policies"].update({"p": {"rules": []}})))
    add("policy_unknown_op", "bad field", changed(lambda t: t["policies"].update({"p": {"rules": {"no.op": {}}}})))
    rule = lambda spec: changed(lambda t: t["policies"].update({"p": {"rules": {op: {"output": spec, "stage": spec,
                                                                                      "gradient": spec}}}}))
    add("rule_valid", "control", rule({"metric": "floor", "multiple": 2}))
    add("rule_no_metric", "bad field", rule({"multiple": 2}))
    add("rule_bad_metric", "bad field", rule({"metric": "x"}))
    add("rule_missing_multiple", "bad field", rule({"metric": "floor"}))
    for label, value in (("zero", "0"), ("negative", "-1"), ("string", '"2"'), ("bool", "true"), ("null", "null"),
                         ("nan", "NaN"), ("inf", "Infinity"), ("1e999", "1e999"), ("big_int", "9" * 400),
                         ("tiny", "1e-300"), ("int", "3")):
        add(f"multiple_{label}", "control" if label in ("tiny", "int") else (
            "non-finite values" if label in ("nan", "inf", "1e999", "big_int") else "bad field"),
            text_=json.dumps(rule({"metric": "floor", "multiple": "P"})).replace('"P"', value))
    add("rule_wrong_parameter", "bad field", rule({"metric": "floor", "multiple": 2, "bound": 1}))
    add("rule_floor_dtype_bad", "bad field", rule({"metric": "floor", "multiple": 2, "floor_dtype": "x"}))
    add("rule_unknown_key", "bad field", rule({"metric": "exact", "x": 1}))
    add("rule_missing_role", "bad field", changed(lambda t: t["policies"].update({"p": {"rules": {op: {"output": {"metric": "exact"}}}}})))
    add("nul", "NUL and garbage", raw=text.encode() + b"\0")
    add("garbage", "NUL and garbage", raw=text.encode() + b"x")
    add("bom", "bad UTF-8", raw=b"\xef\xbb\xbf" + text.encode())
    add("bad_utf8", "bad UTF-8", raw=text.encode().replace(b'"about"', b'"ab\xffout"', 1))
    add("lone_surrogate", "bad UTF-8", text_=json.dumps(changed(lambda t: t.update({"about": "P"}))).replace('"P"', '"\\ud800"'))
    add("dup_key_top", "duplicate keys", text_=text.replace('"version": 1', '"version": 1, "version": 1', 1))
    add("dup_key_deep", "duplicate keys", text_=json.dumps(rule({"metric": "exact"})).replace('"metric": "exact"',
                                                                                           '"metric": "exact", "metric": "exact"', 1))
    for depth in (63, 64, 65, 100_000):
        add(f"deep_{depth}", "deep nesting", text_=json.dumps(changed(lambda t: t.update({"about": "P"}))).replace(
            '"P"', nested(depth - 1)))
    add("escape_keys", "bad field", changed(lambda t: t["operators"][op].update({"\x1b[2J\nx": 1})))
    add("long_key", "bad field", changed(lambda t: t["operators"][op].update({"k" * 100_000: 1})))
    add("truncated", "truncated header", raw=text.encode()[: len(text) // 2])
    add("empty", "truncated header", raw=b"")
    add("huge", "oversize", text_=json.dumps(changed(lambda t: t.update({"about": "a" * (4 << 20)}))))
    add("fifo", "non-regular", make=lambda p: os.mkfifo(p))
    add("dev_zero", "non-regular", make=lambda p: os.symlink("/dev/zero", p))
    add("directory", "non-regular", make=lambda p: p.mkdir())
    return out


def read_cpp_policy(server, path):
    code, output = server.run_command(["compare", "--golden", str(GOLDEN_T1), "--candidate", str(GOLDEN_T1),
                                       "--policy", "floor:2", "--policy-table", str(path)], path.parent)
    if code is None:
        return ("failed", f"ran past {TIME_LIMIT_S:.0f} s")
    if code == 2:
        return ("refused", output.decode(errors="replace"))
    if code == 0:
        return ("ok", None)
    return ("failed", f"exit {code}: {output.decode(errors='replace')[:300]}")


def read_py_policy(path):
    def read(p):
        from k3ref import _safetensors, goldens, policy
        meta = _safetensors.read(GOLDEN_T1).metadata
        rules = policy.load_table(p).rules("floor:2", meta["k3ref.op"])
        missing = [n for n in goldens.expand_outputs(meta["k3ref.outputs"]) if n not in rules]
        if missing:
            raise ValueError(f"golden outputs {missing} are not in the table's {meta['k3ref.op']}")
        return None
    return in_child(read, path)


@needs_core  # the Python side reads the table through k3ref._core
def test_the_policy_table_readers_agree_on_hostile_tables(cases_of, server):
    if not os.path.exists(EXE):
        pytest.skip(f"no k3ref command at {EXE}")
    check_all(cases_of(policy_cases), lambda p: read_cpp_policy(server, p), read_py_policy, minimum=60)


# ---- k3ref.outputs patterns ---------------------------------------------------------------

OUTPUT_PATTERNS = {
    "plain": "o,final_state", "group": "{o,final_state}", "braces_2^16": "{a,b}" * 16 + ",o,final_state",
    "braces_2^17": "{a,b}" * 17, "braces_2^17_plus": "{a,b}" * 17 + ",o", "braces_2^40": "{a,b}" * 40,
    "commas_131072": ",".join(["o"] * 131_072), "commas_131073": ",".join(["o"] * 131_073),
    "commas_5M": ",".join(["o"] * 5_000_000), "nested": "{a,{b,c}}", "unbalanced_open": "{a,b",
    "unbalanced_close": "a,b}", "empty": "", "empty_items": ",,o,,final_state,,", "empty_group": "o{}",
    "long_names": ",".join(["n" * 200_000] * 90), "long_names_braces": "n" * 1_000_000 + "{a,b}" * 5,
    "escapes": "o,\x1b[2J", "many_groups": "{o}" * 1000,
}


def outputs_cases(work):
    d = Path(work) / "outputs"
    d.mkdir(parents=True, exist_ok=True)
    out = []
    raw = GOLDEN_T1.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    for label, pattern in OUTPUT_PATTERNS.items():
        h = dict(header)
        h["__metadata__"] = dict(h["__metadata__"], **{"k3ref.outputs": pattern})
        path = d / f"{label}.safetensors"
        path.write_bytes(safetensors_bytes(json.dumps(h), raw[8 + n:]))
        out.append((f"outputs.{label}", "output expansion", path))
    return out


def read_cpp_outputs(server, path):
    code, output = server.run_command(["compare", "--golden", str(path), "--candidate", str(path), "--policy",
                                       "floor:2"], path.parent)
    if code is None:
        return ("failed", f"ran past {TIME_LIMIT_S:.0f} s")
    if code == 2 and b"k3ref.outputs '" in output:  # check::expand_outputs's refusals quote the value
        return ("refused", output.decode(errors="replace"))
    if code in (0, 1, 2):
        return ("ok", None)  # expanded; the judgement then passed, failed, or refused the names
    return ("failed", f"exit {code}: {output.decode(errors='replace')[:300]}")


def read_py_outputs(path):
    def read(p):
        from k3ref import _safetensors, goldens
        goldens.expand_outputs(_safetensors.read(p).metadata["k3ref.outputs"])
        return None
    return in_child(read, path)


@needs_core  # the Python side expands through k3ref._core (check::expand_outputs)
def test_the_output_pattern_expansions_agree(cases_of, server):
    if not os.path.exists(EXE):
        pytest.skip(f"no k3ref command at {EXE}")
    check_all(cases_of(outputs_cases), lambda p: read_cpp_outputs(server, p), read_py_outputs, minimum=15)


# ---- the known-limitations registry (Python only) -----------------------------------------

def limitations_cases(work):
    from k3ref.gpu_check.collection import KNOWN_LIMITATIONS
    d = Path(work) / "limitations"
    d.mkdir(parents=True, exist_ok=True)
    good = {"adapter": "fla", "check": "parity", "case": "T=1", "reason": "r"}
    out = []

    def add(name, klass, obj=None, raw=None, make=None):
        path = d / f"{name}.json"
        if make:
            make(path)
        else:
            path.write_bytes(raw if raw is not None else json.dumps(obj).encode("utf-8", "surrogatepass"))
        out.append((f"limitations.{name}", klass, path))

    add("committed", "control", raw=Path(KNOWN_LIMITATIONS).read_bytes())
    add("valid", "control", {"entries": [good, {"adapter": "a[1]", "check": "c*", "case_pattern": "T=*", "reason": "r"}]})
    add("not_object", "bad field", [good])
    add("entries_object", "bad field", {"entries": {}})
    add("entry_not_object", "bad field", {"entries": [1]})
    for key in ("adapter", "check", "reason"):
        add(f"missing_{key}", "bad field", {"entries": [{k: v for k, v in good.items() if k != key}]})
        add(f"empty_{key}", "bad field", {"entries": [dict(good, **{key: ""})]})
        add(f"number_{key}", "bad field", {"entries": [dict(good, **{key: 1})]})
    add("unknown_key", "bad field", {"entries": [dict(good, x=1)]})
    add("case_and_pattern", "bad field", {"entries": [dict(good, case_pattern="*")]})
    add("case_is_pattern", "bad field", {"entries": [dict(good, case="T=*")]})
    add("escape_key", "bad field", {"entries": [dict(good, **{"\x1b[2J\nx": 1})]})
    add("escape_reason", "control", {"entries": [dict(good, reason="\x1b[2J\nx")]})
    add("dup_key", "duplicate keys", raw=b'{"entries": [], "entries": []}')
    add("nan", "non-finite values", raw=b'{"entries": [], "about": NaN}')
    add("deep", "deep nesting", raw=b'{"entries": [], "about": ' + nested(100_000).encode() + b"}")
    add("nul", "NUL and garbage", raw=b'{"entries": []}\0')
    add("bad_utf8", "bad UTF-8", raw=b'{"entries": [], "about": "\xff"}')
    add("huge", "oversize", raw=b'{"entries": [], "about": "' + b"a" * (2 << 20) + b'"}')
    add("fifo", "non-regular", make=lambda p: os.mkfifo(p))
    add("dev_zero", "non-regular", make=lambda p: os.symlink("/dev/zero", p))
    add("directory", "non-regular", make=lambda p: p.mkdir())
    return out


def test_the_limitations_reader_accepts_or_refuses_in_one_line(cases_of):
    def read(p):
        from k3ref.gpu_check.collection import load_limitations
        load_limitations(p)
        return None
    problems = []
    for name, klass, path in cases_of(limitations_cases):
        outcome = in_child(read, path)
        expected = "ok" if klass == "control" else "refused"
        if outcome[0] != expected or (outcome[0] == "refused" and not one_line(outcome[1])):
            problems.append(f"{name}: {outcome[0]} ({str(outcome[1])[:200]!r}), expected {expected} in one line")
    assert not problems, "\n".join(problems)


def test_the_corpus_has_at_least_300_cases_of_every_class(cases_of):
    """The count the hostile round asks for, over every reader's cases (the ones the tests above read)."""
    counts = {}
    everything = [case for make in (safetensors_cases, manifest_cases, policy_cases, outputs_cases, limitations_cases)
                  for case in cases_of(make)]
    for _, klass, _ in everything:
        counts[klass] = counts.get(klass, 0) + 1
    print(f"\n{len(everything)} cases in {len(counts)} classes: {counts}")
    assert len(everything) >= 300
    for klass in ("non-regular", "oversize", "deep nesting", "NUL and garbage", "duplicate keys", "output expansion",
                  "bad UTF-8", "truncated header", "bad offsets", "non-finite values", "bad dtype", "bad shape"):
        assert counts.get(klass), klass
