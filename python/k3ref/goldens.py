"""Golden cases as torch tensors: parameters, inputs, expected outputs, recommended
tolerances (k3ref.reference_of(case): the references' outputs for a case).

    from k3ref import goldens
    case = goldens.load_case("kda_varlen")          # a name in the golden directory, or a path
    case.inputs        # {name: tensor} as stored (bf16 inputs stay bf16): the file's k3ref.inputs
    case.expected      # {name: tensor} the outputs (float64), in the file's output order
    case.layout        # {name: tensor} index tensors describing the layout (chunk_starts, ...)
    case.params        # the generator's parameters (dict), all of them in one object
    case.options       # keyword arguments of the matching k3ref reference (CLI option names)
    case.recommended_policies      # {output: policy name} the file recommends (policy/policies.json)
    case.tolerances()  # {output: Rule} under the recommended policies, or tolerances("recurrent")

Files follow the golden schema (docs/golden-format.md, "Schema"; `k3ref.schema` = SCHEMA):
every tensor is listed in exactly one of `k3ref.inputs`, `k3ref.outputs`, `k3ref.layout`.
Files are read with the `safetensors` package when it is installed, else with
k3ref._safetensors (the project's own reader); both give the same tensors. The golden
directory: the `directory` argument, else $K3REF_GOLDENS, else the checkout's goldens/ when
k3ref runs from a source tree, else the suite installed with the package.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Container, Mapping, NoReturn

import numpy as np
import torch

from . import _safetensors
from ._references import kda_options

if TYPE_CHECKING:
    from .policy import PolicyTable, Rule

# The golden schema this module reads (docs/golden-format.md, "Schema").
SCHEMA = "2"


def directory(path: str | os.PathLike[str] | None = None) -> Path:
    """The golden directory: `path`, else $K3REF_GOLDENS, else the checkout's goldens/ when
    the package runs from a source tree, else the suite installed with the package
    (k3ref/data/goldens)."""
    if path is not None:
        return Path(path)
    if os.environ.get("K3REF_GOLDENS"):
        return Path(os.environ["K3REF_GOLDENS"])
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[1] / "goldens", here / "data" / "goldens"):  # python/k3ref/goldens.py
        if (candidate / "MANIFEST.json").is_file():
            return candidate
    raise FileNotFoundError("k3ref.goldens: no golden directory: pass one, or set K3REF_GOLDENS to a suite "
                            "(an installed k3ref ships one in k3ref/data/goldens; this one does not)")


def _has_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401
        return True
    except ImportError:
        return False


def _torch_of(raw: Any) -> torch.Tensor:
    """A torch tensor (a copy) with the stored dtype where torch has it."""
    if raw.dtype == "BF16":
        return torch.from_numpy(_safetensors.bf16_bits(raw).view(np.int16).copy()).view(torch.bfloat16)
    if raw.dtype in ("F8_E4M3", "F8_E5M2"):
        name = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}[raw.dtype]
        if hasattr(torch, name):
            codes = np.frombuffer(raw.data, dtype=np.uint8).reshape(raw.shape).copy()
            return torch.from_numpy(codes).view(getattr(torch, name))
        return torch.from_numpy(_safetensors.to_numpy(raw, widen=False))  # float32, exact
    return torch.from_numpy(_safetensors.to_numpy(raw))


def read_tensors(path: str | os.PathLike[str], reader: str = "auto") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file as torch tensors. reader: "auto" (the
    safetensors package when installed, else k3ref's), "safetensors" or "k3ref"."""
    if reader not in ("auto", "safetensors", "k3ref"):
        raise ValueError(f"k3ref.goldens: reader must be 'auto', 'safetensors' or 'k3ref', not {reader!r}")
    if reader == "safetensors" or (reader == "auto" and _has_safetensors()):
        from safetensors import safe_open
        # Validate with k3ref's reader too: it gives the tensors' order in the file and
        # rejects what the format forbids.
        order = list(_safetensors.read(path).tensors)
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            return {name: f.get_tensor(name) for name in order}, meta
    f = _safetensors.read(path)
    return {name: _torch_of(t) for name, t in f.tensors.items()}, dict(f.metadata)


def expand_outputs(spec: str) -> list[str]:
    from .policy import expand_outputs as expand
    return expand(spec)


@dataclass
class GoldenCase:
    name: str
    op: str
    path: Path
    params: dict[str, Any]
    tensors: dict[str, torch.Tensor]  # every tensor of the file, in file order
    outputs: list[str]                # the names of k3ref.outputs, expanded, in order
    metadata: dict[str, str] = field(default_factory=dict)
    input_names: list[str] = field(default_factory=list)    # k3ref.inputs
    layout_names: list[str] = field(default_factory=list)   # k3ref.layout
    recommended_policies: dict[str, str] = field(default_factory=dict)  # k3ref.policies: {output: policy}

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        """The tensors the operator takes (the file's k3ref.inputs), in file order."""
        return {n: self.tensors[n] for n in self.input_names}

    @property
    def layout(self) -> dict[str, torch.Tensor]:
        """Index tensors describing the layout (the file's k3ref.layout): chunk_starts, ..."""
        return {n: self.tensors[n] for n in self.layout_names}

    @property
    def expected(self) -> dict[str, torch.Tensor]:
        """The expected outputs, in the file's output order."""
        return {n: self.tensors[n] for n in self.outputs if n in self.tensors}

    @property
    def reference_precision(self) -> str:
        return self.metadata.get("k3ref.reference_precision", "")

    @property
    def kda_params(self) -> dict[str, Any]:
        """The KDA parameters: the case's one parameter object (the KDA keys sit beside the
        family's own)."""
        return self.params

    @property
    def options(self) -> dict[str, Any]:
        """Keyword arguments of the matching k3ref reference (the `k3ref kda` option names)."""
        op = self.op
        if op.startswith("kda.") or op.startswith("kcp."):
            p = self.kda_params
            o = kda_options(p)
            if op == "kda.recurrent":
                o["all_states"] = bool(p["all_states"])
            elif op.startswith("kda.chunkwise_"):
                o.update(chunk_form=p["form"], chunk_size=p["chunk_size"], sub_chunk=p["sub_chunk"], stages=True)
            elif op == "kcp.context_parallel":
                o["merge"] = self.params["merge"]
            return o
        if op.startswith("attnres."):
            return dict(eps=self.params["eps"], block_size=self.params["block_size"], two_phase=op == "attnres.phase1")
        if op == "qb.solver":
            return dict(k=self.params["k"], iterations=self.params["iterations"])
        return {}

    def policies(self, table: PolicyTable | str | os.PathLike[str] | None = None) -> dict[str, str]:
        """{policy name: what it is for} of the table's named policies that cover this operator
        (the parametric ones, "exact", "floor:<m>", "rel-rms:<r>", cover every operator)."""
        from . import policy as _policy
        t = table if isinstance(table, _policy.PolicyTable) else _policy.load_table(table)
        return {name: t.about.get(name, "") for name in t.policy_names() if self.op in t.operators_of(name)}

    def tolerances(self, policy: str | None = None, table: PolicyTable | str | os.PathLike[str] | None = None) -> dict[str, Rule]:
        """{output: k3ref.policy.Rule}: the metric, floor dtype and bound that `policy` sets for
        each expected output of this operator (the policy table, docs/tolerances.md); without
        a policy, each output's recommended policy (the file's k3ref.policies)."""
        from . import policy as _policy
        t = table if isinstance(table, _policy.PolicyTable) else _policy.load_table(table)
        if policy is not None:
            rules = t.rules(policy, self.op)
            return {n: rules[n] for n in self.outputs if n in rules}
        out: dict[str, Rule] = {}
        for n in self.outputs:
            if n not in self.recommended_policies:
                raise ValueError(f"k3ref.goldens: case '{self.name}' recommends no policy for output '{n}'")
            out[n] = t.rules(self.recommended_policies[n], self.op)[n]
        return out


# A case name as the C++ golden tool accepts it (src/golden/suite.cc): a file stem of letters,
# digits, '_', '-' and '.', at most 200 characters, not '.' or '..' (so never a path).
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
MAX_MANIFEST_BYTES = 16 * 1024 * 1024


def check_case_name(name: object, where: str = "k3ref.goldens") -> str:
    """`name` if it is a valid case name, else ValueError (one line)."""
    if (not isinstance(name, str) or not name or len(name) > 200 or name in (".", "..")
            or not set(name) <= _NAME_CHARS):
        raise ValueError(f"{where}: {str(name)[:80]!r} is not a case name (letters, digits, '_', '-', '.'; "
                         f"at most 200 characters; no path)")
    return name


MAX_MANIFEST_VALUES = 1 << 20  # the C++ reader's max_manifest_values (src/golden/suite.h)
_HEX = frozenset("0123456789abcdef")


def _is_plain(text: object) -> bool:
    return isinstance(text, str) and bool(text) and len(text) <= 200 and text not in (".", "..") and set(text) <= _NAME_CHARS


def _is_unsigned(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 64


def manifest(directory_: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The parsed MANIFEST.json of a golden directory, or None when the directory has none.
    Read under k3ref._bounded's rules and checked field by field as the C++ reader checks it
    (golden::parse_manifest: format, suite, generator_version, schema, subset, and each case's
    name, op, file, sha256, seed, bytes and params), so that both take the same manifests
    (tests/python/test_reader_parity.py). ValueError (one line) otherwise."""
    from ._bounded import load_json

    path = directory(directory_) / "MANIFEST.json"
    if not path.exists() and not path.is_symlink():
        return None
    data = load_json(path, "golden manifest", limit=MAX_MANIFEST_BYTES, max_values=MAX_MANIFEST_VALUES,
                     plain_keys=False)  # (params are the generator's, any key: as golden::parse_manifest)

    def fail(where: str, what: str) -> NoReturn:
        raise ValueError(f"golden manifest {path}: {where}{': ' if where else ''}{what}")

    def string(obj: Mapping[str, Any], key: str, where: str) -> str:
        if not isinstance(obj.get(key), str):
            fail(where, f"field '{key}' missing or not a string")
        return obj[key]

    if not isinstance(data, dict):
        fail("", "top level is not a JSON object")
    if string(data, "format", "") != "k3ref-golden-manifest":
        fail("", "field 'format' is not k3ref-golden-manifest")
    for key in ("suite", "generator_version"):
        if not _is_plain(string(data, key, "")):
            fail("", f"field '{key}' {data[key][:60]!r} is not a plain name ([A-Za-z0-9_.-], at most 200)")
    if "schema" in data and not _is_plain(data["schema"]):
        fail("", "field 'schema' is not a plain version string ([A-Za-z0-9_.-], at most 200)")
    if "subset" in data and not isinstance(data["subset"], bool):
        fail("", "field 'subset' is not a boolean")
    cases = data.get("cases")
    if not isinstance(cases, list):
        fail("", "field 'cases' missing or not an array")
    names: set[str] = set()
    for i, c in enumerate(cases):
        where = f"case #{i}"
        if not isinstance(c, dict):
            fail(where, "not a JSON object")
        name = string(c, "name", where)
        check_case_name(name, f"golden manifest {path}: {where}")
        where = f"case {name!r}"
        if name in names:
            fail(where, "listed twice")
        names.add(name)
        string(c, "op", where)
        if string(c, "file", where) != name + ".safetensors":
            fail(where, f"field 'file' is not '{name}.safetensors'")
        sha = string(c, "sha256", where)
        if len(sha) != 64 or not set(sha) <= _HEX:
            fail(where, "'sha256' must be 64 lowercase hexadecimal digits")
        if not _is_unsigned(c.get("seed")):
            fail(where, "field 'seed' missing or not an unsigned integer")
        if "bytes" in c and not _is_unsigned(c["bytes"]):
            fail(where, "field 'bytes' is not an unsigned integer")
        if not isinstance(c.get("params"), dict):
            fail(where, "field 'params' missing or not an object")
    return data


def sha256_of_file(path: str | os.PathLike[str]) -> str:
    """Lower-case hexadecimal sha256 of a file, read in 1 MiB pieces."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_case(name_or_path: str | os.PathLike[str], directory_: str | os.PathLike[str] | None = None, *,
              reader: str = "auto", verify: bool = True) -> GoldenCase:
    """One golden case: a path to a .safetensors file, or a case name in the golden directory.

    verify (default True): a case loaded by name from a directory with a MANIFEST.json must be
    listed there and its file must match the manifest's sha256 (an edited or substituted
    golden is an error naming the file); verify=False skips the digest. A name must be a case
    name (no path, see check_case_name)."""
    p = Path(name_or_path)
    listed: Any = None
    if not p.suffix == ".safetensors":
        check_case_name(str(name_or_path))
        d = directory(directory_)
        p = d / f"{name_or_path}.safetensors"
        m = manifest(d) if verify else None
        if m is not None:
            listed = next((c for c in m["cases"] if c["name"] == name_or_path), None)
            if listed is None:
                raise FileNotFoundError(f"k3ref.goldens: no case {name_or_path!r} in {d / 'MANIFEST.json'}")
    return _read_case(p, listed, reader)


def _read_case(p: Path, listed: Mapping[str, Any] | None, reader: str) -> GoldenCase:
    """The case in file p, checked against its manifest entry `listed` (None: not checked)."""
    if not p.is_file():
        raise FileNotFoundError(f"k3ref.goldens: no golden file {p}")
    if listed is not None and sha256_of_file(p) != listed["sha256"]:
        raise ValueError(f"{p}: sha256 differs from MANIFEST.json's: the file was changed or replaced "
                         "(regenerate the suite, or pass verify=False)")
    tensors, meta = read_tensors(p, reader)
    if meta.get("k3ref.schema") != SCHEMA:
        raise ValueError(f"{p}: golden schema {meta.get('k3ref.schema', '(none)')!r}, this k3ref reads {SCHEMA!r} "
                         "(docs/golden-format.md): regenerate it with this version's `k3ref golden generate`")
    try:
        params = json.loads(meta["k3ref.params"])
        policies = json.loads(meta["k3ref.policies"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"{p}: metadata 'k3ref.params' / 'k3ref.policies' missing or not JSON ({e})") from None
    lists = {key: expand_outputs(meta.get(f"k3ref.{key}", "")) for key in ("inputs", "outputs", "layout")}
    named = lists["inputs"] + lists["outputs"] + lists["layout"]
    if sorted(named) != sorted(tensors):
        raise ValueError(f"{p}: k3ref.inputs, k3ref.outputs and k3ref.layout must list every tensor exactly once "
                         f"(listed {sorted(named)}, file holds {sorted(tensors)})")
    return GoldenCase(name=meta.get("k3ref.case", p.stem), op=meta.get("k3ref.op", ""), path=p, params=params,
                      tensors=tensors, outputs=lists["outputs"], metadata=meta, input_names=lists["inputs"],
                      layout_names=lists["layout"], recommended_policies=policies)


def case_names(directory_: str | os.PathLike[str] | None = None, ops: Container[str] | None = None) -> list[str]:
    """Names of the cases in the directory's MANIFEST.json, in its order (optionally only
    operators in `ops`); without a manifest, of every .safetensors file, by name."""
    d = directory(directory_)
    m = manifest(d)
    if m is None:
        return [c.name for c in load_suite(d, ops)]
    return [c["name"] for c in m["cases"] if ops is None or c.get("op") in ops]


def load_suite(directory_: str | os.PathLike[str] | None = None, ops: Container[str] | None = None, *,
               reader: str = "auto") -> list[GoldenCase]:
    """Every case of the manifest (optionally only operators in `ops`), in its order, each
    checked against the manifest's sha256; a
    directory without MANIFEST.json (e.g. failures written by k3ref.gpu_check prop): every
    .safetensors file, by file name."""
    d = directory(directory_)
    m = manifest(d)  # read once for the whole suite
    if m is not None:
        cases = [c for c in m["cases"] if ops is None or c.get("op") in ops]
        for c in cases:
            check_case_name(c["name"])
        return [_read_case(d / f"{c['name']}.safetensors", c, reader) for c in cases]
    cases = [load_case(p, reader=reader) for p in sorted(d.glob("*.safetensors"))]
    return [c for c in cases if ops is None or c.op in ops]
