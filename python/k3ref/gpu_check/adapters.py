"""One adapter per kernel. An adapter maps k3ref's KDA conventions (DESIGN.md section 3,
golden params) onto a kernel's API, says which cases it supports (and why not), and is
reported as skipped, with the reason, when its kernel cannot be imported.

Adding an adapter: subclass KdaAdapter, set `name` and `policy` (the tolerance policy with
its justification), implement `load()` (import the kernel; raise to mark it unavailable),
`unsupported(params, shapes)` (None or the reason) and `run(inputs, params, out=None)`
returning (o, final_state) with final_state in the layout params['state_layout'] names.
Then list it in `all_adapters`.
"""
import importlib
import sys

import torch

from . import lib, reference


def _shapes(inputs):
    q, v = inputs["q"], inputs["v"]
    B, T, H, K = q.shape
    return dict(B=B, T=T, H=H, K=K, HV=v.shape[2], V=v.shape[3])


class LoadableAdapter:
    """What every adapter shares: `load()` imports its kernel (raising to mark it
    unavailable), and `available()` tries that once and keeps the reason."""

    def __init__(self):
        self._loaded = None
        self._reason = ""

    def available(self):
        if self._loaded is None:
            try:
                self.load()
                self._loaded = True
            except Exception as e:  # any import failure means "not available", with the reason
                self._loaded = False
                self._reason = f"{type(e).__name__}: {e}"
        return self._loaded

    @property
    def unavailable_reason(self):
        return self._reason

    def load(self):
        pass


class KdaAdapter(LoadableAdapter):
    name = "?"
    policy = "recurrent"
    policy_reason = ""
    kind = "kernel"  # kernel | reference | mutant
    output_dtype = torch.bfloat16
    accepts_out = False  # run() writes into a given output buffer
    device_sync = False  # synchronise after each run (set for CUDA devices)

    def unsupported(self, params, shapes):
        return None

    def run(self, inputs, params, out=None):
        raise NotImplementedError


def _add_path(path):
    if path and path not in sys.path:
        sys.path.insert(0, path)


class FlaAdapter(KdaAdapter):
    """FLA's chunk_kda / fused_recurrent_kda (fla-org/flash-linear-attention)."""

    fla_path = None

    def __init__(self, variant, safe_gate=False):
        super().__init__()
        self.variant = variant
        self.safe_gate = safe_gate
        self.name = f"fla.{variant}" + ("[safe_gate]" if safe_gate else "")
        if variant == "fused_recurrent_kda":
            self.policy = "recurrent"
            self.policy_reason = "fp32 recurrence on bf16 inputs: 1.0x the bf16 output floor measured on an H200"
        else:
            self.policy = "chunk"
            self.policy_reason = "chunked UT transform with bf16 tensor-core products: 2.0x-2.7x measured"

    def load(self):
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        _add_path(FlaAdapter.fla_path)
        self.fn = getattr(importlib.import_module("fla.ops.kda"), self.variant)

    def unsupported(self, params, s):
        if s["K"] > 256:
            return "FLA KDA supports K <= 256"
        if self.safe_gate:
            lb = params.get("lower_bound")
            if params.get("gate") != "lower_bound" or lb is None or not (-5 <= lb < 0):
                return "safe_gate needs the lower-bound gate with -5 <= lower_bound < 0"
        if params.get("gate") == "softplus" and not params.get("A_log"):
            return "FLA's softplus gate needs A_log"
        return None

    def run(self, inputs, params, out=None):
        s = _shapes(inputs)
        kw = dict(scale=params.get("scale"), output_final_state=True,
                  use_qk_l2norm_in_kernel=bool(params.get("qk_l2norm")),
                  state_v_first=params.get("state_layout") == "v_first")
        h0 = inputs.get("initial_state")
        if h0 is not None:
            kw["initial_state"] = h0.float()
        if inputs.get("cu_seqlens") is not None:
            kw["cu_seqlens"] = inputs["cu_seqlens"]
        gate = params.get("gate", "log_decay")
        if gate != "log_decay":
            kw["use_gate_in_kernel"] = True
            kw["A_log"] = inputs["A_log"].float() if inputs.get("A_log") is not None else None
            if inputs.get("dt_bias") is not None:
                kw["dt_bias"] = inputs["dt_bias"].float().reshape(s["HV"] * s["K"])
            if gate == "lower_bound":
                kw["lower_bound"] = float(params["lower_bound"])
        if self.safe_gate:
            kw["safe_gate"] = True
        beta = params.get("beta", "as_given")
        if beta != "as_given":
            kw["use_beta_sigmoid_in_kernel"] = True
            kw["allow_neg_eigval"] = beta == "two_sigmoid"
        o, final = self.fn(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], **kw)[:2]
        return o, final


class FlashKdaAdapter(KdaAdapter):
    """FlashKDA's flash_kda.fwd (MoonshotAI/FlashKDA): forward only, K = V = 128, no GVA,
    lower-bound gate in kernel, beta = sigmoid(logits), q/k L2 norm always on, state [N,H,V,K]."""

    name = "flashkda.fwd"
    policy = "flashkda"
    policy_reason = "chunk 16, fp16 Neumann inverse, bf16 state between chunks: 3.4x-3.5x measured"
    accepts_out = True
    flashkda_path = None

    def load(self):
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        _add_path(FlashKdaAdapter.flashkda_path)
        self.mod = importlib.import_module("flash_kda")

    def unsupported(self, params, s):
        if s["K"] != 128 or s["V"] != 128:
            return "FlashKDA needs K = V = 128"
        if s["H"] != s["HV"]:
            return "FlashKDA has no GVA"
        if params.get("gate") != "lower_bound" or not (-5 <= (params.get("lower_bound") or 0) <= 0):
            return "FlashKDA computes the lower-bound gate in kernel, lower_bound in [-5, 0]"
        if params.get("beta") != "sigmoid":
            return "FlashKDA applies sigmoid to beta"
        if not params.get("qk_l2norm"):
            return "FlashKDA always L2-normalises q and k"
        return None

    def run(self, inputs, params, out=None):
        q = inputs["q"]
        B, T, H, K = q.shape
        V = inputs["v"].shape[3]
        cu = inputs.get("cu_seqlens")
        N = cu.numel() - 1 if cu is not None else B
        o = out if out is not None else torch.empty(B, T, H, V, dtype=torch.bfloat16, device=q.device)
        A_log = inputs.get("A_log")
        A_log = A_log.float().contiguous() if A_log is not None else torch.zeros(H, device=q.device)  # exp(0) = 1
        dt_bias = inputs.get("dt_bias")
        dt_bias = dt_bias.float().reshape(H, K).contiguous() if dt_bias is not None else torch.zeros(H, K, device=q.device)
        v_first = params.get("state_layout") == "v_first"
        h0 = inputs.get("initial_state")
        if h0 is not None:
            h0 = h0.float()
            h0 = (h0 if v_first else h0.transpose(-1, -2)).contiguous()
        final = torch.empty(N, H, V, K, dtype=torch.float32, device=q.device)
        scale = params.get("scale")
        scale = K ** -0.5 if scale is None else scale
        self.mod.fwd(q, inputs["k"], inputs["v"], inputs["g"], inputs["beta"], scale, o, A_log, dt_bias,
                     float(params["lower_bound"]), initial_state=h0, final_state=final, cu_seqlens=cu)
        return o, (final if v_first else final.transpose(-1, -2).contiguous())


class LibKernelAdapter(KdaAdapter):
    """libk3gc's fp32 KDA kernel (bf16 output), correct or with one deliberate mistake."""

    accepts_out = True

    def __init__(self, mutation=0):
        super().__init__()
        self.mutation = mutation
        self.mutation_name = lib.MUTATIONS[mutation]
        self.name = "k3gc.fp32" if mutation == 0 else f"mutant.{self.mutation_name}"
        self.kind = "kernel" if mutation == 0 else "mutant"
        self.policy = "recurrent"
        self.policy_reason = "fp32 recurrence on bf16 inputs, bf16 output"

    def load(self):
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        if not lib.available():
            raise RuntimeError(lib.load_error())

    def unsupported(self, params, s):
        if s["K"] > 128 or s["V"] > 128:
            return "libk3gc supports K, V <= 128"
        return None

    def run(self, inputs, params, out=None):
        return lib.kda_forward(inputs, params, precision=1, mutation=self.mutation, output_dtype=torch.bfloat16,
                               state_dtype=torch.float32, out=out)


class LibReferenceAdapter(KdaAdapter):
    """libk3gc's fp64 recurrence, checked against the CPU goldens (computed at 256 bits)."""

    name = "k3gc.fp64_reference"
    kind = "reference"
    policy = "rel-rms:1e-12"
    policy_reason = "fp64 arithmetic against 256-bit goldens: error of order 1e-15"
    output_dtype = torch.float64
    accepts_out = True

    def load(self):
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        if not lib.available():
            raise RuntimeError(lib.load_error())

    def unsupported(self, params, s):
        return "libk3gc supports K, V <= 128" if s["K"] > 128 or s["V"] > 128 else None

    def run(self, inputs, params, out=None):
        return lib.kda_forward(inputs, params, precision=0, output_dtype=torch.float64, state_dtype=torch.float64,
                               out=out)


class TorchKernelAdapter(KdaAdapter):
    """The PyTorch fp64 recurrence with its output rounded to bf16 (1.0x the floor by
    construction): a kernel for the host-side tests, on the CPU. A mutation makes it wrong
    on purpose, to test the checks themselves: `future_leak` reads q of token t+1 (a
    causality bug), `ignore_initial_state` starts every sequence from zero."""

    accepts_out = False
    MUTATIONS = (None, "future_leak", "ignore_initial_state")

    def __init__(self, future_leak=False, device="cpu", mutation=None):
        super().__init__()
        self.mutation = "future_leak" if future_leak else mutation
        if self.mutation not in self.MUTATIONS:
            raise ValueError(f"unknown mutation {mutation}")
        self.device = device
        self.name = "torch.fp64_bf16" + (f"[{self.mutation}]" if self.mutation else "")
        self.kind = "mutant" if self.mutation else "kernel"

    def run(self, inputs, params, out=None):
        inputs = dict(inputs)
        if self.mutation == "future_leak":
            q = inputs["q"]
            inputs["q"] = torch.cat([q[:, 1:], q[:, -1:]], dim=1)
        elif self.mutation == "ignore_initial_state":
            inputs.pop("initial_state", None)
        o, final = reference.kda_forward(inputs, params)
        return o.to(torch.bfloat16), final.to(torch.float32)


def all_adapters(include_mutants=True):
    adapters = [
        LibReferenceAdapter(),
        FlaAdapter("fused_recurrent_kda"),
        FlaAdapter("chunk_kda"),
        FlaAdapter("chunk_kda", safe_gate=True),
        FlashKdaAdapter(),
        LibKernelAdapter(0),
    ]
    if include_mutants:
        adapters += [LibKernelAdapter(m) for m in range(1, len(lib.MUTATIONS))]
    return adapters


def kernel_by_name(name):
    """The KDA adapter called `name` (as reports print it), including the CPU test kernels."""
    known = all_adapters(include_mutants=True) + [TorchKernelAdapter(mutation=m) for m in TorchKernelAdapter.MUTATIONS]
    for a in known:
        if a.name == name:
            return a
    raise ValueError(f"no KDA kernel named '{name}'; known: {', '.join(a.name for a in known)}")
