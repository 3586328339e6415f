"""The built-in KDA adapters (one per kernel) and the KDA adapter base, on the protocol of protocol.py.

Every operator family (KDA, AttnRes, QB, the serving paths) is checked through one protocol,
the class `Adapter`. An adapter states:

- what it is: `name` (unique, as reports print it), `family` ("kda", "attnres", "qb",
  "serving", ...), `kind` ("kernel", "reference" or "mutant": a mutant is a kernel with a
  deliberate mistake that some check must catch);
- what it supports: `checks` (the check names it is run with), `golden_ops` (the golden
  operators whose cases it takes), `domain` (the inputs and options it accepts, in the schema
  of policy/kernel_domains.json, where the built-in kernels' domains are; None: everything)
  and, per case, `case_unsupported(case)`: None, or the reason the case is outside the
  kernel's domain (reported as `n/a (outside the kernel's domain: <reason>)`, not a failure),
  and for KDA adapters `version_unsupported(params, shapes)`: what the installed version lacks
  (probe.py; `n/a (not supported by this version: <what>)`);
- how it runs: `load()` imports the kernel and raises when it is unavailable (the reason is
  kept and reported); `run_check(check, case, device)` runs one check on one case and
  returns a `checks.CheckResult`. KDA adapters implement only `run(inputs, params, out=None)`
  (returning (o, final_state) in k3ref's conventions), and `unsupported(params, shapes)` for
  what the domain cannot say (by default the domain);
  `KdaAdapter.run_check` supplies the golden and metamorphic checks;
- its precision contract and policy: `contract` (one line: what the kernel computes in which
  precision, and what it rounds to), `output_dtype` (the format of its outputs, whose
  rounding floor the floor policies use), `policy` (a tolerance policy: a name of the policy
  table or `floor:<m>` / `rel-rms:<r>`) and `policy_reason` (why that bound).

Registration needs no source edit: an entry point of group `k3ref.adapters`, `--adapter
mypkg.mod:MyKernel` on the command line (`python3 -m k3ref.gpu_check run`, `pytest
--k3ref-adapter`), or `k3ref_adapters = [...]` in a project's conftest.py (registry.py). The
built-in adapters below are registered the same way (`registry.builtin_adapters`, the package's own
entry point). Every adapter gets the run's frozen options (`self.run_options`, protocol.RunOptions);
third-party kernels are found at the paths they give (`self.path_of("fla_path")`: the
command-line options --fla-path, ..., else K3REF_FLA_PATH, K3REF_FLASHKDA_PATH, K3REF_LIGER_PATH,
K3REF_TORCHTITAN_PATH, and K3GC_LIB for libk3gc.so), else the installed packages.

Adapters are built anew in every process that runs their checks (a pytest-xdist worker), from
the same specs the plan read: construct one without importing its kernel (that is load()'s work).
"""
import importlib

import torch

from .. import kernel_domains_file
from . import lib, probe, torch_model
from .protocol import input_dtype_of, outside_domain
from .protocol import KDA_METAMORPHIC, Adapter, BrokenAdapter, CheckResult, LoadableAdapter  # noqa: F401 (the protocol's names, here as before)
from .protocol import shapes_of as _shapes
from .protocol import source_identity  # noqa: F401 (adapters.source_identity, as before)
from .upstream import add_path, fla_option_kwargs, fla_version, load_fla, module_version, need_cuda


def _load_libk3gc(adapter):
    """libk3gc's adapters' load(): the library at the run's path (--lib), else where lib finds it."""
    need_cuda()
    lib.use(adapter.path_of("lib"))
    if not lib.available():
        raise RuntimeError(lib.load_error())


class KdaAdapter(Adapter):
    """A KDA forward kernel. Implement `run(inputs, params, out=None)` returning
    (o [B,T,HV,V], final_state in the layout params['state_layout'] names) and
    `unsupported(params, shapes)` (None or the reason). Inputs arrive as golden tensors: bf16
    q/k/v/g/beta, fp32 A_log [HV], dt_bias [HV, K] and initial state, int64 cu_seqlens; params
    are the golden params (docs/golden-format.md)."""

    name = "?"
    family = "kda"
    golden_ops = ("kda.recurrent",)
    policy = "recurrent"
    policy_reason = ""
    kind = "kernel"  # kernel | reference | mutant
    output_dtype = torch.bfloat16
    accepts_out = False  # run() writes into a given output buffer
    device_sync = False  # synchronise after each run (set for CUDA devices)
    # The kernel's precision contract (k3ref.gpu_check.contracts, docs/contracts.md): when set,
    # golden, split and prop verdicts are err <= m x max(bf16 floor, contract error).
    contract_name = None  # its multiple: the rule of the policy table's contracts.policy_of(contract_name)
    # The optional backward (backward.py): "autograd" when run() is differentiable, or override
    # run_backward; either puts the `backward` check among the adapter's checks. Its gradients
    # are judged under `backward_policy` (a policy with kda.backward rules).
    gradients = None
    backward_policy = "chunk"
    forward_checks = ("golden",) + KDA_METAMORPHIC

    @property
    def checks(self):
        return self.forward_checks + (("backward",) if self.has_backward() else ())

    def has_backward(self):
        return self.gradients == "autograd" or type(self).run_backward is not KdaAdapter.run_backward

    def suite_ops(self):
        return tuple(self.golden_ops) + (("kda.backward",) if "backward" in self.checks else ())

    def backward_unsupported(self, params, shapes):
        """None, or why a gradient golden is outside the kernel's backward: by default what
        is outside its forward (`unsupported`)."""
        return self.unsupported(params, shapes)

    def run_backward(self, inputs, params, d_o, d_final_state):
        """{gradient name: tensor} for dq, dk, dv, dg, dbeta, d_initial_state (and dA_log,
        ddt_bias where the inputs have them) of the loss <o, d_o> + <final_state, d_final_state>;
        `inputs` are leaves that require grad (backward.gradient_inputs). By default autograd
        through run(); raise protocol.NotSupported for what the kernel cannot do."""
        from . import backward

        return backward.autograd_gradients(self.run, inputs, params, d_o, d_final_state)

    def unsupported(self, params, shapes):
        """None, or why (params, shapes) is outside the kernel: by default its `domain`."""
        return self.domain_reason(None, params, shapes)

    def version_unsupported(self, params, shapes):
        """None, or what of (params, shapes) the installed version lacks (probe.py), once loaded."""
        return None

    def case_unsupported(self, case):
        if case.op not in self.golden_ops:
            return f"takes {', '.join(self.golden_ops)}"
        s = _shapes(case.inputs)
        why = self.version_unsupported(case.params, s)
        if why:
            return f"n/a ({why})"
        return outside_domain(self.domain_reason(case.op, case.params, s, input_dtype_of(case.inputs))
                              or self.unsupported(case.params, s))

    def cases(self, check, suite):
        if check == "golden":
            yield from super().cases(check, suite)
            return
        if check == "backward":
            from . import backward

            yield from backward.cases(self, suite)
            return
        from .problems import pick_config

        c = pick_config(self)
        yield (c["name"], None, None) if c else ("-", None, "no supported configuration")

    def run_check(self, check, case, device):
        from . import checks

        self.device_sync = str(device).startswith("cuda")
        if check == "golden":
            if self.run_options.autotune_configs == "all":  # deep mode: once per autotune configuration
                return checks.golden_all_configs(self, case, device)
            return checks.golden_check(self, case, device)
        if check == "backward":
            from . import backward

            return checks.guard(self, "backward", case.name, lambda: backward.backward_check(self, case, device))
        return checks.METAMORPHIC_BY_NAME[check](self, device)

    def run(self, inputs, params, out=None):
        raise NotImplementedError


class FlaAdapter(KdaAdapter):
    """FLA's chunk_kda / fused_recurrent_kda (fla-org/flash-linear-attention)."""

    requires_cuda = True

    gradients = "autograd"  # chunk_kda has FLA's backward; a version without one is n/a (backward.py)
    gva = None  # whether the loaded version takes HV > H (probe.py; None: not known yet)
    _unpicklable = ("fn",)

    def __init__(self, variant, safe_gate=False):
        super().__init__()
        self.variant = variant
        self.safe_gate = safe_gate
        self.name = f"fla.{variant}" + ("[safe_gate]" if safe_gate else "")
        self.domain = kernel_domains_file.builtin(self.name)
        if variant == "fused_recurrent_kda":
            self.policy = "recurrent"
            self.policy_reason = "fp32 recurrence on bf16 inputs: 1.0x the bf16 output floor measured on an H200"
            self.contract = "Triton; fp32 state and arithmetic on bf16 inputs, output rounded to bf16"
            self.contract_name = "fla_recurrent"
        else:
            self.policy = "chunk"
            self.policy_reason = "chunked UT transform with bf16 tensor-core products: 2.0x-2.7x measured"
            self.contract = ("Triton; chunks of 64 in UT form, bf16 tensor-core products with fp32 accumulation, "
                             "fp32 state, output rounded to bf16")
            self.contract_name = "fla_chunk_safe_gate" if safe_gate else "fla_chunk"
            # The warm-up's scheduler starts the costliest units first: a chunk_kda group autotunes
            # 50-110 configurations (~150 s on a busy H200), a fused_recurrent group compiles one (~1 s).
            self.warmup_weight = 100
            self.warmup_share = "fla.chunk_kda"  # its autotuned kernels, keyed on warmup.AUTOTUNE_DIMS

    def load(self):
        need_cuda()
        self.fn = getattr(load_fla(self.path_of("fla_path")), self.variant)

    def version(self):
        return fla_version()

    def keywords(self, inputs, params):
        kw = dict(fla_option_kwargs(inputs, params), output_final_state=True,
                  state_v_first=params.get("state_layout") == "v_first")
        h0 = inputs.get("initial_state")
        if h0 is not None:
            kw["initial_state"] = h0.float()
        if inputs.get("cu_seqlens") is not None:
            kw["cu_seqlens"] = inputs["cu_seqlens"]
        if self.safe_gate:
            kw["safe_gate"] = True
        return kw

    def unsupported(self, params, shapes):
        return self.domain_reason(None, params, shapes) or self.version_unsupported(params, shapes)

    def version_unsupported(self, params, shapes):
        # Known only once the kernel is loaded (in the process that runs it): probe.py.
        if getattr(self, "fn", None) is None:
            return None
        return probe.version_reason(self, params, shapes, self._call)

    def backward_unsupported(self, params, shapes):
        # K <= 256 and the softplus gate's A_log are its domain's (policy/kernel_domains.json).
        if params.get("state_layout") == "v_first":
            return "the golden uses a V-first state (FLA's backward is checked K-first)"
        return self.unsupported(params, shapes)

    def _call(self, inputs, params):
        return self.fn(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                       **self.keywords(inputs, params))[:2]

    def run(self, inputs, params, out=None):
        probe.refuse_unknown(self.fn, self.keywords(inputs, params))
        o, final = probe.call_with_gva_trial(self, lambda x: self._call(x, params), inputs)
        return o, final


class FlashKdaAdapter(KdaAdapter):
    """FlashKDA's flash_kda.fwd (MoonshotAI/FlashKDA): forward only, K = V = 128, no GVA,
    lower-bound gate in kernel, beta = sigmoid(logits), q/k L2 norm always on, state [N,H,V,K]."""

    requires_cuda = True

    name = "flashkda.fwd"
    domain = kernel_domains_file.builtin(name)
    policy = "flashkda"
    policy_reason = "chunk 16, fp16 Neumann inverse, bf16 state between chunks: 3.4x-3.5x measured"
    contract = "CUTLASS (sm_90); chunks of 16, fp16 Neumann-series inverse, bf16 state between chunks, bf16 output"
    contract_name = "flashkda"
    accepts_out = True
    _unpicklable = ("mod",)

    def load(self):
        need_cuda()
        add_path(self.path_of("flashkda_path"))
        self.mod = importlib.import_module("flash_kda")

    def version(self):
        return module_version("flash_kda")

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

    requires_cuda = True

    accepts_out = True

    def __init__(self, mutation=0):
        super().__init__()
        self.mutation = mutation
        self.mutation_name = lib.MUTATIONS[mutation]
        self.name = "k3gc.fp32" if mutation == 0 else f"mutant.{self.mutation_name}"
        self.domain = kernel_domains_file.builtin("k3gc.fp32")  # a mutant has the domain of the kernel it mutates
        self.kind = "kernel" if mutation == 0 else "mutant"
        self.policy = "recurrent"
        self.policy_reason = "fp32 recurrence on bf16 inputs, bf16 output"
        self.contract = "CUDA; fp32 recurrence on bf16 inputs, output rounded to bf16" + (
            "" if mutation == 0 else f", with the mistake '{self.mutation_name}'")

    load = _load_libk3gc

    def run(self, inputs, params, out=None):
        return lib.kda_forward(inputs, params, precision=1, mutation=self.mutation, output_dtype=torch.bfloat16,
                               state_dtype=torch.float32, out=out)


class LibReferenceAdapter(KdaAdapter):
    """libk3gc's fp64 recurrence, checked against the CPU goldens (computed at 256 bits)."""

    requires_cuda = True

    name = "k3gc.fp64_reference"
    domain = kernel_domains_file.builtin(name)
    kind = "reference"
    policy = "rel-rms:1e-12"
    policy_reason = "fp64 arithmetic against 256-bit goldens: error of order 1e-15"
    contract = "CUDA; fp64 recurrence, fp64 output; fp64 backward"
    forward_checks = ("golden",)
    output_dtype = torch.float64
    state_dtype = torch.float64
    accepts_out = True

    load = _load_libk3gc

    def run(self, inputs, params, out=None):
        return lib.kda_forward(inputs, params, precision=0, output_dtype=torch.float64, state_dtype=torch.float64,
                               out=out)

    # Its backward (k3gc_kda_backward, fp64) on the gradient goldens: the scale tier's gradient
    # reference judged as its forward is, against the 256-bit goldens.
    backward_policy = "rel-rms:1e-12"

    def run_backward(self, inputs, params, d_o, d_final_state):
        return lib.kda_backward(inputs, params, d_o, d_final_state)


class HostReferenceAdapter(KdaAdapter):
    """k3ref's compiled reference in double (k3ref._core): the scale tier's reference off a
    CUDA device (scale.reference), judged on the goldens as libk3gc's fp64 kernel is on one."""

    name = "k3ref.double"
    kind = "reference"
    policy = "rel-rms:1e-12"
    policy_reason = "double arithmetic against 256-bit goldens: error of order 1e-16"
    contract = "CPU; k3ref's reference in double, fp64 output"
    checks = ("golden",)
    output_dtype = torch.float64

    def load(self):
        from . import references

        if references._module() is None:
            raise RuntimeError("k3ref._core is not importable")

    def run(self, inputs, params, out=None):
        from . import references

        return references.module_reference(inputs, params)


class TorchKernelAdapter(KdaAdapter):
    """The PyTorch fp64 recurrence with its output rounded to bf16 (1.0x the floor by
    construction): a kernel for the host-side tests, on the CPU. A mutation makes it wrong
    on purpose, to test the checks themselves: `future_leak` reads q of token t+1 (a
    causality bug), `ignore_initial_state` starts every sequence from zero."""

    accepts_out = False
    policy = "recurrent"
    policy_reason = "the exact recurrence rounded once to bf16: 1.0x the floor by construction"
    contract = "PyTorch; fp64 recurrence, output rounded to bf16, final state to fp32"
    gradients = "autograd"  # through the fp64 recurrence (and the roundings, which pass gradients through)
    MUTATIONS = (None, "future_leak", "ignore_initial_state")

    def __init__(self, future_leak=False, device="cpu", mutation=None):
        super().__init__()
        self.mutation = "future_leak" if future_leak else mutation
        if self.mutation not in self.MUTATIONS:
            raise ValueError(f"unknown mutation {mutation}")
        self.device = device
        self.name = "torch.fp64_bf16" + (f"[{self.mutation}]" if self.mutation else "")
        self.domain = kernel_domains_file.builtin("torch.fp64_bf16")
        self.kind = "mutant" if self.mutation else "kernel"

    def run(self, inputs, params, out=None):
        inputs = dict(inputs)
        if self.mutation == "future_leak":
            q = inputs["q"]
            inputs["q"] = torch.cat([q[:, 1:], q[:, -1:]], dim=1)
        elif self.mutation == "ignore_initial_state":
            inputs.pop("initial_state", None)
        o, final = torch_model.kda_forward(inputs, params)
        return o.to(torch.bfloat16), final.to(torch.float32)


def kda_adapters(include_mutants=True):
    adapters = [
        LibReferenceAdapter(),
        FlaAdapter("fused_recurrent_kda"),
        FlaAdapter("chunk_kda"),
        FlaAdapter("chunk_kda", safe_gate=True),
        FlashKdaAdapter(),
        LibKernelAdapter(0),
    ]
    if include_mutants:
        adapters += [LibKernelAdapter(m) for m in range(1, len(lib.MUTATIONS)) if lib.MUTATIONS[m] not in lib.SCALE_MUTANTS]
    return adapters


def scale_mutants():
    """libk3gc's scale mutants (lib.SCALE_MUTANTS) as adapters: the scale tier's, which the default
    tier runs with `--adapter k3ref.gpu_check.adapters:scale_mutants`."""
    return [LibKernelAdapter(lib.MUTATIONS.index(m)) for m in lib.SCALE_MUTANTS]


def scale_kernels():
    """The scale tier's built-in kernels (scale.py), its mutants last."""
    kernels = [FlaAdapter("chunk_kda"), FlaAdapter("fused_recurrent_kda"), FlashKdaAdapter(), LibKernelAdapter(0)]
    return kernels + scale_mutants()


def torch_test_kernels():
    """The CPU test kernels (not run unless named): the correct one and its mutants. Register
    them with `--adapter k3ref.gpu_check.adapters:torch_test_kernels`."""
    return [TorchKernelAdapter(mutation=m) for m in TorchKernelAdapter.MUTATIONS]
