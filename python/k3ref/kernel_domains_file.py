"""The kernel-domains file: policy/kernel_domains.json, shipped with k3ref (the built-in
kernels' domains), or a file given, read under the package's bounded rules and checked whole
by k3ref.kernel_domains (the schema and its verdicts, docs/kernel-domains.md)."""
from __future__ import annotations

from pathlib import Path

from ._bounded import load_json
from ._data import shipped_file
from .kernel_domains import KernelDomain, KernelDomainError, parse


def path() -> Path:
    """The file shipped with k3ref: next to this module in an installed package, else the
    checkout's policy/kernel_domains.json."""
    return shipped_file("kernel_domains.json", "kernel domains")


_BUILTIN = {}


def load(file: str | Path | None = None) -> dict[str, KernelDomain]:
    """The domains of `file` (default: the shipped one, read once), under the package's JSON rules."""
    file = Path(file) if file is not None else path()
    if file not in _BUILTIN:
        try:
            data = load_json(file, "kernel domains", limit=1 << 20)
        except ValueError as e:
            raise KernelDomainError(str(e)) from None
        _BUILTIN[file] = parse(data, f"kernel domains {file}")
    return _BUILTIN[file]


def builtin(name: str) -> KernelDomain:
    """The shipped domain of built-in kernel `name`; an unknown name is a KeyError naming the known ones."""
    domains = load()
    if name not in domains:
        raise KeyError(f"no kernel domain named '{name}' (known: {', '.join(domains)})")
    return domains[name]
