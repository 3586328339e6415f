"""vLLM's own copies of the GDN kernels (vllm/model_executor/layers/fla/ops/) under the serving
checks (serving_check.py), built in as any user's adapters are.

Where the code comes from: `--vllm-path DIR` (or $K3REF_VLLM_PATH), a directory holding
vllm/model_executor/layers/fla/ops/ (a vLLM checkout, or the files laid out one by one, with a
COMMITS.txt of `<path> <commit>` lines naming the commit of each), else the installed vllm.
From a directory the ops modules are imported without vLLM's package __init__ files (they
import the whole engine): only the packages on the way are made, and the two vLLM modules the
kernels import are shimmed -- vllm.triton_utils (triton, tl, tldevice) and vllm.platforms
(current_platform, for the replay's Blackwell test).

The kernels (docs/verify-your-kernel.md, "Serving engines"):
  vllm.fused_recurrent_gdn[continuous_batching]  fused_recurrent_gated_delta_rule_fwd with 1-D
      ssm_state_indices (one token per sequence, the pool as initial_state, in place); prefill
      is its plain call (inplace_final_state=False: one state row per token)
  vllm.fused_recurrent_gdn[spec_decode]  the same with 2-D ssm_state_indices and
      num_accepted_tokens (verify in place); varlen is its continuous-batching call with one
      index column per token (a sequence without tokens leaves its slot as it was)
  vllm.gdn_replayssm_decode  fused_recurrent_gated_delta_rule_replayssm: the cached-replay
      decode (checkpoints V-first, ring caches d/k/g, write_pos per row, slot <= 0 padding)
The gating of the recurrent kernel (vLLM's fused_gdn_gating, not laid out here) is computed by
the adapter in fp32: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b).
"""
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import torch

from .adapters import _env_path, _need_cuda
from .serving_check import (GDN_POOL_OPS, REPLAY_OPS, BuiltinDomain, PolicyBound, ServingAdapter, ServingModes,
                            engine_version, import_engine_module, scalar_gate)

OPS = "vllm/model_executor/layers/fla/ops"
NEEDS = (f"a directory holding {OPS}/ (fused_recurrent.py, op.py; fused_recurrent_replayssm.py and "
         "vllm/model_executor/layers/mamba/ops/replayssm_config.py for the replay), given with --vllm-path DIR or "
         "$K3REF_VLLM_PATH, or an installed vllm")


def _shim_vllm():
    """The two modules the kernels import from the rest of vLLM."""
    import triton
    import triton.language as tl

    utils = types.ModuleType("vllm.triton_utils")
    utils.triton, utils.tl = triton, tl
    try:  # FLA_USE_FAST_OPS=1 only
        from triton.language.extra import libdevice as tldevice
    except ImportError:
        tldevice = None
    utils.tldevice = tldevice
    sys.modules.setdefault("vllm.triton_utils", utils)

    class _Platform:
        @staticmethod
        def is_device_capability_family(family):
            major, minor = torch.cuda.get_device_capability()
            return (major * 10 + minor) // 10 == family // 10

    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = _Platform()
    sys.modules.setdefault("vllm.platforms", platforms)


def load_ops(module, path=None):
    """vllm.model_executor.layers.fla.ops.<module> from `path` or the installed vllm; one-line
    error naming what is needed."""
    full = f"vllm.model_executor.layers.fla.ops.{module}"
    root = None
    if path:
        root = Path(path)
        if not (root / OPS / f"{module}.py").is_file():
            raise RuntimeError(f"vLLM's {module}.py not found under {root}: needs {NEEDS}")
    elif importlib.util.find_spec("vllm") is None:
        raise RuntimeError(f"vLLM's ops not found: needs {NEEDS}")
    # the replay's config module lies in mamba/ops
    return import_engine_module(full, root, NEEDS, "--vllm-path", shims=_shim_vllm,
                                packages=("vllm.model_executor.layers.mamba", "vllm.model_executor.layers.mamba.ops"))


class VllmAdapter(ServingAdapter):
    requires_cuda = True
    vllm_path = None  # else $K3REF_VLLM_PATH, else the installed vllm
    module = ""
    _unpicklable = ("mod",)
    domain = BuiltinDomain()  # policy/kernel_domains.json

    def load(self):
        _need_cuda()
        self.mod = load_ops(self.module, _env_path("K3REF_VLLM_PATH", VllmAdapter.vllm_path))

    def version(self):
        return engine_version("vllm", self.mod) if getattr(self, "mod", None) is not None else ""


def gdn_gating(inputs, params):
    """(g [1, T, HV] fp32 log decays, beta [1, T, HV] fp32) for vLLM's recurrent kernel from
    KDA-form inputs with one gate per head (fused_gdn_gating's formula, in fp32)."""
    g, bias = scalar_gate(inputs, "vLLM's fused_recurrent_gated_delta_rule")
    if params.get("gate", "log_decay") == "log_decay":
        g = g.float()
    elif params["gate"] == "softplus":
        x = g.float() + (bias.float() if bias is not None else 0.0)
        g = -torch.exp(inputs["A_log"].float()) * torch.nn.functional.softplus(x)
    else:
        raise ValueError(f"gate {params['gate']}: vLLM's GDN takes log decays or the softplus gate")
    beta = inputs["beta"].float()
    if params.get("beta", "as_given") == "sigmoid":
        beta = torch.sigmoid(beta)
    elif params.get("beta", "as_given") != "as_given":
        raise ValueError(f"beta {params['beta']}: vLLM's GDN takes beta or its logits")
    return g.contiguous(), beta.contiguous()


class VllmGdnRecurrentAdapter(ServingModes, VllmAdapter):
    """vLLM's fused_recurrent_gated_delta_rule_fwd (GDN, fp32 state and arithmetic, bf16 in and
    out) in its two serving modes. Its pool is K-first ([slots, HV, K, V]) and an index -1 is not
    guarded: it addresses the slot before the pool."""

    module = "fused_recurrent"
    golden_ops = GDN_POOL_OPS
    scalar_gate = True
    split_bitwise = True
    layouts = ("k_first",)
    layout_reason = "this fused_recurrent.py indexes the state K-first (o_k * V + o_v)"
    policy = "vllm-gdn-recurrent"
    policy_reason = "fp32 recurrence on bf16 inputs, as FLA's fused recurrent kernel (1.0x the bf16 floor measured there)"
    contract = "Triton; fp32 state and arithmetic on bf16 inputs, o rounded to bf16, fp32 pool (gating in fp32)"
    o_bound = PolicyBound("gdn.decode", "o")
    state_bound = PolicyBound("gdn.decode", "pool_out", at_least=1e-6)
    problem_params = dict(gate="softplus", gate_base="e", beta="sigmoid", qk_l2norm=True, scale=None,
                          lower_bound=None, state_layout="k_first")
    varlen_params = problem_params
    pad_reason = "vLLM's kernel (this commit) reads and writes slot -1, the memory before the pool"
    multi_token_reason = "its continuous batching stores the state after token t into index column t"

    kernel_name = "vllm.fused_recurrent_gdn"

    def _call(self, inputs, params, initial_state, **kw):
        g, beta = gdn_gating(inputs, params)
        scale = params.get("scale")
        return self.mod.fused_recurrent_gated_delta_rule_fwd(
            inputs["q"].contiguous(), inputs["k"].contiguous(), inputs["v"].contiguous(), g, beta,
            inputs["q"].shape[-1] ** -0.5 if scale is None else float(scale), initial_state,
            use_qk_l2norm_in_kernel=bool(params.get("qk_l2norm")), **kw)

    def decode(self, inputs, params, pool, slot_of_sequence):
        cu = inputs["cu_seqlens"]
        if bool(((cu[1:] - cu[:-1]) > 1).any()):
            raise ValueError(self.multi_token_reason)
        o, _ = self._call(inputs, params, pool, inplace_final_state=True, cu_seqlens=cu,
                          ssm_state_indices=slot_of_sequence.to(torch.int32))
        return o

    def verify(self, inputs, params, pool, state_indices, num_accepted, in_place=True):
        if not in_place:
            raise ValueError("vLLM's verify stores states in place (index column t) only")
        o, _ = self._call(inputs, params, pool, inplace_final_state=True, cu_seqlens=inputs["cu_seqlens"],
                          ssm_state_indices=state_indices.to(torch.int32).contiguous(),
                          num_accepted_tokens=num_accepted.to(torch.int32))
        return o, None

    def prefill(self, inputs, params, initial_state):
        T = inputs["q"].shape[1]
        o, states = self._call(inputs, params, initial_state.float().contiguous(), inplace_final_state=False)
        return o, states[T - 1 : T]  # one state row per token: the last is the final state

    def varlen(self, inputs, params):
        cu = [int(x) for x in inputs["cu_seqlens"].tolist()]
        N, T = len(cu) - 1, cu[-1]
        h0 = inputs["initial_state"].float()
        pool = torch.cat([h0, h0.new_zeros((T,) + tuple(h0.shape[1:]))])
        width = max(1, max(cu[n + 1] - cu[n] for n in range(N)))
        # Column 0 is the sequence's own slot (read, then the state after its first token);
        # column t > 0 a scratch slot per token.
        idx = torch.tensor([[n] + [N + cu[n] + t for t in range(1, width)] for n in range(N)], dtype=torch.int32,
                           device=h0.device)
        o, _ = self._call(inputs, params, pool, inplace_final_state=True, cu_seqlens=inputs["cu_seqlens"],
                          ssm_state_indices=idx)
        last = [int(idx[n, max(cu[n + 1] - cu[n] - 1, 0)]) for n in range(N)]
        return o, pool[last]


class VllmGdnReplayAdapter(VllmAdapter):
    """vLLM's fused_recurrent_gated_delta_rule_replayssm: the cached-replay GDN decode (one token
    per row; V-first checkpoints read and, on the flush, written in place; ring caches d, k
    (bf16) and g (fp32); rows with slot <= 0 output zero). The state is rebuilt with a bf16
    tensor-core product (d scaled by the replay decay, rounded to bf16, times the cached keys)."""

    module = "fused_recurrent_replayssm"
    name = "vllm.gdn_replayssm_decode"
    golden_ops = REPLAY_OPS
    modes = ("replay",)
    layouts = ("v_first",)
    layout_reason = "the replay kernel's checkpoints are [slots, HV, V, K]"
    policy = "vllm-gdn-replay"
    policy_reason = "the rebuilt state passes through bf16 (d times its replay decay, and the cached keys, in tl.dot)"
    contract = "Triton; bf16 caches and tensor-core rebuild, fp32 accumulation, o rounded to bf16, fp32 checkpoints"
    o_bound = PolicyBound("gdn.replay_decode", "o")
    state_bound = PolicyBound("gdn.replay_decode", "pool_out", at_least=1e-6)
    cache_bound = PolicyBound("gdn.replay_decode", "d_cache_out")
    k_cache_bound = PolicyBound("gdn.replay_decode", "k_cache_out")
    g_cache_bound = PolicyBound("gdn.replay_decode", "g_cache_out", at_least=1e-9)

    def replay(self, raw, params, pool, d_cache, k_cache, g_cache, state_indices, write_pos):
        N, HV, V = raw["a"].shape[0], int(params["HV"]), int(params["V"])
        out = torch.empty(N, HV, V, dtype=raw["mixed_qkv"].dtype, device=raw["mixed_qkv"].device)
        scale = params.get("scale")
        self.mod.fused_recurrent_gated_delta_rule_replayssm(
            raw["mixed_qkv"].contiguous(), raw["a"].contiguous(), raw["b"].contiguous(), raw["A_log"].float(),
            raw["dt_bias"].float(), int(params["K"]) ** -0.5 if scale is None else float(scale), pool, d_cache,
            k_cache, g_cache, out, state_indices.to(torch.int32), write_pos.to(torch.int32),
            use_qk_l2norm_in_kernel=bool(params.get("qk_l2norm")))
        return out


def adapters():
    """vLLM's serving kernels (the `k3ref.adapters` built-ins; see registry.builtin_adapters)."""
    return [VllmGdnRecurrentAdapter("continuous_batching"), VllmGdnRecurrentAdapter("spec_decode"),
            VllmGdnReplayAdapter()]
