"""vLLM's own copies of the GDN and KDA kernels (vllm/model_executor/layers/fla/ops/) under the
serving checks (serving_check.py), built in as any user's adapters are.

Where the code comes from: `--vllm-path DIR` (or $K3REF_VLLM_PATH), a directory holding
vllm/model_executor/layers/fla/ops/ (a vLLM checkout, or the files laid out one by one, with a
COMMITS.txt of `<path> <commit>` lines naming the commit of each), else the installed vllm.
From a directory the ops modules are imported without vLLM's package __init__ files (they
import the whole engine): only the packages on the way are made, and the two vLLM modules the
kernels import are shimmed -- vllm.triton_utils (triton, tl, tldevice) and vllm.platforms
(current_platform, for the replay's Blackwell test and the KDA ops' platform probe); the KDA
ops' kda.py also imports vllm.model_executor.custom_op (CustomOp, for a layer norm the adapters
do not call: shimmed) and vllm/utils/math_utils.py (laid out; vllm.utils made empty).

The KDA ops (kda.py and every module it imports: chunk_delta_h, cumsum, fused_recurrent, index,
l2norm, op, solve_tril, utils, and vllm/utils/math_utils.py) must come from one commit: kda.py
calls fused_recurrent.py's kernel with that commit's arguments. A checkout holds them; a tree
laid out from single files whose fused_recurrent.py is another commit's (the GDN adapters')
holds them under DIR/kda/ (a second tree, named in DIR's COMMITS.txt as kda/<path>), which the
KDA adapters read first. The two trees are two copies of vLLM: one process imports one, so the
GDN and the KDA kernels run in separate processes (gpu_check/device_engines.sh runs each kernel
in its own).

The kernels (docs/verify-your-kernel.md, "Serving engines"):
  vllm.fused_recurrent_gdn[continuous_batching]  fused_recurrent_gated_delta_rule_fwd with 1-D
      ssm_state_indices (one token per sequence, the pool as initial_state, in place); prefill
      is its plain call (inplace_final_state=False: one state row per token)
  vllm.fused_recurrent_gdn[spec_decode]  the same with 2-D ssm_state_indices and
      num_accepted_tokens (verify in place); varlen is its continuous-batching call with one
      index column per token (a sequence without tokens leaves its slot as it was)
  vllm.gdn_replayssm_decode  fused_recurrent_gated_delta_rule_replayssm: the cached-replay
      decode (checkpoints V-first, ring caches d/k/g, write_pos per row, slot <= 0 padding)
  vllm.kda_decode  kda.py fused_recurrent_kda_fwd (IS_KDA, a V-first pool [slots, HV, V, K]):
      decode with 1-D ssm_state_indices (one token per sequence), the speculative verify with
      2-D ssm_state_indices and num_accepted_tokens (in place, or with inplace_final_state=False
      one state row per token: k3ref's per-token output); prefill is its plain call, varlen its
      continuous-batching call with one index column per token. The gate is vLLM's fused_kda_gate
      (the softplus gate with A_log and dt_bias, fp32), beta's sigmoid is taken in fp32 before
      the call, as vLLM's Kimi layer does. Its index 0 is vLLM's null block (NULL_BLOCK_ID = 0:
      a sequence whose index is <= 0 is neither read nor written, its outputs left unwritten), so
      the adapter gives the kernel the pool behind one null block (index i + 1 is k3ref's slot i,
      -1 becomes 0): a buffer one slot stride longer, the pool's storage copied in after that
      slot and copied back after the call, every byte of it (slot strides and padding included);
      the unwritten outputs of a padded sequence (vLLM discards them) are returned as zeros
  vllm.kda_chunk_prefill  kda.py chunk_kda_with_fused_gate (the softplus gate with A_log and
      dt_bias in the chunk-local cumsum; chunk_kda for log decays): chunks of 64, one head per
      value head, V-first final states; the KDA goldens of one packed or single sequence
      (golden), the empty-sequence check and determinism (varlen), and decode after prefill
      with the same kda.py's fused_recurrent_kda_fwd decoding the prefilled state (vLLM's
      Kimi layer: chunked prefill, then the recurrent decode on the same V-first state cache)
The gating of the GDN recurrent kernel (vLLM's fused_gdn_gating, not laid out here) is computed
by the adapter in fp32: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b).
"""
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import torch

from .serving_check import (GDN_POOL_OPS, POOL_OPS, REPLAY_OPS, VARLEN_OPS, BuiltinDomain, ChunkPrefill, PolicyBound,
                            ServingAdapter, ServingModes, engine_version, import_engine_module, scalar_gate)
from .upstream import need_cuda

OPS = "vllm/model_executor/layers/fla/ops"
NEEDS = (f"a directory holding {OPS}/ (fused_recurrent.py, op.py; fused_recurrent_replayssm.py and "
         "vllm/model_executor/layers/mamba/ops/replayssm_config.py for the replay), given with --vllm-path DIR or "
         "$K3REF_VLLM_PATH, or an installed vllm")
KDA_FILES = ("kda", "chunk_delta_h", "cumsum", "fused_recurrent", "index", "l2norm", "op", "solve_tril", "utils")
KDA_NEEDS = (f"a directory holding {OPS}/ ({', '.join(f + '.py' for f in KDA_FILES)}) and vllm/utils/math_utils.py, "
             "all of one commit (a checkout, or DIR/kda/ beside the GDN files of other commits), given with "
             "--vllm-path DIR or $K3REF_VLLM_PATH, or an installed vllm")


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

        @staticmethod
        def is_cuda_alike():  # the KDA ops' utils.py: CUDA or ROCm
            return torch.cuda.is_available()

    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = _Platform()
    sys.modules.setdefault("vllm.platforms", platforms)

    class CustomOp(torch.nn.Module):  # kda.py's FusedRMSNormGated (not called by the adapters) derives from it
        @classmethod
        def register(cls, name):
            return lambda op: op

    custom_op = types.ModuleType("vllm.model_executor.custom_op")
    custom_op.CustomOp = CustomOp
    sys.modules.setdefault(custom_op.__name__, custom_op)


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


def kda_root(path):
    """The tree the KDA ops come from under `path`: path/kda when it holds kda.py (a second tree
    laid out at one commit), else `path` itself."""
    second = Path(path) / "kda"
    return second if (second / OPS / "kda.py").is_file() else Path(path)


def load_kda_ops(path=None):
    """vllm.model_executor.layers.fla.ops.kda from kda_root(path) or the installed vllm; one-line
    error naming what is needed (a missing module of the set, or the GDN tree already imported)."""
    full = "vllm.model_executor.layers.fla.ops.kda"
    root = None
    if path:
        root = kda_root(path)
        missing = [f"{f}.py" for f in KDA_FILES if not (root / OPS / f"{f}.py").is_file()]
        if not (root / "vllm" / "utils" / "math_utils.py").is_file():
            missing.append("vllm/utils/math_utils.py")
        if missing:
            raise RuntimeError(f"vLLM's KDA ops under {root} lack {', '.join(missing)}: needs {KDA_NEEDS}")
        top = sys.modules.get("vllm")
        if top is not None and getattr(top, "__path__", None) and \
                Path(list(top.__path__)[0]).resolve() != (root / "vllm").resolve():
            raise RuntimeError(f"another vllm is already imported ({list(top.__path__)[0]}): vLLM's KDA ops ({root}) "
                               "are a tree of another commit; run the GDN and the KDA kernels in separate processes")
    elif importlib.util.find_spec("vllm") is None:
        raise RuntimeError(f"vLLM's ops not found: needs {KDA_NEEDS}")
    return import_engine_module(full, root, KDA_NEEDS, "--vllm-path", shims=_shim_vllm,
                                packages=("vllm.utils",))


class VllmAdapter(ServingAdapter):
    requires_cuda = True
    module = ""
    _unpicklable = ("mod",)
    domain = BuiltinDomain()  # policy/kernel_domains.json

    def load(self):
        need_cuda()
        self.mod = load_ops(self.module, self.path_of("vllm_path"))

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
        return prefill_through(self._call, inputs, params, initial_state)

    def varlen(self, inputs, params):
        return varlen_through_pool(self._call, inputs, params, null_block=False)


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


# -------------------------------------------------------------------------- the KDA ops (kda.py)

def null_block_pool(pool):
    """(kernel pool, copy back) for a kernel whose index 0 is vLLM's null block: a buffer one slot
    stride longer than the pool's storage (its first slot stride NaN), the whole storage copied in
    after it, and the pool's view over that buffer from one slot earlier, so that index i + 1
    addresses the pool's slot i with its own strides and offset. `copy back` copies the storage,
    every element (slot padding included), back."""
    n = (pool.untyped_storage().nbytes() // pool.element_size() if hasattr(pool, "untyped_storage")
         else pool.storage().size())  # torch < 2
    whole = torch.as_strided(pool, (n,), (1,), 0)  # the pool's storage, flat
    s = pool.stride(0)
    buf = torch.full((s + n,), float("nan"), dtype=pool.dtype, device=pool.device)
    buf[s:] = whole
    view = buf.as_strided((pool.shape[0] + 1,) + tuple(pool.shape[1:]), pool.stride(), pool.storage_offset())
    return view, lambda: whole.copy_(buf[s:])


def null_block_indices(indices):
    """k3ref's slot ids as the kernel's: slot i is index i + 1, padding (-1) the null block 0."""
    return torch.where(indices >= 0, indices + 1, torch.zeros_like(indices)).to(torch.int32).contiguous()


class VllmKdaAdapter(VllmAdapter):
    module = "kda"
    layouts = ("v_first",)
    layout_reason = "this kda.py's fused_recurrent.py indexes the state V-first (o_v * K + o_k)"

    def load(self):
        need_cuda()
        self.mod = load_kda_ops(self.path_of("vllm_path"))

    @staticmethod
    def gate_of(params):
        """The gate form of `params`, one vLLM's KDA ops take (log decays or the softplus gate)."""
        gate = params.get("gate", "log_decay")
        if gate not in ("log_decay", "softplus"):
            raise ValueError(f"gate {gate}: vLLM's KDA takes log decays or the softplus gate")
        return gate

    def gating(self, inputs, params):
        """(g [1, T, HV, K] fp32 log decays, beta [1, T, HV] fp32) as vLLM's Kimi layer feeds the
        recurrent kernel: fused_kda_gate for the softplus gate (-exp(A_log) softplus(g + dt_bias),
        in kda.py), beta's sigmoid in fp32."""
        g = inputs["g"]
        if self.gate_of(params) == "softplus":
            T, HV, K = g.shape[1], g.shape[2], g.shape[3]
            bias = inputs.get("dt_bias")
            g = self.mod.fused_kda_gate(g.reshape(T, HV * K).contiguous(), inputs["A_log"].float().contiguous(), K,
                                        g_bias=bias.float().reshape(-1).contiguous() if bias is not None else None)
            g = g.reshape(1, T, HV, K)
        return g.float().contiguous(), self.beta(inputs, params)

    @staticmethod
    def beta(inputs, params):
        b = inputs["beta"].float()
        if params.get("beta", "as_given") == "sigmoid":
            return torch.sigmoid(b).contiguous()
        if params.get("beta", "as_given") != "as_given":
            raise ValueError(f"beta {params['beta']}: vLLM's KDA takes beta or its logits")
        return b.contiguous()


class VllmKdaDecodeAdapter(VllmKdaAdapter):
    """fused_recurrent_kda_fwd (kda.py): fp32 state and arithmetic on bf16 inputs, o in bf16, an
    fp32 V-first pool; decode, the speculative verify (num_accepted_tokens; in place or one state
    row per token), prefill and varlen through one entry point. It allocates o like k
    ([B, T, H, K]) and writes [B, T, HV, V] into it: H K = HV V only (Kimi's shapes, H = HV and
    K = V)."""

    name = "vllm.kda_decode"
    golden_ops = POOL_OPS + GDN_POOL_OPS
    modes = ("decode", "verify", "per_token", "pad", "prefill", "varlen")
    split_bitwise = True
    policy = "vllm-kda-recurrent"
    policy_reason = ("fp32 recurrence on bf16 inputs, FLA's fused recurrent arithmetic (1.0x the bf16 floor measured "
                     "there)")
    contract = ("Triton; fp32 state and arithmetic on bf16 inputs, the gate in fp32 (fused_kda_gate), o rounded to "
                "bf16, fp32 V-first pool")
    state_bound = PolicyBound("serving.decode", "pool_out", at_least=1e-6)
    problem_shape = dict(H=2, HV=2, K=16, V=16)  # H K = HV V both ways (layout_equivalence swaps K and V)
    problem_params = dict(gate="softplus", gate_base="e", beta="sigmoid", qk_l2norm=True, scale=None,
                          lower_bound=None, state_layout="v_first")
    varlen_shape = dict(H=1, HV=2, K=16, V=8)
    varlen_params = problem_params
    multi_token_reason = "its continuous batching stores the state after token t into index column t"
    shape_reason = ("fused_recurrent_kda_fwd allocates o like k ([B, T, H, K]) and the kernel writes [B, T, HV, V]: "
                    "H K = HV V")

    def case_unsupported(self, case):
        why = super().case_unsupported(case)
        p = case.params
        if why is None and int(p["H"]) * int(p["K"]) != int(p["HV"]) * int(p["V"]):
            return f"n/a (outside the kernel's domain: H K = {int(p['H']) * int(p['K'])}, HV V = " \
                   f"{int(p['HV']) * int(p['V'])}; {self.shape_reason})"
        return why

    def _fwd(self, inputs, params, state, **kw):
        q, k, v = inputs["q"].contiguous(), inputs["k"].contiguous(), inputs["v"].contiguous()
        (_, T, H, K), HV, V = q.shape, v.shape[2], v.shape[3]
        if H * K != HV * V:
            raise ValueError(self.shape_reason)
        g, beta = self.gating(inputs, params)
        scale = params.get("scale")
        o, states = self.mod.fused_recurrent_kda_fwd(
            q, k, v, g, beta, K ** -0.5 if scale is None else float(scale), state,
            use_qk_l2norm_in_kernel=bool(params.get("qk_l2norm")), **kw)
        return o.reshape(1, T, HV, V), states

    @staticmethod
    def _zero_padded(o, cu, entering):
        """The outputs of the sequences entering at -1 (the null block), which the kernel never
        writes (o is torch.empty_like(k)) and vLLM discards, as zeros: the references' padding."""
        cu = [int(x) for x in cu.tolist()]
        for n, e in enumerate(entering):
            if e == -1:
                o[:, cu[n] : cu[n + 1]] = 0
        return o

    def decode(self, inputs, params, pool, slot_of_sequence):
        cu = inputs["cu_seqlens"]
        if bool(((cu[1:] - cu[:-1]) > 1).any()):
            raise ValueError(self.multi_token_reason)
        kernel_pool, copy_back = null_block_pool(pool)
        o, _ = self._fwd(inputs, params, kernel_pool, inplace_final_state=True, cu_seqlens=cu,
                         ssm_state_indices=null_block_indices(slot_of_sequence))
        copy_back()
        return self._zero_padded(o, cu, [int(s) for s in slot_of_sequence.tolist()])

    def verify(self, inputs, params, pool, state_indices, num_accepted, in_place=True):
        kernel_pool, copy_back = null_block_pool(pool)
        o, states = self._fwd(inputs, params, kernel_pool, inplace_final_state=in_place,
                              cu_seqlens=inputs["cu_seqlens"], ssm_state_indices=null_block_indices(state_indices),
                              num_accepted_tokens=num_accepted.to(torch.int32))
        copy_back()
        rows, acc = state_indices.tolist(), [int(a) for a in num_accepted.tolist()]
        entering = [int(r[a - 1]) if 1 <= a <= len(r) else None for r, a in zip(rows, acc)]
        return self._zero_padded(o, inputs["cu_seqlens"], entering), (None if in_place else states)

    def prefill(self, inputs, params, initial_state):
        return prefill_through(self._fwd, inputs, params, initial_state)

    def varlen(self, inputs, params):
        return varlen_through_pool(self._fwd, inputs, params, null_block=True)


class VllmKdaChunkPrefillAdapter(ChunkPrefill, VllmKdaAdapter):
    """chunk_kda_with_fused_gate (kda.py; chunk_kda for log decays): chunks of 64 in UT form,
    bf16 tensor-core products, exp2 decays, V-first fp32 final states; the KDA goldens, the
    empty-sequence check, determinism, and decode after prefill with vllm.kda_decode's
    fused_recurrent_kda_fwd (the same kda.py) continuing the prefilled state. The output is
    written into v's memory (chunk_gla_fwd_o_gk(o=v)): the adapter hands it a copy."""

    name = "vllm.kda_chunk_prefill"
    golden_ops = VARLEN_OPS
    modes = ("varlen", "prefill")
    decode_partner = VllmKdaDecodeAdapter
    warmup_weight = 100  # its kernels autotune (warmup.cost_estimate)
    varlen_shape = dict(H=2, HV=2, K=16, V=32)  # one head per value head
    varlen_params = dict(gate="softplus", gate_base="e", beta="sigmoid", qk_l2norm=True, scale=None,
                         lower_bound=None, state_layout="v_first")
    # decode_after_prefill: one head per value head (the chunk) and H K = HV V (the decode's o)
    problem_shape = dict(H=2, HV=2, K=16, V=16)
    problem_params = varlen_params
    policy = "vllm-kda-chunk"
    o_bound = PolicyBound("serving.checkpoints", "o")
    state_bound = PolicyBound("serving.checkpoints", "final_state")
    policy_reason = "FLA's chunked UT transform (2.0x-2.7x the bf16 floor on o), the state an operand in bf16"
    contract = ("Triton (vLLM's copy of FLA chunk_kda); chunks of 64, bf16 tensor-core products, exp2 decays, fp32 "
                "final state")

    def varlen(self, inputs, params):
        beta, scale = self.beta(inputs, params), params.get("scale")
        kw = dict(initial_state=inputs["initial_state"].float().contiguous(), output_final_state=True,
                  use_qk_l2norm_in_kernel=bool(params.get("qk_l2norm")), cu_seqlens=inputs["cu_seqlens"],
                  scale=None if scale is None else float(scale))
        q, k, v = inputs["q"].contiguous(), inputs["k"].contiguous(), inputs["v"].clone()
        if self.gate_of(params) == "softplus":
            bias = inputs.get("dt_bias")
            o, final = self.mod.chunk_kda_with_fused_gate(
                q, k, v, inputs["g"].contiguous(), beta, inputs["A_log"].float().reshape(-1),
                bias.float().reshape(-1).contiguous() if bias is not None else None, **kw)
        else:
            o, final = self.mod.chunk_kda(q, k, v, inputs["g"].float().contiguous(), beta, **kw)
        return o, final


def adapters():
    """vLLM's serving kernels (the `k3ref.adapters` built-ins; see registry.builtin_adapters)."""
    return [VllmGdnRecurrentAdapter("continuous_batching"), VllmGdnRecurrentAdapter("spec_decode"),
            VllmGdnReplayAdapter(), VllmKdaDecodeAdapter(), VllmKdaChunkPrefillAdapter()]


def prefill_through(call, inputs, params, initial_state):
    """(o, final state) of a dense prefill through vLLM's fused recurrent `call`, which stores
    one state row per token when not in place: the last row is the final state."""
    T = inputs["q"].shape[1]
    o, states = call(inputs, params, initial_state.float().contiguous(), inplace_final_state=False)
    return o, states[T - 1 : T]


def varlen_through_pool(call, inputs, params, null_block):
    """(o, final states) of a varlen batch through vLLM's fused recurrent `call` and its state
    pool: each sequence's own slot (read, then the state after its first token) in index column
    0, a scratch slot per later token in column t; with `null_block` (the KDA kernels) index 0
    is vLLM's null block, NaN here, so that nothing may read it."""
    cu = [int(x) for x in inputs["cu_seqlens"].tolist()]
    N, T = len(cu) - 1, cu[-1]
    h0 = inputs["initial_state"].float()
    base = 1 if null_block else 0
    null = [torch.full_like(h0[:1], float("nan"))] if null_block else []
    pool = torch.cat(null + [h0, h0.new_zeros((T,) + tuple(h0.shape[1:]))])
    width = max(1, max(cu[n + 1] - cu[n] for n in range(N)))
    idx = torch.tensor([[base + n] + [base + N + cu[n] + t for t in range(1, width)] for n in range(N)],
                       dtype=torch.int32, device=h0.device)
    o, _ = call(inputs, params, pool, inplace_final_state=True, cu_seqlens=inputs["cu_seqlens"],
                ssm_state_indices=idx)
    last = [int(idx[n, max(cu[n + 1] - cu[n] - 1, 0)]) for n in range(N)]
    return o, pool[last]
