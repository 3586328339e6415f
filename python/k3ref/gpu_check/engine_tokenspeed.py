"""TokenSpeed's KDA and GDN serving kernels (lightseekorg/tokenspeed, tokenspeed-kernel) under
the serving checks (serving_check.py), built in as any user's adapters are.

Where the code comes from: `--tokenspeed-path DIR` (or $K3REF_TOKENSPEED_PATH), a directory
holding the tokenspeed_kernel package (DIR/tokenspeed_kernel, or a checkout with it under
tokenspeed-kernel/python/), else the installed tokenspeed_kernel. From a directory the modules
are imported without the package's __init__ files (they import every backend: CUDA, DeepGEMM,
FlashInfer, ...): only the packages on the way are made. A COMMITS.txt above the package
(`tokenspeed-kernel/python/tokenspeed_kernel <commit>`) names the commit in every report.

The kernels (their Kimi K3 options: q/k L2-normalised, gate and beta sigmoid in kernel):
  tokenspeed.kda_recurrent_decode_pool  ops/attention/triton/linear/kda.py: the decode that reads
      h_pool[read_indices] and writes h_pool[write_indices] in the kernel (K-first fp32 pool,
      any number of tokens per sequence, a negative read index reads zeros, a negative write
      index skips the store); prefill is kda_recurrent_decode (FLA's fused_recurrent_kda;
      needs FLA, --fla-path)
  tokenspeed.kda_mtp_verify  thirdparty/triton/fla_kda_recurrent.py fused_recurrent_kda_mtp: the
      target verify (a dense [B, T] window, read_indices [B] the entering page the caller
      resolved from its accepted count, write_indices [B, T]; K-major or V-major pool)
  tokenspeed.kda_chunk_prefill  kda.py: FLA's chunk_kda with TokenSpeed's options (the beta
      sigmoid applied before the call, in fp32), K-first states; the KDA goldens of one packed
      or single sequence, and decode after prefill with the same kda.py's
      kda_recurrent_decode_pool decoding the prefilled page; needs FLA (--fla-path)
  tokenspeed.gdn_decode_step  ops/attention/triton/gated_delta_rule.py triton_gdn_decode_step:
      GDN's decode (softplus gating and beta's sigmoid in kernel, V-first [pool, HV, V, K]
      pool addressed at index * HV V K); its module imports TokenSpeed's linear/ helpers,
      which import tokenspeed_kernel._triton (TokenSpeed's Triton build): without that build
      the module is plain Triton's
"""
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import torch

from .serving_check import (GDN_POOL_OPS, POOL_OPS, VARLEN_OPS, BuiltinDomain, ChunkPrefill, PolicyBound,
                            ServingAdapter, engine_version, import_engine_module, scalar_gate)
from .upstream import load_fla, need_cuda

PKG = "tokenspeed_kernel"
NEEDS = ("a directory holding the tokenspeed_kernel package (DIR/tokenspeed_kernel or "
         "DIR/tokenspeed-kernel/python/tokenspeed_kernel), given with --tokenspeed-path DIR or $K3REF_TOKENSPEED_PATH, "
         "or an installed tokenspeed_kernel")


def package_root(path):
    """The directory holding tokenspeed_kernel/ for a given path, or None."""
    for d in (Path(path), Path(path) / "tokenspeed-kernel" / "python"):
        if (d / PKG / "__init__.py").is_file():
            return d
    return None


def load_module(name, path=None):
    """tokenspeed_kernel.<name> from `path` (its package __init__ files not run) or the
    installed package; one-line error naming what is needed."""
    full = f"{PKG}.{name}"
    root = None
    if path:
        root = package_root(path)
        if root is None:
            raise RuntimeError(f"no tokenspeed_kernel package under {path}: needs {NEEDS}")
        if not (root / PKG / (name.replace(".", "/") + ".py")).is_file():
            raise RuntimeError(f"{root / PKG} has no {name.replace('.', '/')}.py: needs {NEEDS}")
    elif importlib.util.find_spec(PKG) is None:
        raise RuntimeError(f"TokenSpeed's kernels not found: needs {NEEDS}")

    def shims():
        if f"{PKG}._triton" not in sys.modules and importlib.util.find_spec("tokenspeed_triton") is None:
            # TokenSpeed's own Triton build is absent: its `_triton` module (tl, triton for the
            # linear/ helpers gated_delta_rule.py imports) is plain Triton's.
            import triton

            shim = types.ModuleType(f"{PKG}._triton")
            shim.triton, shim.tl = triton, importlib.import_module("triton.language")
            sys.modules[shim.__name__] = shim

    return import_engine_module(full, root, NEEDS, "--tokenspeed-path", shims=shims)


# Kimi K3's options in TokenSpeed: the safe gate lower_bound * sigmoid(exp(A_log) (g + dt_bias)),
# beta's sigmoid and the q/k L2 norm, all in the kernel.
K3_PARAMS = dict(gate="lower_bound", gate_base="e", beta="sigmoid", qk_l2norm=True, scale=None, lower_bound=-5.0,
                 state_layout="k_first")

class TokenSpeedAdapter(ServingAdapter):
    requires_cuda = True
    module = ""
    _unpicklable = ("mod",)
    problem_params = K3_PARAMS
    varlen_params = K3_PARAMS
    domain = BuiltinDomain()  # policy/kernel_domains.json
    policy = "tokenspeed-kda-recurrent"
    state_bound = PolicyBound("serving.decode", "pool_out", at_least=1e-6)

    def load(self):
        need_cuda()
        self.mod = load_module(self.module, self.path_of("tokenspeed_path"))

    def version(self):
        return engine_version("tokenspeed", self.mod) if getattr(self, "mod", None) is not None else ""

    @staticmethod
    def _gate(inputs, params):
        """(A_log, dt_bias [HV, K] or None, lower_bound or None) of TokenSpeed's gate in kernel."""
        lb = params.get("lower_bound") if params.get("gate") == "lower_bound" else None
        bias = inputs.get("dt_bias")
        return inputs["A_log"].float(), (bias.float().contiguous() if bias is not None else None), (
            float(lb) if lb is not None else None)


class TokenSpeedKdaPoolDecodeAdapter(TokenSpeedAdapter):
    """kda_recurrent_decode_pool: fp32 recurrence on bf16 inputs (FLA's fused recurrent math,
    v0.5.1, with the pool addressed in the kernel)."""

    name = "tokenspeed.kda_recurrent_decode_pool"
    module = "ops.attention.triton.linear.kda"
    golden_ops = POOL_OPS + GDN_POOL_OPS
    modes = ("decode", "multi_token_decode", "pad", "prefill")
    layouts = ("k_first",)
    layout_reason = "kda_recurrent_decode_pool's h_pool is [num_pages, HV, K, V]"
    pad_outputs = "any"
    # prefill is kda_recurrent_decode (FLA's fused_recurrent_kda), decode TokenSpeed's own pool
    # kernel: a split is judged against the fp64 single shot, not bit for bit.
    split_bitwise = False
    policy_reason = "fp32 recurrence on bf16 inputs, FLA's fused recurrent arithmetic"
    contract = "Triton; fp32 state and arithmetic on bf16 inputs, gate and beta sigmoid in kernel, o in bf16, fp32 pool"

    def decode(self, inputs, params, pool, slot_of_sequence):
        A_log, bias, lb = self._gate(inputs, params)
        slots = slot_of_sequence.to(torch.int32)
        # The engine reads and writes one page per sequence; -1 reads zeros and skips the store.
        return self.mod.kda_recurrent_decode_pool(
            inputs["q"], inputs["k"], inputs["v"], inputs["g"].contiguous(), inputs["beta"].contiguous(), A_log, bias,
            h_pool=pool, read_indices=slots, write_indices=slots, cu_seqlens=inputs["cu_seqlens"].to(torch.int32),
            lower_bound=lb)

    def load(self):
        super().load()
        # kda_recurrent_decode (prefill) is FLA's
        load_fla(self.path_of("fla_path"))

    def prefill(self, inputs, params, initial_state):
        A_log, bias, lb = self._gate(inputs, params)
        o, final = self.mod.kda_recurrent_decode(
            inputs["q"], inputs["k"], inputs["v"], inputs["g"].contiguous(), inputs["beta"].contiguous(), A_log,
            bias.reshape(-1) if bias is not None else None, initial_state=initial_state.float().contiguous(),
            lower_bound=lb)
        return o, final


class TokenSpeedKdaMtpVerifyAdapter(TokenSpeedAdapter):
    """fused_recurrent_kda_mtp: the target verify over dense windows, one state page per
    position for the rollback."""

    name = "tokenspeed.kda_mtp_verify"
    module = "thirdparty.triton.fla_kda_recurrent"
    golden_ops = POOL_OPS + GDN_POOL_OPS
    modes = ("verify", "pad_write")
    policy_reason = "fp32 recurrence on bf16 inputs, FLA's fused recurrent arithmetic"
    contract = "Triton; fp32 state and arithmetic on bf16 inputs, gate and beta sigmoid in kernel, o in bf16, fp32 pool"
    pad_reason = "a read index < 0 is read as a zero state and the row's other write indices still stored"
    ragged_reason = "fused_recurrent_kda_mtp takes a dense [B, T] batch (no cu_seqlens)"
    accepted_reason = ("the kernel takes the entering page (read_indices) from its caller, which resolves the accepted "
                       "count; no count reaches the kernel")

    def verify(self, inputs, params, pool, state_indices, num_accepted, in_place=True):
        if not in_place:
            raise ValueError("fused_recurrent_kda_mtp stores the states in the pool (write_indices) only")
        cu = inputs["cu_seqlens"]
        lengths = set((cu[1:] - cu[:-1]).tolist())
        if len(lengths) != 1 or 0 in lengths:
            raise ValueError(self.ragged_reason)
        N, L = len(cu) - 1, lengths.pop()
        acc = num_accepted.long()
        if bool(((acc < 1) | (acc > state_indices.shape[1])).any()):
            raise ValueError("an accepted count outside [1, W] names no entering page")
        read = state_indices.gather(1, (acc - 1)[:, None])[:, 0].to(torch.int32)  # the caller's resolution
        A_log, bias, lb = self._gate(inputs, params)

        def dense(x):
            return x.reshape((N, L) + tuple(x.shape[2:])).contiguous()

        o = self.mod.fused_recurrent_kda_mtp(
            dense(inputs["q"]), dense(inputs["k"]), dense(inputs["v"]), dense(inputs["g"]), dense(inputs["beta"]), A_log,
            bias, pool, read, state_indices[:, :L].to(torch.int32).contiguous(), lower_bound=lb,
            recurrent_layout="v_major" if params.get("state_layout") == "v_first" else "k_major")
        return o.reshape((1, N * L) + tuple(o.shape[2:])), None


class TokenSpeedKdaChunkPrefillAdapter(ChunkPrefill, TokenSpeedAdapter):
    """kda_chunk_prefill: FLA's chunk_kda (chunks of 64, bf16 tensor-core products) with
    TokenSpeed's options, K-first states; the KDA goldens, the empty-sequence check,
    determinism, and decode after prefill with kda_recurrent_decode_pool (the same kda.py: the
    pool decode TokenSpeed runs on the page its prefill wrote) continuing the prefilled state."""

    name = "tokenspeed.kda_chunk_prefill"
    module = "ops.attention.triton.linear.kda"
    golden_ops = VARLEN_OPS
    modes = ("varlen", "prefill")
    decode_partner = TokenSpeedKdaPoolDecodeAdapter
    layouts = ("k_first",)
    layout_reason = "kda_chunk_prefill takes and returns [N, HV, K, V] states, the pool decode's page layout"
    warmup_weight = 100  # chunk_kda autotunes (warmup.cost_estimate)
    varlen_shape = dict(H=1, HV=2, K=16, V=32)
    problem_shape = varlen_shape  # decode_after_prefill
    policy = "tokenspeed-kda-chunk"
    o_bound = PolicyBound("serving.checkpoints", "o")
    state_bound = PolicyBound("serving.checkpoints", "final_state")
    policy_reason = "FLA's chunked UT transform (2.0x-2.7x the bf16 floor on o), the state an operand in bf16"
    contract = "Triton (FLA chunk_kda); chunks of 64, bf16 tensor-core products, fp32 final state"

    def load(self):
        super().load()
        load_fla(self.path_of("fla_path"))

    scale_reason = "kda_chunk_prefill takes no scale: FLA's chunk_kda applies K^-1/2"

    def case_unsupported(self, case):
        why = super().case_unsupported(case)
        if why is None and case.params.get("scale") is not None:
            return f"n/a (outside the kernel's domain: scale = {float(case.params['scale']):g}; {self.scale_reason})"
        return why

    def varlen(self, inputs, params):
        if params.get("scale") is not None:
            raise ValueError(self.scale_reason)
        A_log, bias, lb = self._gate(inputs, params)
        o, final = self.mod.kda_chunk_prefill(
            inputs["q"], inputs["k"], inputs["v"], inputs["g"].contiguous(), inputs["beta"], A_log,
            bias.reshape(-1) if bias is not None else None, initial_state=inputs["initial_state"].float(),
            cu_seqlens=inputs["cu_seqlens"], lower_bound=lb)[:2]
        return o, final


class TokenSpeedGdnDecodeAdapter(TokenSpeedAdapter):
    """triton_gdn_decode_step: GDN's one-token decode over a dense batch, fp32 state and
    arithmetic, V-first pool written back in place."""

    name = "tokenspeed.gdn_decode_step"
    module = "ops.attention.triton.gated_delta_rule"
    golden_ops = GDN_POOL_OPS
    modes = ("decode", "pad")
    scalar_gate = True
    layouts = ("v_first",)
    layout_reason = "its pool is K-last, [pool, HV, V, K]"
    pad_outputs = "any"
    problem_params = dict(gate="softplus", gate_base="e", beta="sigmoid", qk_l2norm=True, scale=None,
                          lower_bound=None, state_layout="v_first")
    policy = "tokenspeed-gdn-decode"
    o_bound = PolicyBound("gdn.decode", "o")
    state_bound = PolicyBound("gdn.decode", "pool_out", at_least=1e-6)
    policy_reason = "fp32 recurrence on bf16 inputs"
    contract = "Triton; fp32 state and arithmetic on bf16 inputs, GDN gating in kernel, o in bf16, fp32 V-first pool"
    dense_pool_reason = "it addresses page i at i * HV * V * K from the pool's start"
    multi_token_reason = "triton_gdn_decode_step takes one token per sequence (T = 1)"
    empty_reason = "a dense [B, 1] batch has no sequence without a token"

    def decode(self, inputs, params, pool, slot_of_sequence):
        cu = inputs["cu_seqlens"]
        if bool(((cu[1:] - cu[:-1]) != 1).any()):
            raise ValueError(self.multi_token_reason)
        if pool.stride(0) != pool[0].numel():
            raise ValueError(self.dense_pool_reason)
        a, bias = scalar_gate(inputs, "TokenSpeed's GDN decode")
        N = len(cu) - 1

        def rows(x):
            return x.reshape((N, 1) + tuple(x.shape[2:])).contiguous()

        scale = params.get("scale")
        o = self.mod.triton_gdn_decode_step(
            rows(inputs["q"]), rows(inputs["k"]), rows(inputs["v"]), A_log=inputs["A_log"].float(), a=rows(a),
            dt_bias=bias.float(), b=rows(inputs["beta"]), initial_state=pool,
            initial_state_indices=slot_of_sequence.to(torch.int32), scale=scale,
            use_qk_l2norm=bool(params.get("qk_l2norm")))
        return o.reshape((1, N) + tuple(o.shape[2:]))


def adapters():
    """TokenSpeed's serving kernels (the `k3ref.adapters` built-ins; see registry.builtin_adapters)."""
    return [TokenSpeedKdaPoolDecodeAdapter(), TokenSpeedKdaMtpVerifyAdapter(), TokenSpeedKdaChunkPrefillAdapter(),
            TokenSpeedGdnDecodeAdapter()]
