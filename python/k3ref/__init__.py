"""k3ref: reference implementations of the Kimi K3 operators for torch tensors.

Every reference takes its tensors as one mapping named like the tensors of a golden file
(and of the `k3ref kda --in` file), options named like the `k3ref kda` command's options
(`--lower-bound` is `lower_bound=`, `--l2norm` is `l2norm=True`), and returns a dict of
torch.float64 tensors on the CPU. Input tensors may have any floating-point dtype (bfloat16,
float16, float32, float64) and live on any device: they are converted exactly to float64
first. `precision` picks the arithmetic: "double", or "mp256" (256-bit floats, the goldens'
precision, rounded once to double on the way out).

    import k3ref
    out = k3ref.kda(dict(q=q, k=k, v=v, g=g, beta=beta), gate="lower_bound", lower_bound=-5.0,
                    beta="sigmoid", l2norm=True, precision="mp256")
    out["o"], out["final_state"]

References: kda (the recurrence), kda_chunkwise (FlashKDA / FLA chunk forms, with their
stage tensors), kda_backward (gradients: adjoint recurrence or chunkwise with stages),
kcp_forward / kcp_backward (context parallelism: per-rank fragments and entering states),
attnres (Attention Residuals), qb_solver (Quantile Balancing); reference_of (a golden case's
outputs, by the reference of its operator); save writes your own tensors as
a safetensors file for the `k3ref` command. Submodules: k3ref.goldens
(golden cases as torch tensors), k3ref.testing (assert_kda_close), k3ref.policy (the
tolerance table), k3ref.gpu_check (the GPU harness). docs/python.md is the guide.

Bad arguments raise TypeError or ValueError with a one-line message naming the argument.
This module imports neither torch nor the compiled part until a reference is called, so
k3ref._safetensors (NumPy only) serves scripts without torch.
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any, Mapping

# The package's names: the references and their vocabulary (k3ref._references), handed on.
from ._references import (  # noqa: F401
    BACKWARD_GOLDEN_CHUNK_SIZE, KDA_COTANGENTS, KDA_INPUTS, MAX_COUNT, REFERENCE_OPS, _KDA_OPTION_TYPES,
    _NAME_TUPLES, _compiled, _names, attnres, kcp_backward, kcp_forward, kda, kda_backward, kda_chunkwise,
    kda_contract, kda_contract_sites, kda_options, option_vocabulary, qb_solver, reference_of,
    tier_descriptions)

if TYPE_CHECKING:  # annotations only: `import k3ref` imports neither torch nor NumPy
    import torch
    from numpy.typing import NDArray

__version__ = "0.1.0"


def save(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor | NDArray[Any]],
         metadata: Mapping[str, str] | None = None) -> None:
    """Writes a safetensors file ({name: torch tensor or NumPy array} in order, str metadata)
    that `k3ref kda --in`, `k3ref compare` and the readers take: k3ref._safetensors.save."""
    from ._safetensors import save as _save

    _save(path, tensors, metadata)


def __getattr__(name: str) -> Any:
    # Submodules on first use (`k3ref.goldens`, `k3ref.testing`, ...), and the vocabulary's name
    # tuples from the compiled part on first use, so `import k3ref` stays light.
    if name in ("goldens", "testing", "policy", "gpu_check"):
        return importlib.import_module(f".{name}", __name__)
    if name in _NAME_TUPLES:
        return _names(_NAME_TUPLES[name])
    if name == "KDA_OPTIONS":
        return {o: (_names(o) if t is None else t) for o, t in _KDA_OPTION_TYPES.items()}
    raise AttributeError(f"module 'k3ref' has no attribute '{name}'")
