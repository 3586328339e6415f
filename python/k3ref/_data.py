"""What k3ref ships beside its Python modules: the data files (policy/*.json), next to the
package's modules in an installed package, else in the checkout's policy/ folder
(python/k3ref/ -> policy/); and the compiled half, k3ref._core."""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

_core_module: Any = None

# The floating formats by the name of their torch dtype (torch.bfloat16 -> "bf16"): the one
# table, here without torch so that the torch-free modules (kernel_domains) read it too.
FORMAT_NAMES = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# A torch dtype's safetensors name, by the dtype's name (torch.bfloat16 -> "BF16"): the names
# the judge reports, and, where the safetensors reader's DTYPES has them too, what k3ref.save
# writes.
TORCH_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
               "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def torch_code(dtype: Any) -> str | None:
    """The safetensors name of a torch dtype, None for one without."""
    return TORCH_CODES.get(str(dtype).removeprefix("torch."))


def shipped_file(name: str, what: str) -> Path:
    """The path of the shipped data file `name`; FileNotFoundError naming both places looked in
    (`what` says which file, e.g. "policy table")."""
    here = Path(__file__).resolve().parent
    places = (here / name, here.parent.parent / "policy" / name)
    for p in places:
        if p.is_file():
            return p
    raise FileNotFoundError(f"k3ref {what} not found: looked for {places[0]} and {places[1]}")


def compiled() -> Any:
    """The compiled half (k3ref._core), imported on first use. A source checkout's tests point
    K3REF_CORE_PATH at the build directory that holds it."""
    global _core_module
    if _core_module is None:
        package = sys.modules[__package__]
        extra = os.environ.get("K3REF_CORE_PATH")
        if extra and extra not in package.__path__:
            package.__path__.append(extra)
        try:
            _core_module = importlib.import_module("._core", __package__)
        except ImportError as e:
            raise ImportError(f"k3ref's compiled references (k3ref._core) are not available ({e}); install the "
                              "package (docs/python.md) or set K3REF_CORE_PATH to the build's python/ directory"
                              ) from None
    return _core_module
