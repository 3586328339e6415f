"""Context-parallel (KCP) checks, rank by rank, over P processes (docs/gpu_check.md, "Context
parallelism"; the conventions are docs/kcp.md's).

A context-parallel kernel splits one packed sequence (B = 1, documents in cu_seqlens) over P
ranks at the positions `splits`. Rank r computes, from a zero state, the fragment pair
(M_r, S~_r) of its last local document, all-gathers the pairs, folds S <- M_j S + S~_j over
the earlier ranks j of its first document (from the rank where that document began), and
runs its tokens from that entering state. The backward mirrors it: each rank's adjoint
fragment (M^T, G~) of its first document, an all-gather, a reverse fold giving the state
gradient that arrives at the rank's end, then the gradients of its own tokens.

The checks (adapter protocol of adapters.py, family "kcp", one adapter per kernel and P):

- `cp_forward`: per rank o (its tokens), fragment_transition, fragment_state and
  entering_state against the reference, under the kernel's policy (k3ref.policy, operator
  kcp.context_parallel); o under the kernel's precision contract when it declares one
  (contracts.py, evaluated on the rank's own slice from its exact entering state);
- `cp_backward`: per rank dq, dk, dv, dg, dbeta (its tokens), the entering state, the state
  gradient entering the rank (cp_entering_state_gradients) and the one arriving at its end
  from the next rank, and dA_log / ddt_bias summed over ranks (operator kda.backward);
- both: the bytes passed to torch.distributed's collectives, measured per rank and phase
  by wrapping them, against the design's formula: each all-gather of fragment pairs
  gathers P x HV x K x (K + V) elements per rank (HV = the state's heads, the value heads
  under GVA; docs/kcp.md "Communication"), HV x K x (K + V) of them its own.

The reference of a case is its golden (kcp_* for the forward, kda_backward_* with splits
for the backward) or, for the case each adapter adds (P ranks, T not divisible by P,
documents crossing one and several rank boundaries, a rank holding only the middle of a
document, GVA), k3ref.kcp_forward / kcp_backward at 256 bits on the same inputs.

Ranks are processes started by torch.multiprocessing (fork for gloo on the CPU, spawn for
NCCL on GPUs, rank r on cuda:r), all of an adapter's (check, case) pairs in one launch.
A rank that raises or a launch that times out is an error of every check of that launch.

    python3 -m k3ref.gpu_check.cp_check --ranks 2,4,8 --backend gloo --out report/          # CPU kernel + mutants
    python3 -m k3ref.gpu_check.cp_check --ranks 2,4,8 --backend nccl --kernel fla --fla-path DIR --out report/

(the same as `python3 -m k3ref.gpu_check run --no-builtin --adapter
k3ref.gpu_check.cp_check:cp_adapters --set cp.ranks=2,4,8 --set cp.backend=gloo --set
cp.kernel=torch`; `--set cp.timeout=S` bounds one launch, `--set cp.start_method=spawn|fork`
overrides how ranks start).
"""
import datetime
import os
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .problems import TOKEN_INPUTS
from .protocol import Adapter, CheckResult
from .upstream import fla_option_kwargs, fla_version, load_fla, need_cuda

FORWARD_OP = "kcp.context_parallel"
BACKWARD_OP = "kda.backward"
FORWARD_TENSORS = ("o", "fragment_transition", "fragment_state", "entering_state")
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta")
PARAMETER_GRADIENTS = ("dA_log", "ddt_bias")
INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
LAUNCH_TIMEOUT_S = 300.0  # one launch on gloo, unless the run's cp.timeout setting says otherwise


# --------------------------------------------------------------------------- plan

@dataclass
class RankSlice:
    begin: int
    end: int
    first_doc: int = -1
    last_doc: int = -1
    continues: bool = False   # the first document began on an earlier rank
    origin_rank: int = -1     # the rank where it began (own index when not continuing)
    carries: bool = False     # the last document goes on past `end`
    last_part_begin: int = 0
    local_cu: list = field(default_factory=list)

    @property
    def empty(self):
        return self.begin == self.end


def plan_split(cu, splits):
    """Per rank its slice and documents, as kcp::plan_split (include/k3ref/kcp/plan.h)."""
    cu, splits = [int(x) for x in cu], [int(x) for x in splits]
    if not cu or cu[0] != 0 or any(a > b for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cp_check: cu_seqlens {cu} must start at 0 and not decrease")
    if len(splits) < 2 or splits[0] != 0 or splits[-1] != cu[-1] or any(a > b for a, b in zip(splits, splits[1:])):
        raise ValueError(f"cp_check: splits {splits} must run from 0 to T = {cu[-1]} without decreasing")

    def doc_of(t):
        return next(n for n in range(len(cu) - 1) if cu[n] <= t < cu[n + 1])

    ranks = []
    for r in range(len(splits) - 1):
        b, e = splits[r], splits[r + 1]
        s = RankSlice(b, e, local_cu=[0])
        if b < e:
            s.first_doc, s.last_doc = doc_of(b), doc_of(e - 1)
            s.continues = cu[s.first_doc] < b
            start = cu[s.first_doc]
            s.origin_rank = next(j for j in range(r + 1) if splits[j] <= start < splits[j + 1]) if s.continues else r
            s.carries = cu[s.last_doc + 1] > e
            s.last_part_begin = max(b, cu[s.last_doc])
            s.local_cu = [0] + [min(e, cu[n + 1]) - b for n in range(s.first_doc, s.last_doc + 1)]
        ranks.append(s)
    return ranks


def even_splits(T, P):
    """P near-equal slices, the first T mod P one token longer (kcp::even_split, align 1)."""
    base, extra = divmod(T, P)
    out = [0]
    for r in range(P):
        out.append(out[-1] + base + (1 if r < extra else 0))
    return out


# --------------------------------------------------------------------------- wire bytes

class WireCounter:
    """Counts what passes through torch.distributed's collectives while active: per call the
    operation, the bytes this rank contributes (sent) and the bytes it receives from others
    (for an all-gather: the output less its own part). The phase is set by the kernel's
    caller ("forward", "backward")."""

    WRAPPED = ("all_gather", "all_gather_into_tensor", "_all_gather_base", "send", "recv", "isend", "irecv",
               "broadcast", "all_reduce", "reduce_scatter_tensor", "all_to_all_single")

    def __init__(self):
        self.calls = []
        self.phase = "-"

    @staticmethod
    def _bytes(t):
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    # Positional order and keyword names of each wrapped function's tensor arguments.
    ARGS = {"all_gather": ("tensor_list", "tensor"), "all_gather_into_tensor": ("output_tensor", "input_tensor"),
            "_all_gather_base": ("output_tensor", "input_tensor"), "send": ("tensor", "dst"),
            "recv": ("tensor", "src"), "isend": ("tensor", "dst"), "irecv": ("tensor", "src"),
            "broadcast": ("tensor", "src"), "all_reduce": ("tensor",),
            "reduce_scatter_tensor": ("output", "input"), "all_to_all_single": ("output", "input")}

    def _record(self, op, args, kwargs):
        names = self.ARGS[op]
        args = tuple(args) + tuple(kwargs.get(n) for n in names[len(args):])
        b = self._bytes
        world = torch.distributed.get_world_size()
        if op == "all_gather":
            out, inp = args[0], args[1]
            gathered = sum(b(x) for x in out)
            sent, received = b(inp), gathered - b(inp)
        elif op in ("all_gather_into_tensor", "_all_gather_base"):
            out, inp = args[0], args[1]
            gathered = b(out)
            sent, received = b(inp), gathered - b(inp)
        elif op in ("send", "isend"):
            gathered, sent, received = 0, b(args[0]), 0
        elif op in ("recv", "irecv"):
            gathered, sent, received = 0, 0, b(args[0])
        elif op == "broadcast":
            src = args[1]
            mine = src == torch.distributed.get_rank()
            gathered, sent, received = 0, b(args[0]) * (world - 1) if mine else 0, 0 if mine else b(args[0])
        else:  # all_reduce, reduce_scatter, all_to_all: the tensor given, both ways
            t = args[1] if op in ("reduce_scatter_tensor", "all_to_all_single") else args[0]
            gathered, sent, received = 0, b(t), b(t)
        first = args[1] if op in ("all_gather", "all_gather_into_tensor", "_all_gather_base") else args[0]
        self.calls.append({"phase": self.phase, "op": op, "sent": sent, "received": received, "gathered": gathered,
                           "dtype": str(first.dtype).replace("torch.", "") if isinstance(first, torch.Tensor) else "",
                           "itemsize": first.element_size() if isinstance(first, torch.Tensor) else 0})

    @contextmanager
    def active(self):
        dist = torch.distributed
        saved = {}
        for name in self.WRAPPED:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            saved[name] = fn

            def wrapper(*args, __fn=fn, __name=name, **kwargs):
                self._record(__name, args, kwargs)
                return __fn(*args, **kwargs)

            setattr(dist, name, wrapper)
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)

    def totals(self):
        out = {}
        for c in self.calls:
            t = out.setdefault(c["phase"], {"calls": 0, "sent": 0, "received": 0, "gathered": 0, "ops": []})
            t["calls"] += 1
            for k in ("sent", "received", "gathered"):
                t[k] += c[k]
            t["ops"].append(f"{c['op']}({c['dtype']})")
        return out


def formula_elements(P, HV, K, V):
    """Elements one rank gathers per all-gather of fragment pairs: P x HV x K x (K + V)."""
    return P * HV * K * (K + V)


# --------------------------------------------------------------------------- the PyTorch CP kernel

def _prepare(local, params):
    from .torch_model import prepare

    return prepare(local, params)


def _scale(params, K):
    s = params.get("scale")
    return K ** -0.5 if s is None else float(s)


def _heads(H, HV, device):
    return torch.arange(HV, device=device) // (HV // H)


def _run(q, k, v, d, beta, t0, t1, Z, scale, heads, outputs=True):
    """Runs local tokens [t0, t1) on Z [HV, K, W] (state columns; for W > V the leading
    columns have v = 0, so they carry the transition). Returns (o rows [t1-t0, HV, V'], Z)."""
    rows = []
    W = Z.shape[-1]
    V = v.shape[-1]
    for t in range(t0, t1):
        kt = k[0, t, heads]                                  # [HV, K]
        Z = Z * d[0, t].unsqueeze(-1)                        # Diag(a_t) Z
        vt = v[0, t] if W == V else torch.cat([torch.zeros(v.shape[2], W - V, dtype=Z.dtype, device=Z.device),
                                               v[0, t]], dim=-1)
        u = vt - torch.einsum("hk,hkw->hw", kt, Z)
        Z = Z + beta[0, t].reshape(-1, 1, 1) * kt.unsqueeze(-1) * u.unsqueeze(1)
        if outputs:
            rows.append(torch.einsum("hk,hkv->hv", q[0, t, heads] * scale, Z[..., W - V:]))
    o = torch.stack(rows) if rows else torch.zeros(0, v.shape[2], V, dtype=Z.dtype, device=Z.device)
    return o, Z


def _adjoint(q, k, d, beta, d_o, t0, t1, G, scale, heads):
    """dL/d(state entering token t0) from G = dL/d(state after t1 - 1) through later tokens:
    per token G += q^_t dO_t^T, then G <- M_t^T G = Diag(a_t) (G - beta_t k_t (k_t^T G))."""
    for t in range(t1 - 1, t0 - 1, -1):
        kt = k[0, t, heads]
        G = G + (q[0, t, heads] * scale).unsqueeze(-1) * d_o[0, t].unsqueeze(1)
        kG = torch.einsum("hk,hkv->hv", kt, G)
        G = d[0, t].unsqueeze(-1) * (G - beta[0, t].reshape(-1, 1, 1) * kt.unsqueeze(-1) * kG.unsqueeze(1))
    return G


class TorchCpAdapter(Adapter):
    """A context-parallel KDA kernel in PyTorch, for the CPU (gloo) and as the model of what a
    rank does: fp64 arithmetic, its fragment pair from zero, one all-gather of the pairs
    packed [HV, K, K + V] (transition, then state), the fold over the earlier ranks of its
    first document, its tokens from the entering state; the backward with explicit adjoint
    fragments and autograd inside the rank. A mutation makes it wrong on purpose (the checks
    must catch each): `drop_trailing` (the last rank stops at P x floor(T / P): the trailing
    tokens of a T not divisible by P are lost), `wrong_rank` (a rank enters with the state
    meant for the rank before it), `untransposed` (the backward folds M instead of M^T)."""

    family = "kcp"
    checks = ("cp_forward", "cp_backward")
    golden_ops = (FORWARD_OP, BACKWARD_OP)
    policy = "rel-rms:1e-12"
    policy_reason = "fp64 arithmetic against 256-bit references: errors of order 1e-15"
    contract = "PyTorch; fp64 fragments, merge and recurrence; fp64 on the wire"
    output_dtype = torch.float64
    contract_name = None  # a KDA precision contract (contracts.py) for the ranks' o, or None
    backend = "gloo"
    # Which fragment entries the checks judge: "all" (the k3ref convention: M = 0 where the
    # last document starts inside the slice, every rank's pair) or "used" (only what the
    # origin-rank fold reads, for kernels that leave the rest unspecified, as FLA does).
    fragment_scope = "all"
    exposes_entering_gradient = True
    synthetic_even = False      # the adapter's own case has T divisible by P (else T mod P = P - 1)
    refuses_uneven = False      # may refuse T not divisible by P (then every rank must raise ValueError)
    MUTATIONS = (None, "drop_trailing", "wrong_rank", "untransposed")

    def __init__(self, ranks=2, mutation=None, backend="gloo"):
        super().__init__()
        if mutation not in self.MUTATIONS:
            raise ValueError(f"cp_check: unknown mutation {mutation!r} (known: {', '.join(map(str, self.MUTATIONS))})")
        self.ranks = int(ranks)
        self.mutation = mutation
        self.backend = backend
        self.kind = "mutant" if mutation else "kernel"
        self.name = (f"mutant.cp_{mutation}" if mutation else "torch.cp_fp64") + f"[P={self.ranks}]"
        self.isolation_group = self.name
        self._work = []

    # -- what runs on a rank
    def rank_device(self, rank):
        return torch.device("cpu")

    def forward_rank(self, ctx, local, params):
        q, k, v, d, beta = _prepare(local, params)
        s, P, r = ctx.slice, ctx.world, ctx.rank
        HV, K, V = v.shape[2], q.shape[3], v.shape[3]
        heads, scale = _heads(q.shape[2], HV, q.device), _scale(params, K)
        dt = torch.float64
        Tl = s.end - s.begin
        if self.mutation == "drop_trailing" and r == P - 1:
            Tl = max(0, min(Tl, P * (ctx.T // P) - s.begin))  # the bug: the last rank's length from T // P
        # The fragment of the last local document part (docs/kcp.md): the product over the
        # slice when that document began earlier (M), else 0 and its run from its initial state.
        eye = torch.eye(K, dtype=dt).expand(HV, K, K)
        lp = s.last_part_begin - s.begin
        starts_inside = ctx.cu[s.last_doc] >= s.begin if not s.empty else False
        Z0 = torch.cat([eye, torch.zeros(HV, K, V, dtype=dt)], dim=-1)
        _, Z = _run(q, k, v, d, beta, lp if starts_inside else 0, Tl, Z0, scale, heads, outputs=False)
        M = torch.zeros(HV, K, K, dtype=dt) if starts_inside else Z[..., :K]
        if s.empty:
            M = eye.clone()
        S_frag = Z[..., K:]
        packed = torch.cat([M, S_frag], dim=-1).contiguous()
        parts = [torch.empty_like(packed) for _ in range(P)]
        torch.distributed.all_gather(parts, packed)
        entering = torch.zeros(HV, K, V, dtype=dt)
        if s.continues:
            last = r - 2 if self.mutation == "wrong_rank" else r - 1
            for j in range(s.origin_rank, last + 1):
                entering = parts[j][..., :K] @ entering + parts[j][..., K:]
        # Own tokens: the first document from the entering state, the others from zero.
        rows = []
        for j in range(len(s.local_cu) - 1):
            a, b = s.local_cu[j], min(s.local_cu[j + 1], Tl)
            if a >= b:
                continue
            start = entering if j == 0 else torch.zeros(HV, K, V, dtype=dt)
            o, _ = _run(q, k, v, d, beta, a, b, start.clone(), scale, heads)
            rows.append(o)
        o = torch.cat(rows).unsqueeze(0) if rows else torch.zeros(1, 0, HV, V, dtype=dt)
        return {"o": o, "fragment_transition": M, "fragment_state": S_frag, "entering_state": entering}

    def backward_rank(self, ctx, local, params, d_o, counter):
        counter.phase = "forward"
        fwd = self.forward_rank(ctx, local, params)
        counter.phase = "backward"
        entering = fwd["entering_state"]
        s, P, r = ctx.slice, ctx.world, ctx.rank
        q, k, v, d, beta = _prepare(local, params)
        HV, K, V = v.shape[2], q.shape[3], v.shape[3]
        heads, scale = _heads(q.shape[2], HV, q.device), _scale(params, K)
        dt = torch.float64
        d_o = d_o.to(dt)
        Tl = s.end - s.begin
        # Adjoint fragment of the first local document part: G~ from a zero gradient at its end
        # (no final-state gradient), and M^T of the slice when one document covers it and goes on.
        zeros = torch.zeros(HV, K, V, dtype=dt)
        eye = torch.eye(K, dtype=dt).expand(HV, K, K)
        if s.empty:
            A = torch.cat([eye, zeros], dim=-1).contiguous()
        else:
            G = _adjoint(q, k, d, beta, d_o, 0, s.local_cu[1], zeros.clone(), scale, heads)
            passes = s.first_doc == s.last_doc and s.carries
            Tr = torch.zeros(HV, K, K, dtype=dt)
            if passes:
                Z0 = torch.cat([eye, zeros], dim=-1)
                _, Z = _run(q, k, v, d, beta, 0, Tl, Z0, scale, heads, outputs=False)
                Tr = Z[..., :K] if self.mutation == "untransposed" else Z[..., :K].transpose(-1, -2)
            A = torch.cat([Tr, G], dim=-1).contiguous()
        parts = [torch.empty_like(A) for _ in range(P)]
        torch.distributed.all_gather(parts, A)

        def entering_gradient(j):  # Lambda_j: dL/d(state entering rank j), from the gathered fragments
            sj = ctx.ranks[j]
            if sj.empty:
                return entering_gradient(j + 1) if j + 1 < P else zeros
            return parts[j][..., :K] @ arriving(j) + parts[j][..., K:]

        def arriving(j):  # dL/d(state leaving rank j's last document at its end)
            sj = ctx.ranks[j]
            if sj.empty or not sj.carries or j + 1 >= P:
                return zeros
            return entering_gradient(j + 1)

        arrive = arriving(r)
        lam = entering_gradient(r)
        # Gradients of the own tokens: autograd through the rank's forward from its entering
        # state, with the arriving gradient on the state its last document leaves with.
        leaves = {n: local[n].detach().to(dt).clone().requires_grad_(True) for n in INPUTS if local.get(n) is not None}
        qa, ka, va, da, ba = _prepare(leaves, params)
        loss = torch.zeros((), dtype=dt)
        for j in range(len(s.local_cu) - 1):
            a, b = s.local_cu[j], s.local_cu[j + 1]
            if a >= b:
                continue
            start = entering.detach().clone() if j == 0 else zeros.clone()
            o, Z = _run(qa, ka, va, da, ba, a, b, start, scale, heads)
            loss = loss + (o * d_o[0, a:b]).sum()
            if j == len(s.local_cu) - 2 and s.carries:
                loss = loss + (Z * arrive).sum()
        names = list(leaves)
        # An empty slice (or one whose loss reads no input) has zero gradients, of its own shape.
        grads = (torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True) if loss.requires_grad
                 else [None] * len(names))
        out = {"d" + n: (g if g is not None else torch.zeros_like(leaves[n])) for n, g in zip(names, grads)}
        out["cp_entering_states"] = entering
        out["cp_entering_state_gradients"] = lam
        out["arriving_state_gradient"] = arrive
        return out

    # -- adapter protocol
    def case_unsupported(self, case):
        return case_unsupported(case, self.ranks)

    def cases(self, check, suite):
        op = {"cp_forward": FORWARD_OP, "cp_backward": BACKWARD_OP}.get(check)
        for case in suite:
            if case.op == op and _ranks_of(case) == self.ranks:
                why = self.case_unsupported(case)
                self._work.append((check, str(case.path) if getattr(case, "path", None) else case.name, why))
                yield case.name, case, why
        name = _synthetic_of_name(self, check)
        self._work.append((check, name, None))
        yield name, None, None

    def run_check(self, check, case, device):
        return run_check(self, check, case, device)


class FlaCpAdapter(TorchCpAdapter):
    """FLA's chunk_kda in context-parallel mode (fla.ops.cp.build_cp_context), over NCCL with
    rank r on cuda:r. Its fragment pair and entering state are read where FLA computes them
    (the input of the all-gather in chunk_gated_delta_rule_fwd_h_pre_process, hm [HV, K,
    V + K]: state columns first, and the state it returns); in the backward, the state
    gradient that arrives at the rank's end (dht of chunk_gated_delta_rule_bwd_dhu_pre_process).
    FLA computes no pair on the last rank and leaves the transition unspecified where the
    fold does not read it (fragment_scope "used"); its entering-state gradient is not exposed."""

    requires_cuda = True
    policy = "chunk"
    policy_reason = "FLA chunk_kda: 4x the bf16 floor for outputs and stages, FLA's test thresholds for gradients"
    contract = ("Triton; chunks of 64 in UT form, bf16 tensor-core products with fp32 accumulation, fp32 fragments "
                "and states (fp32 on the wire), output rounded to bf16")
    contract_name = "fla_chunk"
    output_dtype = torch.bfloat16
    backend = "nccl"
    fragment_scope = "used"
    exposes_entering_gradient = False
    synthetic_even = True
    refuses_uneven = True
    # cp_uneven_tokens: T not divisible by P (FLA once dropped the trailing tokens there): every
    # token's output right, or a refusal (ValueError) on every rank; never a short output.
    checks = ("cp_forward", "cp_backward", "cp_uneven_tokens")
    MUTATIONS = (None,)

    def __init__(self, ranks=2, backend="nccl"):
        super().__init__(ranks, None, backend)
        self.name = f"fla.chunk_kda[cp,P={self.ranks}]"
        self.isolation_group = self.name

    def load(self):
        need_cuda()
        if torch.cuda.device_count() < self.ranks:
            raise RuntimeError(f"needs {self.ranks} CUDA devices (one per rank); this host has {torch.cuda.device_count()}")
        load_fla(self.path_of("fla_path"))
        import fla.ops.cp  # noqa: F401

    def version(self):
        return fla_version()

    def rank_device(self, rank):
        load_fla(self.path_of("fla_path"))  # a spawned rank imports fla itself
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)

    def case_unsupported(self, case):
        why = super().case_unsupported(case)
        if why:
            return why
        p = _kda_params(case)
        splits = [int(x) for x in (case.tensors["splits"] if "splits" in case.tensors else case.params["splits"])]
        T, P = p["T"], self.ranks
        if T % P or splits != [r * T // P for r in range(P + 1)]:
            return f"FLA's build_cp_context splits T evenly over the ranks; the case's splits are {splits}"
        if p["K"] > 256:
            return "FLA KDA supports K <= 256"
        if p.get("gate") == "softplus" and not p.get("A_log"):
            return "FLA's softplus gate needs A_log"
        if p.get("gate") == "decay_factor":
            return "FLA takes log decays"
        return None

    def _kwargs(self, ctx, local, params):
        from fla.ops.cp import build_cp_context

        return dict(fla_option_kwargs(local, params),
                    cp_context=build_cp_context(ctx.cu_tensor.to(ctx.device), group=torch.distributed.group.WORLD))

    @contextmanager
    def _capture(self, seen):
        import fla.ops.cp.chunk_delta_h as cdh
        import fla.ops.kda.chunk_bwd as kbwd
        import fla.ops.kda.chunk_fwd as kfwd

        saved = (cdh.all_gather_into_tensor, kfwd.chunk_gated_delta_rule_fwd_h_pre_process,
                 kbwd.chunk_gated_delta_rule_bwd_dhu_pre_process)

        def gather(inp, *a, **kw):
            seen.setdefault("gathered_inputs", []).append(inp.detach().clone())
            return saved[0](inp, *a, **kw)

        def fwd_pre(*a, **kw):
            h0 = saved[1](*a, **kw)
            seen["entering"] = None if h0 is None else h0[0].detach().clone()
            return h0

        def bwd_pre(*a, **kw):
            dht, h0 = saved[2](*a, **kw)
            seen["arriving"] = None if dht is None else dht[-1].detach().clone()
            return dht, h0

        cdh.all_gather_into_tensor, kfwd.chunk_gated_delta_rule_fwd_h_pre_process = gather, fwd_pre
        kbwd.chunk_gated_delta_rule_bwd_dhu_pre_process = bwd_pre
        try:
            yield
        finally:
            cdh.all_gather_into_tensor, kfwd.chunk_gated_delta_rule_fwd_h_pre_process = saved[0], saved[1]
            kbwd.chunk_gated_delta_rule_bwd_dhu_pre_process = saved[2]

    def _run_fla(self, ctx, local, params, seen, d_o=None, counter=None):
        from fla.ops.kda import chunk_kda

        dev = ctx.device
        leaves = {}
        for n in TOKEN_INPUTS:
            leaves[n] = local[n].to(dev).detach().clone().requires_grad_(d_o is not None)
        for n in ("A_log", "dt_bias"):
            if local.get(n) is not None:
                leaves[n] = local[n].to(dev).float().detach().clone().requires_grad_(d_o is not None)
        kw = self._kwargs(ctx, leaves, params)
        with self._capture(seen):
            if counter is not None:
                counter.phase = "forward"
            o = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], **kw)[0]
            if d_o is not None:
                counter.phase = "backward"
                o.backward(d_o.to(dev).to(o.dtype))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return o, leaves

    def forward_rank(self, ctx, local, params):
        seen = {}
        o, _ = self._run_fla(ctx, local, params, seen)
        V = o.shape[3]
        hm = seen["gathered_inputs"][0]  # [HV, K, V + K]: the state, then the transition
        return {"o": o.detach(), "fragment_state": hm[..., :V], "fragment_transition": hm[..., V:],
                "entering_state": seen.get("entering")}

    def backward_rank(self, ctx, local, params, d_o, counter):
        seen = {}
        o, leaves = self._run_fla(ctx, local, params, seen, d_o=d_o, counter=counter)
        out = {"d" + n: t.grad.detach() for n, t in leaves.items() if t.grad is not None}
        out["cp_entering_states"] = seen.get("entering")
        out["arriving_state_gradient"] = seen.get("arriving")
        return out


# --------------------------------------------------------------------------- cases

def _ranks_of(case):
    splits = case.tensors.get("splits") if case.tensors.get("splits") is not None else case.params.get("splits")
    return len(splits) - 1 if splits is not None else None


def _kda_params(case):
    return case.params  # one parameter object (docs/golden-format.md, "Schema")


def case_unsupported(case, P=None):
    """None, or why a golden case is not a context-parallel case this check can run."""
    p = _kda_params(case)
    if case.op == BACKWARD_OP:
        if "splits" not in case.tensors:
            return "not a context-parallel case (no splits)"
        if case.params.get("final_state_gradient", True):
            return "has a final-state gradient (context-parallel kernels take none)"
    if p.get("initial_state"):
        return "has an initial state (context-parallel kernels start documents from zero)"
    if p.get("state_layout", "k_first") != "k_first":
        return "V-first state (fragments are K-first)"
    if p.get("gate") == "decay_factor":
        return "decay_factor gate (the PyTorch prepare takes log decays)"
    if P is not None and _ranks_of(case) != P:
        return f"split over {_ranks_of(case)} ranks, not {P}"
    return None


def synthetic_name(P, even=False):
    return f"cp_p{P}_{'even' if even else 'uneven'}_t{synthetic_T(P, even)}"


def synthetic_T(P, even=False):
    return 14 * P if even else 14 * P - 1  # uneven: T mod P = P - 1, never divisible by P


def synthetic_case(P, backward=False, even=False):
    """The case each adapter adds for its P: T = 14 P - 1 tokens (not a multiple of P; with
    even=True T = 14 P, for kernels that split T evenly only, as FLA does) split evenly (the
    first T mod P ranks one token longer), H = 2 key heads and HV = 4 value heads (GVA), FLA's
    gate configuration (softplus gate with A_log and dt_bias, sigmoid beta, L2 norm) with mild
    decays (A_log in [-3, -1], raw gate in [-4, 1]: a slice's transition stays far from 0, so
    what is carried across ranks matters), and documents: a short one inside rank 0, one from
    rank 0 into rank 1 (one boundary), one from the middle of rank 1 into the last rank
    (P - 2 boundaries; for P >= 4 ranks 2 .. P - 2 hold only its middle) and a short last one.
    Reference: k3ref.kcp_forward / kcp_backward at 256 bits on the same inputs."""
    import k3ref

    T = synthetic_T(P, even)
    splits = even_splits(T, P)
    a = max(1, splits[1] // 3)
    b = splits[1] + max(1, (splits[2] - splits[1]) // 2)
    c = T - max(1, (T - splits[P - 1]) // 3)
    cu = sorted({0, a, b, c, T})
    H, HV, K, V = 2, 4, 16, 16
    gen = torch.Generator().manual_seed(1900 + P + (1000 if backward else 0) + (100 if even else 0))

    def u(shape, lo, hi):
        return (torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(torch.bfloat16)

    inputs = {"q": u((1, T, H, K), -1, 1), "k": u((1, T, H, K), -1, 1), "v": u((1, T, HV, V), -1, 1),
              "g": u((1, T, HV, K), -4, 1), "beta": u((1, T, HV), -4, 4),
              "A_log": u((HV,), -3, -1).float(), "dt_bias": u((HV, K), -1, 1).float(),
              "cu_seqlens": torch.tensor(cu, dtype=torch.int64)}
    params = dict(B=1, T=T, H=H, HV=HV, K=K, V=V, cu_seqlens=cu, splits=splits, gate="softplus", gate_base="e",
                  lower_bound=None, A_log=True, dt_bias=True, beta="sigmoid", qk_l2norm=True, scale=None,
                  state_layout="k_first", initial_state=False)
    opts = dict(gate="softplus", beta="sigmoid", l2norm=True, precision="mp256")
    refin = {n: t for n, t in inputs.items()}
    if backward:
        inputs["d_o"] = u((1, T, HV, V), -1, 1)
        ref = k3ref.kcp_backward(refin, {"d_o": inputs["d_o"]}, splits, **opts)
        op, expected = BACKWARD_OP, {n: ref[n] for n in GRADIENTS + PARAMETER_GRADIENTS + (
            "cp_entering_states", "cp_entering_state_gradients")}
    else:
        ref = k3ref.kcp_forward(refin, splits, **opts)
        op, expected = FORWARD_OP, {n: ref[n] for n in FORWARD_TENSORS}
    tensors = dict(inputs, splits=torch.tensor(splits, dtype=torch.int64), **expected)
    return SyntheticCase(synthetic_name(P, even), op, params, inputs, expected, tensors,
                         "k3ref.kcp_backward at mp256" if backward else "k3ref.kcp_forward at mp256")


@dataclass
class SyntheticCase:
    name: str
    op: str
    params: dict
    inputs: dict
    expected: dict
    tensors: dict
    reference: str
    path: str = None


# --------------------------------------------------------------------------- ranks

@dataclass
class RankContext:
    rank: int
    world: int
    T: int
    cu: list
    splits: list
    ranks: list
    device: object
    cu_tensor: object = None

    @property
    def slice(self):
        return self.ranks[self.rank]


def _work_item(check, case):
    """What every rank needs of one (check, case): the inputs, params, splits, cu_seqlens."""
    p = _kda_params(case)
    splits = [int(x) for x in (case.tensors["splits"] if "splits" in case.tensors else case.params["splits"])]
    cu = [int(x) for x in (case.tensors["cu_seqlens"] if "cu_seqlens" in case.tensors else [0, p["T"]])]
    inputs = {n: case.tensors[n] for n in INPUTS if case.tensors.get(n) is not None}
    item = {"check": check, "case": case.name, "params": p, "splits": splits, "cu": cu, "inputs": inputs}
    if check == "cp_backward":
        item["d_o"] = case.tensors["d_o"]
    return item


def _rank_main(rank, adapter, items, world, backend, port, outdir):
    """One rank: joins the process group, runs every item, writes its results."""
    import torch.distributed as dist

    results = []
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        device = adapter.rank_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        for item in items:
            ranks = plan_split(item["cu"], item["splits"])
            ctx = RankContext(rank, world, item["cu"][-1], item["cu"], item["splits"], ranks, device,
                              torch.tensor(item["cu"], dtype=torch.int64))
            s = ranks[rank]
            local = {n: (t[:, s.begin:s.end].contiguous() if n in TOKEN_INPUTS else t) for n, t in item["inputs"].items()}
            counter = WireCounter()
            t0 = time.perf_counter()
            refused = None
            with counter.active():
                try:
                    if item["check"] != "cp_backward":
                        counter.phase = "forward"
                        out = adapter.forward_rank(ctx, local, item["params"])
                    else:
                        out = adapter.backward_rank(ctx, local, item["params"], item["d_o"][:, s.begin:s.end], counter)
                except ValueError as e:  # a refusal of the input (judged: only where the adapter may refuse)
                    if not adapter.refuses_uneven:
                        raise
                    out, refused = {}, f"{type(e).__name__}: {e}".splitlines()[0][:300]
            seconds = time.perf_counter() - t0
            out = {n: (t.detach().to("cpu") if isinstance(t, torch.Tensor) else t) for n, t in out.items()}
            results.append({"check": item["check"], "case": item["case"], "tensors": out, "wire": counter.calls,
                            "seconds": seconds, "refused": refused})
            dist.barrier()
        dist.destroy_process_group()
    except Exception as e:
        results.append({"error": f"rank {rank}: {type(e).__name__}: {e}".splitlines()[0][:300],
                        "traceback": traceback.format_exc()[-2000:]})
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        raise
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(adapter, items, timeout=None):
    """Runs `items` on adapter.ranks processes; returns ({(check, case): [per-rank result]}, error or None)."""
    import torch.multiprocessing as mp

    P = adapter.ranks
    opts = adapter.run_options
    timeout = float(opts.setting("cp.timeout", LAUNCH_TIMEOUT_S)) if timeout is None else timeout
    with tempfile.TemporaryDirectory(prefix="k3ref_cp_") as outdir:
        # fork is cheap and keeps the parent's modules; CUDA needs spawn. The cp.start_method setting overrides.
        method = opts.setting("cp.start_method") or ("spawn" if adapter.backend == "nccl" else "fork")
        error = None
        t0 = time.perf_counter()
        try:
            ctx = mp.start_processes(_rank_main, args=(adapter, items, P, adapter.backend, _free_port(), outdir),
                                     nprocs=P, join=False, start_method=method)
            while not ctx.join(timeout=1.0):
                if time.perf_counter() - t0 > timeout:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    error = f"the {P} ranks did not finish within {timeout:g} s (killed)"
                    break
        except Exception as e:  # a rank raised (torch reports the first one) or died
            error = f"{type(e).__name__}: {e}".strip().splitlines()
            error = next((l for l in reversed(error) if l.strip()), "a rank failed")[:300]
        per_rank = []
        for r in range(P):
            path = os.path.join(outdir, f"rank{r}.pt")
            per_rank.append(torch.load(path) if os.path.exists(path) else [])
    for r, res in enumerate(per_rank):
        for x in res:
            if "error" in x:
                error = x["error"]
    out = {}
    for r, res in enumerate(per_rank):
        for x in res:
            if "error" not in x:
                out.setdefault((x["check"], x["case"]), [None] * P)[r] = x
    return out, error, time.perf_counter() - t0


# --------------------------------------------------------------------------- verdicts

def _judge(expected, candidate, op, policy):
    from .. import policy as pol

    return pol.judge(expected, candidate, op, policy, tensors=list(expected))


def _line(name, r):
    if r.status in ("pass", "fail") and r.metric:
        ratio = f" ({r.ratio:.3g}x floor)" if r.floor > 0 else ""
        return f"{name} {r.rel_rms:.2e}{ratio}{'' if r.passed else ' FAIL'}"
    return f"{name} {r.status}: {r.reason}"


def judge_ranks(adapter, check, case, per_rank):
    """(status, reason, rank rows, wire summary) of one (check, case) from every rank's result."""
    P = adapter.ranks
    op = BACKWARD_OP if check == "cp_backward" else FORWARD_OP
    p = _kda_params(case)
    refusals = [x.get("refused") for x in per_rank]
    if any(refusals):
        r = next(r for r, x in enumerate(refusals) if x)
        if check == "cp_uneven_tokens" and all(refusals) and p["T"] % P:
            return "pass", (f"T = {p['T']} not divisible by P = {P}: refused on every rank ({refusals[0]}); no "
                            f"rank returned a short output"), [{"rank": r, "refused": x} for r, x in
                                                                enumerate(refusals)], []
        return "fail", f"rank {r} refused the case: {refusals[r]}", [], []
    splits = [int(x) for x in (case.tensors["splits"] if "splits" in case.tensors else case.params["splits"])]
    cu = [int(x) for x in case.tensors["cu_seqlens"]]
    plan = plan_split(cu, splits)
    HV, K, V = p["HV"], p["K"], p["V"]
    E = case.expected
    rows, failures = [], []
    for r in range(P):
        s = plan[r]
        got = per_rank[r]["tensors"]
        row = {"rank": r, "tokens": [s.begin, s.end], "origin_rank": s.origin_rank, "continues": s.continues,
               "carries": s.carries, "seconds": per_rank[r]["seconds"], "tensors": {}}
        expected, why_not = {}, {}
        if check != "cp_backward":
            expected["o"] = E["o"][:, s.begin:s.end]
            for n in ("fragment_transition", "fragment_state", "entering_state"):
                expected[n] = E[n][r]
            if adapter.fragment_scope == "used":
                if not s.carries:
                    why_not["fragment_transition"] = why_not["fragment_state"] = (
                        "not computed (the rank's last document ends on it: no later rank reads its pair)")
                elif not (s.continues and s.first_doc == s.last_doc):
                    why_not["fragment_transition"] = "not read by the fold (the last document starts on this rank)"
        else:
            for n in GRADIENTS:
                expected[n] = E[n][:, s.begin:s.end]
            expected["cp_entering_states"] = E["cp_entering_states"][r]
            expected["cp_entering_state_gradients"] = E["cp_entering_state_gradients"][r]
            if not adapter.exposes_entering_gradient:
                why_not["cp_entering_state_gradients"] = "not exposed by the kernel"
        for n, why in why_not.items():
            expected.pop(n, None)
            row["tensors"][n] = {"status": "not judged", "reason": why}
        candidate = {}
        for n in list(expected):
            t = got.get(n)
            if t is None:
                failures.append(f"rank {r}: {n}: not returned")
                row["tensors"][n] = {"status": "fail", "reason": "not returned"}
                expected.pop(n)
            elif list(t.shape) != list(expected[n].shape):
                failures.append(f"rank {r}: {n}: shape {list(t.shape)}, its slice has {list(expected[n].shape)}")
                row["tensors"][n] = {"status": "fail", "reason": f"shape {list(t.shape)} != {list(expected[n].shape)}"}
                expected.pop(n)
            else:
                candidate[n] = t
        lines = []
        if expected:
            v = _judge(expected, candidate, op, adapter.policy)
            if v.exit_code == 2:
                raise ValueError(f"rank {r}: {v.reason}")
            for res in v.results:
                row["tensors"][res.tensor] = res.to_dict()
                lines.append(_line(res.tensor, res))
                if not res.passed:
                    failures.append(f"rank {r}: {res.tensor}: {res.reason}")
        if check != "cp_backward" and adapter.contract_name and "o" in candidate:
            from . import contracts

            local = {n: (case.tensors[n][:, s.begin:s.end] if n in TOKEN_INPUTS else case.tensors[n])
                     for n in INPUTS if case.tensors.get(n) is not None}
            local["cu_seqlens"] = torch.tensor(s.local_cu, dtype=torch.int64)
            h0 = torch.zeros(len(s.local_cu) - 1, HV, K, V, dtype=torch.float32)
            h0[0] = E["entering_state"][r].float()
            local["initial_state"] = h0
            res = contracts.judge(adapter.contract_name, local, p, {"o": candidate["o"]}, {"o": expected["o"]},
                                  op=op).results[0]
            row["tensors"]["o"] = res.to_dict()
            lines.append(f"o under contract {res.contract}: {res.reason}")
            failures = [f for f in failures if not f.startswith(f"rank {r}: o:")]
            if not res.passed:
                failures.append(f"rank {r}: o: {res.reason}")
        if check == "cp_backward":
            want = E["cp_entering_state_gradients"][r + 1] if s.carries and r + 1 < P else torch.zeros(HV, K, V,
                                                                                                        dtype=torch.float64)
            t = got.get("arriving_state_gradient")
            if t is None or list(t.shape) != list(want.shape):
                failures.append(f"rank {r}: arriving state gradient: {'not returned' if t is None else list(t.shape)}")
            else:
                v = _judge({"cp_entering_state_gradients": want}, {"cp_entering_state_gradients": t}, op, adapter.policy)
                res = v.results[0]
                row["tensors"]["arriving_state_gradient"] = res.to_dict()
                lines.append(_line("arriving_state_gradient", res))
                if not res.passed:
                    failures.append(f"rank {r}: arriving state gradient: {res.reason}")
        row["wire"] = _wire_rank(per_rank[r]["wire"], P, HV, K, V)
        for phase, w in row["wire"].items():
            if not w["matches_formula"]:
                failures.append(f"rank {r}: {phase} wire: {w['reason']}")
        row["line"] = f"rank {r} [{s.begin}, {s.end}): " + "; ".join(lines)
        rows.append(row)
    extra_lines = []
    if check == "cp_backward":
        for n in PARAMETER_GRADIENTS:
            if n not in E:
                continue
            parts = [per_rank[r]["tensors"].get(n) for r in range(P)]
            if any(t is None for t in parts):
                failures.append(f"{n}: not returned by every rank")
                continue
            v = _judge({n: E[n]}, {n: sum(t.double() for t in parts)}, op, adapter.policy)
            res = v.results[0]
            extra_lines.append(_line(n + " (sum over ranks)", res))
            rows.append({"rank": "sum", "tensors": {n: res.to_dict()}})
            if not res.passed:
                failures.append(f"{n} (sum over ranks): {res.reason}")
    wire = {ph: rows[0]["wire"][ph] for ph in rows[0]["wire"]}
    phases = ", ".join(f"{ph} {w['gathered_bytes']} B gathered per rank = {w['formula_elements']} elements x "
                       f"{w['element_bytes']} B" for ph, w in wire.items() if w["matches_formula"])
    status = "fail" if failures else "pass"
    head = (f"{len(failures)} failure(s), first: {failures[0]}" if failures else
            f"{P} ranks: every rank within policy '{adapter.policy}'" + (
                f" (o under contract {adapter.contract_name})" if adapter.contract_name and check != "cp_backward" else ""))
    reason = f"{head}; wire: {phases or 'see ranks'}"
    return status, reason, rows, failures + extra_lines


def _wire_rank(calls, P, HV, K, V):
    """Per phase: what the rank sent, received and gathered, against the formula."""
    out = {}
    elements = formula_elements(P, HV, K, V)
    for phase in sorted({c["phase"] for c in calls}):
        cs = [c for c in calls if c["phase"] == phase]
        gathered = sum(c["gathered"] for c in cs)
        sent = sum(c["sent"] for c in cs)
        received = sum(c["received"] for c in cs)
        ops = [f"{c['op']}({c['dtype']})" for c in cs]
        size = cs[0]["itemsize"] if cs else 0
        ok = len(cs) == 1 and gathered == elements * size and sent == elements // P * size and \
            received == (P - 1) * elements // P * size
        why = "" if ok else (f"{len(cs)} call(s) {', '.join(ops)}: sent {sent} B, received {received} B, gathered "
                             f"{gathered} B; the formula gives one all-gather of P x HV x K x (K + V) = {elements} "
                             f"elements ({elements * size} B at {size} B each)")
        out[phase] = {"calls": len(cs), "ops": ops, "sent_bytes": sent, "received_bytes": received,
                      "gathered_bytes": gathered, "formula_elements": elements, "element_bytes": size,
                      "matches_formula": ok, "reason": why}
    if not out:
        out["forward"] = {"calls": 0, "ops": [], "sent_bytes": 0, "received_bytes": 0, "gathered_bytes": 0,
                          "formula_elements": elements, "element_bytes": 0, "matches_formula": False,
                          "reason": "no collective was called"}
    return out


def _synthetic_of(adapter, check):
    """The adapter's own case of a check (T divisible by P or not: synthetic_case)."""
    even = adapter.synthetic_even and check != "cp_uneven_tokens"
    return synthetic_case(adapter.ranks, backward=check == "cp_backward", even=even)


def _synthetic_of_name(adapter, check):
    return synthetic_name(adapter.ranks, adapter.synthetic_even and check != "cp_uneven_tokens")


def run_check(adapter, check, case, device):
    """One (check, case) of a CP adapter; the first call launches the ranks for all of the
    adapter's collected work at once and keeps the results."""
    if check not in adapter.checks:
        return CheckResult(adapter.name, check, getattr(case, "name", "-"), "error", f"unknown check {check}")
    t0 = time.time()
    name = case.name if case is not None else _synthetic_of_name(adapter, check)
    cache = adapter.__dict__.setdefault("_results", {})
    if (check, name) not in cache:
        from .. import goldens

        work = [(c, w) for c, w, why in (adapter._work or []) if why is None]
        cases = {}
        for c, w in work:
            if str(w).endswith(".safetensors"):
                cc = goldens.load_case(w)
            elif case is not None and w == case.name:
                cc = case
            else:
                cc = _synthetic_of(adapter, c)
            cases[(c, cc.name)] = cc
        if (check, name) not in cases:
            cases[(check, name)] = case if case is not None else _synthetic_of(adapter, check)
        items = [_work_item(c, cc) for (c, _), cc in cases.items()]
        results, error, seconds = launch(adapter, items)
        for key, cc in cases.items():
            cache[key] = (cc, results.get(key), error, seconds)
    cc, per_rank, error, seconds = cache[(check, name)]
    if per_rank is None or any(x is None for x in per_rank):
        return CheckResult(adapter.name, check, name, "error", error or "a rank returned no result",
                           seconds=time.time() - t0)
    try:
        status, reason, rows, lines = judge_ranks(adapter, check, cc, per_rank)
    except Exception as e:
        return CheckResult(adapter.name, check, name, "error", f"{type(e).__name__}: {e}".splitlines()[0][:300],
                           extra={"traceback": traceback.format_exc()[-2000:]})
    res = CheckResult(adapter.name, check, name, status, reason, seconds=max(x["seconds"] for x in per_rank))
    res.extra.update(policy=adapter.policy, ranks=rows, lines=lines, launch_seconds=seconds,
                     reference=getattr(cc, "reference", "golden " + name), backend=adapter.backend)
    return res


# --------------------------------------------------------------------------- entry points

def ranks_of(text):
    """The rank counts of "2,4,8"; a ValueError (one line) for anything else."""
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"cp.ranks={text!r}: expected comma-separated rank counts, e.g. 2,4,8") from None
    if not ranks or any(p < 2 for p in ranks):
        raise ValueError(f"cp.ranks={text!r}: every rank count must be at least 2")
    return ranks


def default_backend(kernel):
    """gloo for the PyTorch kernel (CPU processes), nccl for FLA's (rank r on cuda:r)."""
    return "gloo" if kernel == "torch" else "nccl"


def cp_adapters(run_options):
    """The CP adapters of the run's settings: cp.kernel (torch: the PyTorch kernel and its
    mutants; fla: FLA's chunk_kda) for each P of cp.ranks (default 2,4,8) over cp.backend
    (default gloo for torch, nccl for fla)."""
    kernel = run_options.setting("cp.kernel", "torch")
    backend = run_options.setting("cp.backend", default_backend(kernel))
    if kernel not in ("torch", "fla") or backend not in ("gloo", "nccl"):
        raise ValueError(f"cp.kernel={kernel!r} / cp.backend={backend!r}: expected torch|fla and gloo|nccl")
    out = []
    for P in ranks_of(run_options.setting("cp.ranks", "2,4,8")):
        if kernel == "fla":
            out.append(FlaCpAdapter(P, backend))
        else:
            # The fold applies an adjoint transition only on a rank holding just the middle of a
            # document; the own case has one from P = 4 (below, the mutant equals the kernel).
            out += [TorchCpAdapter(P, m, backend) for m in TorchCpAdapter.MUTATIONS
                    if m != "untransposed" or P >= 4]
    return out


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(prog="python3 -m k3ref.gpu_check.cp_check", description=__doc__.split("\n\n")[0],
                                 epilog="Other options are passed to `python3 -m k3ref.gpu_check run`.")
    ap.add_argument("--ranks", default="2,4,8", help="comma-separated rank counts P (default 2,4,8)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), help="gloo (CPU processes) or nccl (rank r on cuda:r); "
                    "default gloo for --kernel torch, nccl for fla")
    ap.add_argument("--kernel", choices=("torch", "fla"), default="torch",
                    help="torch: the PyTorch CP kernel and its mutants; fla: FLA's chunk_kda in cp mode")
    ap.add_argument("--timeout", type=float, help="seconds one launch of P ranks (every case of one adapter) may "
                    "take (default 300 on gloo, 3000 on nccl: Triton compiles and autotunes each new shape)")
    args, rest = ap.parse_known_args(argv)
    backend = args.backend or default_backend(args.kernel)
    timeout = args.timeout if args.timeout is not None else (LAUNCH_TIMEOUT_S if backend == "gloo" else 3000.0)
    try:
        ranks_of(args.ranks)
    except ValueError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    run = ["run", "--no-builtin", "--adapter", "k3ref.gpu_check.cp_check:cp_adapters", "--no-warmup"]
    for name, value in (("ranks", args.ranks), ("kernel", args.kernel), ("backend", backend), ("timeout", timeout)):
        run += ["--set", f"cp.{name}={value}"]
    if "--device" not in rest:
        run += ["--device", "cuda" if backend == "nccl" else "cpu"]
    if "--check-timeout" not in rest:  # the first check of an adapter launches all of its work
        run += ["--check-timeout", str(timeout + 60)]
    # The front end in a process of its own (the checks never import a front end).
    return subprocess.call([sys.executable, "-m", "k3ref.gpu_check"] + run + rest)


if __name__ == "__main__":
    sys.exit(main())
