"""SGLang's own KDA/GDN serving kernel (python/sglang/srt/layers/attention/fla/) under the
serving checks (serving_check.py), built in as any user's adapters are.

Where the code comes from: `--sglang-path DIR` (or $K3REF_SGLANG_PATH), a directory holding
sglang/srt/layers/attention/fla/ (an SGLang checkout's python/ folder, or the checkout root
with python/ under it, or the files laid out one by one with a COMMITS.txt), else the installed
sglang. From a directory the module is imported without SGLang's package __init__ files (they
import the whole engine) and the one helper it imports, `fla.utils.is_intel`, is shimmed
(False: these are NVIDIA runs).

The kernel, fused_sigmoid_gating_delta_rule_update (fused_sigmoid_gating_recurrent.py): the
gating in kernel (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)), a V-first pool
[slots, HV, V, K] addressed at index * HV K V, an index < 0 read as a zero state and not
stored. Three adapters:
  sglang.fused_sigmoid_gating[decode]        KDA (is_kda=True), the state written back in place
  sglang.fused_sigmoid_gating[target_verify] KDA, disable_state_update=True: the state after
      each draft token into intermediate_states_buffer[intermediate_state_indices[n], t], the
      pool only read (k3ref's per-token verify output); the entering slot is the caller's
  sglang.fused_sigmoid_gating[gdn_decode]    GDN (is_kda=False, one gate per head)
"""
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import torch

from .serving_check import (GDN_POOL_OPS, POOL_OPS, BuiltinDomain, PolicyBound, ServingAdapter, engine_version,
                            import_engine_module, scalar_gate)
from .upstream import need_cuda

FLA = "sglang/srt/layers/attention/fla"
MODULE = "fused_sigmoid_gating_recurrent"
NEEDS = (f"a directory holding {FLA}/{MODULE}.py (an SGLang checkout, or its python/ folder), given with "
         "--sglang-path DIR or $K3REF_SGLANG_PATH, or an installed sglang")


def package_root(path):
    for d in (Path(path), Path(path) / "python"):
        if (d / FLA / f"{MODULE}.py").is_file():
            return d
    return None


def load_module(path=None):
    """SGLang's fused_sigmoid_gating_recurrent from `path` or the installed sglang; one-line error."""
    full = FLA.replace("/", ".") + "." + MODULE
    root = None
    if path:
        root = package_root(path)
        if root is None:
            raise RuntimeError(f"SGLang's {MODULE}.py not found under {path}: needs {NEEDS}")
    elif importlib.util.find_spec("sglang") is None:
        raise RuntimeError(f"SGLang's kernels not found: needs {NEEDS}")

    def shims():
        utils = types.ModuleType(FLA.replace("/", ".") + ".utils")
        utils.is_intel = False
        sys.modules.setdefault(utils.__name__, utils)

    return import_engine_module(full, root, NEEDS, "--sglang-path", shims=shims)


class SglangGatingAdapter(ServingAdapter):
    """fused_sigmoid_gating_delta_rule_update: fp32 state and arithmetic on bf16 inputs, GDN's or
    KDA's softplus gating and beta's sigmoid in kernel, o in bf16, an fp32 V-first pool."""

    requires_cuda = True
    _unpicklable = ("mod",)
    domain = BuiltinDomain()  # policy/kernel_domains.json
    policy = "sglang-recurrent"
    policy_reason = "fp32 recurrence on bf16 inputs, FLA's fused recurrent arithmetic with the gating fused in"
    contract = "Triton; fp32 state and arithmetic on bf16 inputs, softplus gate and beta sigmoid in kernel, o in bf16"
    state_bound = PolicyBound("serving.decode", "pool_out", at_least=1e-6)
    layouts = ("v_first",)
    layout_reason = "its pool is [slots, HV, V, K]"
    dense_pool_reason = "it addresses slot i at i * HV * K * V from the pool's start"
    pad_outputs = "any"
    split_bitwise = True
    problem_params = dict(gate="softplus", gate_base="e", beta="sigmoid", qk_l2norm=True, scale=None,
                          lower_bound=None, state_layout="v_first")
    accepted_reason = ("the kernel takes the entering slot (initial_state_indices) from its caller, which resolves the "
                       "accepted count; no count reaches the kernel")
    in_place_reason = ""

    def __init__(self, mode="decode"):
        super().__init__()
        if mode not in ("decode", "target_verify", "gdn_decode"):
            raise ValueError(f"unknown mode {mode!r}")
        self.mode = mode
        self.name = f"sglang.fused_sigmoid_gating[{mode}]"
        self.gdn = mode == "gdn_decode"
        self.scalar_gate = self.gdn
        self.golden_ops = GDN_POOL_OPS if self.gdn else POOL_OPS + GDN_POOL_OPS
        if mode == "target_verify":
            self.modes = ("verify", "per_token")
            self.in_place_reason = ("target_verify never writes the pool: the states go to intermediate_states_buffer "
                                    "(k3ref's per-token output)")
            self.pad_reason = "an entering index < 0 is read as a zero state and its window's states still stored"
        else:
            self.modes = ("decode", "multi_token_decode", "pad", "prefill")

    def load(self):
        need_cuda()
        self.mod = load_module(self.path_of("sglang_path"))

    def version(self):
        return engine_version("sglang", self.mod) if getattr(self, "mod", None) is not None else ""

    def case_unsupported(self, case):
        why = super().case_unsupported(case)
        if why is None and self.in_place_reason and case.op in ("serving.verify", "gdn.verify") and \
                (case.params.get("writes") or "in_place") == "in_place":
            return "the kernel has no in-place verify: " + self.in_place_reason
        return why

    def _call(self, inputs, params, pool, indices, **kw):
        T, HV, K = inputs["q"].shape[1], inputs["v"].shape[2], inputs["q"].shape[3]
        if self.gdn:
            a, bias = scalar_gate(inputs, "SGLang's GDN mode")
        else:
            a, bias = inputs["g"].reshape(1, T, HV * K).contiguous(), inputs.get("dt_bias")
            bias = bias.reshape(-1) if bias is not None else None
        if bias is None:
            bias = torch.zeros(a.shape[-1], dtype=torch.float32, device=a.device)
        return self.mod.fused_sigmoid_gating_delta_rule_update(
            inputs["A_log"].float(), a, bias.float().contiguous(), 1.0, 20.0, inputs["q"].contiguous(),
            inputs["k"].contiguous(), inputs["v"].contiguous(), inputs["beta"].contiguous(), pool,
            indices.to(torch.int32), scale=params.get("scale"), use_qk_l2norm_in_kernel=bool(params.get("qk_l2norm")),
            is_kda=not self.gdn, **kw)

    def decode(self, inputs, params, pool, slot_of_sequence):
        if pool.stride(0) != pool[0].numel():
            raise ValueError(self.dense_pool_reason)
        return self._call(inputs, params, pool, slot_of_sequence, cu_seqlens=inputs["cu_seqlens"].to(torch.int32))

    def prefill(self, inputs, params, initial_state):
        pool = initial_state.float().clone().contiguous()  # one slot, written back in place
        o = self._call(inputs, params, pool, torch.zeros(1, dtype=torch.int32, device=pool.device))
        return o, pool

    def verify(self, inputs, params, pool, state_indices, num_accepted, in_place=True):
        if in_place:
            raise ValueError(self.in_place_reason)
        cu = [int(x) for x in inputs["cu_seqlens"].tolist()]
        N, W = state_indices.shape
        acc = num_accepted.long()
        if bool(((acc < 1) | (acc > W)).any()):
            raise ValueError("an accepted count outside [1, W] names no entering slot")
        entering = state_indices.gather(1, (acc - 1)[:, None])[:, 0]  # the caller's resolution
        buffer = pool.new_zeros((N, W) + tuple(pool.shape[1:]))
        o = self._call(inputs, params, pool, entering, cu_seqlens=inputs["cu_seqlens"].to(torch.int32),
                       disable_state_update=True, intermediate_states_buffer=buffer,
                       intermediate_state_indices=torch.arange(N, dtype=torch.int32, device=pool.device), cache_steps=W)
        token_states = pool.new_zeros((cu[-1],) + tuple(pool.shape[1:]))
        for n in range(N):
            token_states[cu[n] : cu[n + 1]] = buffer[n, : cu[n + 1] - cu[n]]
        return o, token_states


def adapters():
    """SGLang's serving kernels (the `k3ref.adapters` built-ins; see registry.builtin_adapters)."""
    return [SglangGatingAdapter("decode"), SglangGatingAdapter("target_verify"), SglangGatingAdapter("gdn_decode")]
