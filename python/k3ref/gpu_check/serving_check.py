"""Checks of the KDA serving paths (docs/serving.md) on real kernels, through the adapter
protocol of adapters.py.

A serving kernel is wrapped by an adapter of family "serving" that implements some of:

  decode(inputs, params, pool, slot_of_sequence)                       -> o
  verify(inputs, params, pool, state_indices, num_accepted, in_place)  -> (o, token_states or None)
  prefill(inputs, params, initial_state)                               -> (o, final_state)
  intermediate_states(inputs, params, chunk)                           -> h [NT, HV, K, V] (or V-first)
  varlen(inputs, params)                                               -> (o, final_state [N, ...])
  replay(raw, params, pool, d_cache, k_cache, g_cache, state_indices, write_pos) -> o [N, HV, V]

with the semantics of the k3ref references (include/k3ref/serving/): `pool` is a tensor
[slots, HV, K, V] (or [slots, HV, V, K] when params['state_layout'] is 'v_first') that may be
a strided view into a larger buffer (any slot stride, any start); decode writes each
sequence's final state into its slot, verify enters from column num_accepted - 1 of the
sequence's row of state_indices and stores the state after token t into column t (in place)
or row bos + t of token_states; -1 names no slot (padding); h[c] is the state after c * chunk
tokens; replay is the cached-replay decode (docs/serving.md) on GDN's packed inputs. GDN's pool
goldens arrive in KDA's form (gdn_as_kda: the gate broadcast over K; scalar_gate takes it back).
The adapters here: FLA fused_recurrent_kda in continuous-batching and spec-decode modes, FLA
chunk_kda with return_intermediate_states, FlashKDA's varlen forward (empty sequences), and a
pure-PyTorch kernel for the CPU with the mutations the checks must catch; the serving engines'
own kernels are in engine_vllm.py, engine_sglang.py and engine_tokenspeed.py, and their table
is `python3 -m k3ref.gpu_check.serving_check --engines` (main). Bounds are the rules of each
adapter's policy in policy/policies.json (PolicyBound), domains its entry of
policy/kernel_domains.json (BuiltinDomain).

Checks (each returns checks.CheckResult):
  golden               serving.decode / serving.verify / gdn.decode / gdn.verify goldens: o, the
                       named slots (or token_states) within the kernel's bound; every other pool
                       element (other slots, padding between and before slots) bitwise
                       unchanged; gdn.replay_decode goldens: o, the served checkpoints and cache
                       entries up to the write positions, every other element unchanged; for a
                       varlen kernel that declares them (a chunked prefill), the kda.recurrent /
                       kda.chunkwise_* goldens of one packed or single sequence: o and the final
                       states within the bounds its policy gives the golden's operator, the
                       states handed over in the layout of its varlen call (varlen_params)
  slot_isolation       the same goldens with NaN in every slot the call does not read and in the
                       padding: no NaN reaches an output or a written slot, the NaNs keep their bits
  layout_equivalence   the same states in a K-first and a V-first pool (K != V): both agree with
                       the fp64 reference
  decode_after_prefill one sequence prefilled up to a split, then decoded token by token
                       through the pool, equals the fp64 single shot within the bound and, for
                       a kernel that carries its state in its own precision (split_bitwise),
                       its own single shot bit for bit; a chunked prefill (ChunkPrefill) is
                       continued by its engine's decode kernel (decode_partner)
  intermediate_states  serving.checkpoints goldens: h[c] equals the checkpoint at c * chunk and
                       is farther from the checkpoints one token early and late than the bound
  accepted_zero        verify with an accepted count 0 (which names no entering state): the
                       kernel must reject it, or at least not read a slot outside the
                       sequence's row (all other slots hold NaN)
  empty_sequences      a varlen batch with empty sequences (in the middle, two in a row, last):
                       an empty sequence's final state is its initial state, bit for bit; the
                       others within the bound of the fp64 reference
  determinism          every mode's call twice on the same inputs: a pool golden on fresh pools
                       (o and the pool), a replay golden on fresh pools and caches (o, the pool,
                       the d, k, g caches), the varlen call on a varlen batch of 70, 3 and 130
                       tokens (o and the final states), each bit for bit the same
"""
import math
import sys
import time
from pathlib import Path

import torch

from .. import goldens as golden_io, policy
from . import references, torch_model
from .problems import TOKEN_INPUTS
from .protocol import Adapter, CheckResult, bits, outside_domain, source_identity
from .upstream import bare_packages, fla_option_kwargs, fla_version, load_fla, module_version, need_cuda

PAD = -1
POOL_OPS = ("serving.decode", "serving.verify")
# GDN's pool goldens (docs/gdn.md): packed mixed_qkv, GDN's gating; run in KDA's form (gdn_as_kda).
GDN_POOL_OPS = ("gdn.decode", "gdn.verify")
REPLAY_OPS = ("gdn.replay_decode",)
CHECKPOINT_OPS = ("serving.checkpoints",)
# The KDA goldens of the golden suite a varlen kernel (a chunked prefill) runs: o and final_state.
VARLEN_OPS = ("kda.recurrent", "kda.chunkwise_fla", "kda.chunkwise_flashkda")
# The determinism check's varlen batch: chunks of 64 filled, partial, and one short sequence.
DETERMINISM_LENGTHS = (70, 3, 130)
DECODE_OPS = ("serving.decode", "gdn.decode")
SERVING_CHECKS = ("golden", "slot_isolation", "layout_equivalence", "decode_after_prefill", "intermediate_states",
                  "accepted_zero", "empty_sequences", "determinism")


# --------------------------------------------------------------------------- pools

def pool_view(flat, geometry, HV, K, V):
    """The [slots, HV, K, V] (or V-first) view of a flat buffer with geometry (slots, slot stride,
    offset, v_first), as an engine holds a pool: heads contiguous inside a slot."""
    slots, stride, offset, v_first = (int(x) for x in geometry)
    inner = (V, K) if v_first else (K, V)
    return flat.as_strided((slots, HV) + inner, (stride, K * V, inner[1], 1), offset)


def slot_spans(geometry, HV, K, V):
    slots, stride, offset, _ = (int(x) for x in geometry)
    return [(offset + s * stride, offset + s * stride + HV * K * V) for s in range(slots)]


def named_slots(case):
    """The slots the reference writes in a pool golden."""
    t, p = case.tensors, case.params
    cu = [int(x) for x in t["cu_seqlens"].tolist()]
    out = set()
    if case.op in DECODE_OPS:
        for n, s in enumerate(int(x) for x in t["slot_of_sequence"].tolist()):
            if s != PAD and cu[n + 1] > cu[n]:
                out.add(s)
    elif (p.get("writes") or "in_place") == "in_place":
        idx, acc = t["state_indices"].tolist(), t["num_accepted"].tolist()
        for n in range(len(cu) - 1):
            if cu[n + 1] > cu[n] and idx[n][acc[n] - 1] != PAD:
                out |= {s for s in idx[n][: cu[n + 1] - cu[n]] if s != PAD}
    return out


def read_slots(case):
    """The slots the reference reads (entering states) in a pool golden."""
    t = case.tensors
    cu = [int(x) for x in t["cu_seqlens"].tolist()]
    if case.op in DECODE_OPS:
        return {s for n, s in enumerate(int(x) for x in t["slot_of_sequence"].tolist()) if s != PAD and cu[n + 1] > cu[n]}
    idx, acc = t["state_indices"].tolist(), t["num_accepted"].tolist()
    return {idx[n][acc[n] - 1] for n in range(len(cu) - 1) if cu[n + 1] > cu[n] and idx[n][acc[n] - 1] != PAD}


def padded_tokens(case):
    """The tokens of the sequences a pool golden pads (slot, or entering column, -1)."""
    t = case.tensors
    cu = [int(x) for x in t["cu_seqlens"].tolist()]
    if case.op in DECODE_OPS:
        pads = [int(s) == PAD for s in t["slot_of_sequence"].tolist()]
    else:
        idx, acc = t["state_indices"].tolist(), t["num_accepted"].tolist()
        pads = [1 <= acc[n] <= len(idx[n]) and idx[n][acc[n] - 1] == PAD for n in range(len(cu) - 1)]
    return [i for n, pad in enumerate(pads) if pad for i in range(cu[n], cu[n + 1])]


def gdn_as_kda(t, H, K):
    """A GDN golden's packed inputs in KDA's form (docs/gdn.md): q, k, v cut from mixed_qkv
    [..., 2HK + HV V], the raw gate a [..., HV] and dt_bias [HV] broadcast over K (GDN is KDA
    with one gate per head), b as beta's logits. Token tensors keep a batch axis of 1."""
    mixed = t["mixed_qkv"]
    if mixed.dim() == 2:  # the replay decode's rows: one token each
        mixed, a, b = mixed[None], t["a"][None], t["b"][None]
    else:
        a, b = t["a"], t["b"]
    B, T, HV = a.shape
    V = (mixed.shape[-1] - 2 * H * K) // HV
    out = dict(q=mixed[..., : H * K].reshape(B, T, H, K), k=mixed[..., H * K : 2 * H * K].reshape(B, T, H, K),
               v=mixed[..., 2 * H * K :].reshape(B, T, HV, V), g=a[..., None].expand(B, T, HV, K).contiguous(),
               beta=b.contiguous())
    if "A_log" in t:
        out["A_log"] = t["A_log"]
    if "dt_bias" in t:
        out["dt_bias"] = t["dt_bias"].reshape(HV, 1).expand(HV, K).contiguous()
    if "cu_seqlens" in t:
        out["cu_seqlens"] = t["cu_seqlens"]
    return out


def scalar_gate(inputs, what="a GDN kernel"):
    """(g or the raw gate [..., HV], dt_bias [HV] or None) of KDA-form inputs whose gate is one
    value per head; ValueError when it varies over K (a KDA case, outside a GDN kernel)."""
    g, bias = inputs["g"], inputs.get("dt_bias")
    if not bool((g == g[..., :1]).all()) or (bias is not None and not bool((bias == bias[..., :1]).all())):
        raise ValueError(f"the gate varies over K: {what} takes one gate per head")
    return g[..., 0].contiguous(), (bias[..., 0].contiguous() if bias is not None else None)


def kda_inputs(t, device, op="serving.decode", params=None):
    if op.startswith("gdn."):
        t = gdn_as_kda(t, int(params["H"]), int(params["K"]))
    names = TOKEN_INPUTS + ("A_log", "dt_bias", "cu_seqlens")
    return {n: t[n].to(device) for n in names if n in t}


# --------------------------------------------------------------------------- judging

class Bound:
    """A serving kernel's bound on one tensor: the rule of `tensor` of operator `op` under a
    policy of the table (policy/policies.json), with a floor never below at_least / multiple (a
    bound never below `at_least`: the fp64 kernels' noise), applied by the one judge
    (k3ref.policy.judge, check:: in C++). A policy without that rule raises KeyError (one line)."""

    def __init__(self, policy_name, op, tensor, at_least=1e-12):
        rule = policy.load_table().rules(policy_name, op)[tensor]
        if rule.metric not in ("floor", "rel-rms"):
            raise ValueError(f"policy {policy_name}: {op}.{tensor} is judged by '{rule.metric}'; the serving checks "
                             "take floor and rel-rms rules")
        self.policy, self.op, self.tensor, self.at_least = policy_name, op, tensor, at_least
        self.metric, self.multiple, self.dtype, self.rel_rms_bound = rule.metric, rule.multiple, rule.floor_dtype, rule.bound

    def judge(self, got, ref):
        """(rel RMS, bound, passed) of `got` against `ref`: a non-finite value where the
        reference is finite fails."""
        at_least = {self.tensor: self.at_least / self.multiple} if self.metric == "floor" else None
        r = policy.judge({self.tensor: ref}, {self.tensor: got}, self.op, self.policy, tensors=[self.tensor],
                         floor_at_least=at_least)[self.tensor]
        return r.rel_rms, r.bound, r.passed

    def describe(self):
        """The bound as a table prints it: "2 x bf16 floor", "rel RMS 1e-12"."""
        return f"{self.multiple:g} x {self.dtype} floor" if self.metric == "floor" else f"rel RMS {self.rel_rms_bound:g}"


class PolicyBound:
    """A serving bound read from the kernel's policy (policy/policies.json) when first used, so
    that constructing an adapter never loads the table."""

    def __init__(self, op, tensor, at_least=1e-12):
        self.op, self.tensor, self.at_least = op, tensor, at_least

    def __get__(self, obj, owner):
        return Bound((owner if obj is None else obj).policy, self.op, self.tensor, self.at_least)


class BuiltinDomain:
    """An adapter's domain from policy/kernel_domains.json under its name, read when first used."""

    def __get__(self, obj, owner):
        if obj is None:
            return self
        from .. import kernel_domains_file

        return kernel_domains_file.builtin(obj.name)


def import_engine_module(full, root, needs, option, packages=(), shims=None):
    """Module `full` (dotted) of an engine tree under `root` (None: the installed engine),
    importing none of its packages' __init__ files (they import the whole engine): the packages
    on the way (and `packages`, dotted) are made empty, with their folders as paths, and
    `shims()` then registers the engine modules the kernel imports from the rest of the engine.
    One-line errors naming what is needed; a second copy of the engine already imported is refused."""
    import importlib

    parts = full.split(".")
    if root is not None:
        top = sys.modules.get(parts[0])
        if top is not None and getattr(top, "__path__", None) and \
                Path(list(top.__path__)[0]).resolve() != (Path(root) / parts[0]).resolve():
            raise RuntimeError(f"another {parts[0]} is already imported ({list(top.__path__)[0]}): give one {option}")
        bare_packages(root, [".".join(parts[:i]) for i in range(1, len(parts))] + list(packages))
        if shims is not None:
            shims()
    try:
        return importlib.import_module(full)
    except Exception as e:
        raise RuntimeError(f"importing {full} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                           f"(needs {needs})") from e


def engine_version(engine, mod):
    """Which engine source a kernel module is: the commit its tree's COMMITS.txt gives the file
    (`<path> <commit>` lines, a path naming the file or a folder above it; a tree laid out from
    single files at pinned commits), and protocol.source_identity of its folder."""
    where = Path(mod.__file__).resolve()
    listed = ""
    for d in where.parents:
        f = d / "COMMITS.txt"
        if f.is_file():
            rel = where.relative_to(d).as_posix()
            hits = [line.split() for line in f.read_text().splitlines() if len(line.split()) >= 2 and
                    (rel == line.split()[0] or rel.startswith(line.split()[0].rstrip("/") + "/"))]
            listed = f"{rel}@{hits[0][1][:12]}" if hits else f"{rel} (not listed in {f})"
            break
    return f"{engine} {listed or where.name} from {where.parent}, {source_identity(mod)}"


def _finite(x):
    return bool(torch.isfinite(x.double()).all())


def _judge_tensors(pairs, check, problems, metrics=None):
    """Each (label, got, golden, Bound) by the one judge: its rel RMS into metrics, a shape
    mismatch, a non-finite value or a figure over the bound into problems; returns the worst
    figure / bound. Every serving check judges its tensors here."""
    metrics = {} if metrics is None else metrics
    worst = 0.0
    for label, got, ref, bound in pairs:
        if tuple(got.shape) != tuple(ref.shape):
            problems.append(f"{label}: shape {list(got.shape)}, golden {list(ref.shape)}")
            continue
        rel, limit, passed = bound.judge(got, ref)
        worst = max(worst, rel / limit)
        metrics[label] = rel
        if not _finite(got):
            problems.append(f"{label}: non-finite values" + (" (a poisoned element leaked)" if check == "slot_isolation"
                                                             else ""))
        elif not passed:
            problems.append(f"{label}: relative RMS error {rel:.3e} > bound {limit:.3e}")
    return worst


# --------------------------------------------------------------------------- the adapters

class ServingAdapter(Adapter):
    """A serving kernel (see the module's docstring). Subclasses set `modes` (a subset of
    'decode', 'verify', 'per_token', 'pad', 'multi_token_decode', 'prefill', 'intermediate',
    'varlen', 'replay') and the bounds of o and of states."""

    family = "serving"
    golden_ops = POOL_OPS
    modes = ()
    # The state layouts the kernel's pool takes (a golden in another is outside its domain).
    layouts = ("k_first", "v_first")
    layout_reason = ""
    # The self-made problems' shape and options (layout_equivalence, decode_after_prefill,
    # accepted_zero, determinism); an engine kernel sets those of its domain.
    problem_shape = dict(H=1, HV=2, K=8, V=12)
    problem_params = dict(gate="log_decay", gate_base="e", beta="as_given", qk_l2norm=False, scale=None,
                          lower_bound=None, state_layout="k_first")
    # One gate per head (GDN): the problems draw a gate constant over K.
    scalar_gate = False
    # "zero": a padded sequence's outputs are 0 (the references); "any": the kernel computes
    # them from a zero state and the engine discards them, so the judge does not read them.
    pad_outputs = "zero"
    # The replay's ring caches: held in the golden's dtypes (d, k bf16; g fp32), or all in this one.
    cache_dtype = None
    # The bounds: rules of the kernel's policy (its default, serving-default: 2x the bf16 floor
    # on outputs, checkpoints and the bf16 caches, 2x the fp32 floor on the states of its pool).
    cache_bound = PolicyBound("gdn.replay_decode", "d_cache_out")
    k_cache_bound = g_cache_bound = None  # None: cache_bound (k), state_bound (g)
    o_bound = PolicyBound("serving.decode", "o")
    state_bound = PolicyBound("serving.decode", "pool_out")
    h_bound = PolicyBound("serving.checkpoints", "checkpoints")
    policy = "serving-default"
    pool_dtype = torch.float32
    # The kernel carries its state between calls in the precision it computes in (FLA: fp32
    # in registers and in the pool), so a prefill split then decode must be bitwise its own
    # single shot.
    split_bitwise = False

    # -- what runs where
    @property
    def checks(self):
        """The checks the kernel's modes support (the others are not collected)."""
        return self.checks_supported()

    def checks_supported(self):
        m = set(self.modes)
        pools = bool(m & {"decode", "verify", "replay"})
        varlen_goldens = "varlen" in m and any(op in self.golden_ops for op in VARLEN_OPS)
        runs = {"golden": pools or varlen_goldens, "slot_isolation": pools,
                "layout_equivalence": "decode" in m,
                "decode_after_prefill": "prefill" in m and ("decode" in m or self.decode_partner is not None),
                "intermediate_states": "intermediate" in m, "accepted_zero": "verify" in m and self.accepted_reason == "",
                "empty_sequences": "varlen" in m, "determinism": bool(m & {"decode", "verify", "replay", "varlen"})}
        return tuple(c for c in SERVING_CHECKS if runs[c])

    def case_unsupported(self, case):
        if case.op in DECODE_OPS and "decode" not in self.modes:
            return "the kernel has no continuous-batching decode mode"
        if case.op in ("serving.verify", "gdn.verify") and "verify" not in self.modes:
            return "the kernel has no speculative-decoding verify mode"
        if case.op in REPLAY_OPS and "replay" not in self.modes:
            return "the kernel has no cached-replay decode"
        if case.op == "serving.checkpoints" and "intermediate" not in self.modes:
            return "the kernel returns no intermediate states"
        if case.op in VARLEN_OPS and "varlen" not in self.modes:
            return "the kernel has no varlen call"
        if case.op not in self.golden_ops:
            return f"takes {', '.join(self.golden_ops)}"
        why = outside_domain(self.domain_reason(case.op, case.params))
        if why:
            return why
        if case.op in VARLEN_OPS:
            return self._varlen_case_unsupported(case)
        layout = case.params.get("state_layout") or "k_first"
        if layout not in self.layouts:
            return f"n/a (outside the kernel's domain: its pool is {' or '.join(self.layouts)}; {self.layout_reason})"
        if self.dense_pool_reason and "pool_geometry" in case.tensors:
            p = case.params
            if int(case.tensors["pool_geometry"][1]) != int(p["HV"]) * int(p["K"]) * int(p["V"]):
                return "the kernel's pool has no slot stride of its own: " + self.dense_pool_reason
        if case.op in POOL_OPS + GDN_POOL_OPS:
            t = case.tensors
            tables = [t["slot_of_sequence"]] if case.op in DECODE_OPS else [t["state_indices"]]
            padded = any(bool((x == PAD).any()) for x in tables)
            if padded and "pad_write" in self.modes and case.op not in DECODE_OPS:
                if padded_tokens(case):  # a -1 entering column, not only a column whose store is skipped
                    return "the kernel reads a -1 entering index as a zero state: " + self.pad_reason
            elif padded and "pad" not in self.modes:
                return "the kernel has no padding slot id (-1): " + self.pad_reason
            if case.op == "serving.verify" and case.params["writes"] != "in_place" and "per_token" not in self.modes:
                return "the kernel has no per-token state output: " + self.per_token_reason
            cu = t["cu_seqlens"]
            if case.op in DECODE_OPS and bool(((cu[1:] - cu[:-1]) > 1).any()) and "multi_token_decode" not in self.modes:
                return "the kernel's decode takes at most one token per sequence: " + self.multi_token_reason
            if case.op in DECODE_OPS and bool(((cu[1:] - cu[:-1]) == 0).any()) and "empty_decode" not in self.modes \
                    and self.empty_reason:
                return "the kernel's decode takes no empty sequence: " + self.empty_reason
            if case.op not in DECODE_OPS and "ragged_verify" not in self.modes and self.ragged_reason:
                lengths = set((cu[1:] - cu[:-1]).tolist())
                if len(lengths) > 1:
                    return "the kernel's verify takes windows of one length: " + self.ragged_reason
        return None

    pad_reason = per_token_reason = multi_token_reason = empty_reason = ragged_reason = accepted_reason = ""
    dense_pool_reason = ""  # set: the kernel addresses slot s at s * HV K V (goldens with a padded stride are outside)
    # A prefill kernel without a decode of its own: the class of the same engine's decode
    # adapter that continues its state (ChunkPrefill), for decode_after_prefill.
    decode_partner = None

    @staticmethod
    def _varlen_case_unsupported(case):
        """Why a KDA golden is not one packed or single sequence with final states only."""
        p, t = case.params, case.tensors
        if "cu_seqlens" not in t and int(t["q"].shape[0]) != 1:
            return (f"a dense batch of B = {int(t['q'].shape[0])} sequences: the varlen call is judged on one packed "
                    "batch (cu_seqlens) or a single sequence")
        if p.get("all_states"):
            return "the golden asks every token's state (all_states); the varlen call returns the final states"
        return None

    def cases(self, check, suite):
        supported = self.checks_supported()
        if check not in supported:
            yield "-", None, (f"n/a: {self.accepted_reason}" if check == "accepted_zero" and self.accepted_reason else
                              f"the kernel's modes ({', '.join(self.modes)}) do not cover '{check}'")
            return
        pools = tuple(op for op in POOL_OPS + GDN_POOL_OPS + REPLAY_OPS if op in self.golden_ops)
        varlen = tuple(op for op in VARLEN_OPS if op in self.golden_ops) if "varlen" in self.modes else ()
        ops = {"golden": pools + varlen, "slot_isolation": pools, "intermediate_states": CHECKPOINT_OPS,
               "determinism": pools}.get(check)
        if ops is None:
            yield "-", None, None
            return
        found = False
        for case in suite:
            if case.op in ops:
                found = True
                yield case.name, case, self.case_unsupported(case)
        if check == "determinism" and "varlen" in self.modes:  # the varlen call on its batch ('-')
            yield "-", None, None
        elif not found:  # fail closed: a check with nothing to run on is not a pass
            yield "-", None, None

    def run_check(self, check, case, device):
        start = time.perf_counter()
        try:
            if check in ("golden", "slot_isolation", "intermediate_states", "determinism") and case is None and \
                    not (check == "determinism" and "varlen" in self.modes):
                res = CheckResult(self.name, check, "-", "fail", "no serving golden of the operators this check needs "
                                  "in the suite (generate them with `k3ref golden generate`)")
            else:
                res = getattr(self, "_check_" + check)(case, device)
        except Exception as e:  # a check that cannot run is an error with its reason, never a pass
            res = CheckResult(self.name, check, case.name if case is not None else "-", "error",
                              f"{type(e).__name__}: {e}".splitlines()[0][:300])
        res.seconds = time.perf_counter() - start
        return res

    # -- the kernel's operations (subclasses)
    def decode(self, inputs, params, pool, slot_of_sequence):
        raise NotImplementedError

    def verify(self, inputs, params, pool, state_indices, num_accepted, in_place=True):
        raise NotImplementedError

    def prefill(self, inputs, params, initial_state):
        raise NotImplementedError

    def intermediate_states(self, inputs, params, chunk):
        raise NotImplementedError

    # -- running a pool golden
    def _run_pool_case(self, case, device, poison_unread=False):
        t, p = case.tensors, case.params
        kp = p  # the KDA keys beside the serving parameters (one object)
        HV, K, V = int(p["HV"]), int(p["K"]), int(p["V"])
        geometry = t["pool_geometry"].tolist()
        flat = t["pool"].to(device=device, dtype=self.pool_dtype).clone()
        if poison_unread:
            keep = torch.zeros(flat.numel(), dtype=torch.bool)
            for s in read_slots(case):
                a, b = slot_spans(geometry, HV, K, V)[s]
                keep[a:b] = True
            flat[~keep.to(device)] = float("nan")
        before = flat.clone()
        pool = pool_view(flat, geometry, HV, K, V)
        inputs = kda_inputs(t, device, case.op, p)
        token_states = None
        if case.op in DECODE_OPS:
            o = self.decode(inputs, kp, pool, t["slot_of_sequence"].to(device))
        else:
            o, token_states = self.verify(inputs, kp, pool, t["state_indices"].to(device), t["num_accepted"].to(device),
                                          in_place=(p.get("writes") or "in_place") == "in_place")
        return dict(o=o, flat=flat, before=before, token_states=token_states, geometry=geometry, HV=HV, K=K, V=V)

    def _judge_pool_case(self, case, run, check):
        t = case.tensors
        spans = slot_spans(run["geometry"], run["HV"], run["K"], run["V"])
        named = named_slots(case)
        flat, before = run["flat"].cpu(), run["before"].cpu()
        problems, metrics, worst = [], {}, 0.0
        outside = torch.ones(flat.numel(), dtype=torch.bool)
        for s in named:
            a, b = spans[s]
            outside[a:b] = False
        changed = (bits(flat) != bits(before)) & outside
        if bool(changed.any()):
            first = int(changed.nonzero()[0])
            slot = next((s for s, (a, b) in enumerate(spans) if a <= first < b), None)
            where = f"slot {slot}, which the call does not name" if slot is not None else "the pool's padding"
            problems.append(f"{int(changed.sum())} pool elements outside the named slots changed (first: element "
                            f"{first}, in {where})")
        o, ref_o = run["o"].cpu(), t["o"]
        if self.pad_outputs == "any" and padded_tokens(case):  # discarded by the engine: not judged
            o, ref_o = o.clone(), ref_o.clone()
            o[:, padded_tokens(case)] = 0
            ref_o[:, padded_tokens(case)] = 0
        if not _finite(o):
            problems.append(f"o has {int((~torch.isfinite(o.double())).sum())} non-finite values")
        checks = [("o", o, ref_o, self.o_bound)]
        for s in sorted(named):
            a, b = spans[s]
            checks.append((f"slot {s}", flat[a:b], t["pool_out"][a:b], self.state_bound))
        if run["token_states"] is not None:
            checks.append(("token_states", run["token_states"].cpu(), t["token_states"], self.state_bound))
        worst = _judge_tensors(checks, check, problems, metrics)
        status = "fail" if problems else "pass"
        reason = "; ".join(problems) if problems else (
            f"o and {len(named)} named slots within bound (worst {worst:.2f} of it); every other pool element bitwise "
            "unchanged" + (" (NaN poison kept its bits, never leaked)" if check == "slot_isolation" else ""))
        return CheckResult(self.name, check, case.name, status, reason[:600], ratio=worst, metrics=metrics)

    def _check_golden(self, case, device):
        why = self.case_unsupported(case)
        if why:
            return CheckResult(self.name, "golden", case.name, "skip", why)
        if case.op in REPLAY_OPS:
            return self._judge_replay_case(case, self._run_replay_case(case, device), "golden")
        if case.op in VARLEN_OPS:  # the bounds first: a policy without them fails before the kernel runs
            bounds = {n: self._golden_bound(case.op, n) for n in ("o", "final_state")}
            return self._judge_varlen_case(case, self._run_varlen_case(case, device), bounds)
        return self._judge_pool_case(case, self._run_pool_case(case, device), "golden")

    # -- a varlen kernel on the KDA goldens (kda.recurrent, kda.chunkwise_*)
    def _run_varlen_case(self, case, device):
        """(o, final states in the golden's layout) of the varlen call on a golden of one packed
        or single sequence, its states handed over in the layout of the kernel's varlen call."""
        t, p = case.tensors, case.params
        inputs = kda_inputs(t, device)
        T = int(t["q"].shape[1])
        if "cu_seqlens" not in inputs:
            inputs["cu_seqlens"] = torch.tensor([0, T], device=device)
        N, HV, K, V = len(inputs["cu_seqlens"]) - 1, int(p["HV"]), int(p["K"]), int(p["V"])
        golden_layout = p.get("state_layout") or "k_first"
        layout = self.varlen_params.get("state_layout") or "k_first"
        h0 = t["initial_state"].float() if "initial_state" in t else torch.zeros(
            (N, HV) + ((V, K) if golden_layout == "v_first" else (K, V)))
        if layout != golden_layout:
            h0 = h0.transpose(-1, -2)
        o, final = self.varlen(dict(inputs, initial_state=h0.contiguous().to(device)), dict(p, state_layout=layout))
        final = final.cpu()
        return o.cpu(), (final.transpose(-1, -2) if layout != golden_layout else final)

    def _golden_bound(self, op, tensor):
        """The bound of `tensor` of a golden of `op` under the kernel's policy; a policy without
        rules for the operator fails the check closed, in one line naming it."""
        try:
            return Bound(self.policy, op, tensor)
        except KeyError as e:
            raise RuntimeError(f"{e.args[0]}: judging the kernel's varlen call on {op} goldens needs that operator's "
                               "rule in policy/policies.json") from None

    def _judge_varlen_case(self, case, run, bounds):
        o, final = run
        problems, metrics = [], {}
        worst = _judge_tensors([(n, x, case.tensors[n], bounds[n]) for n, x in (("o", o), ("final_state", final))],
                               "golden", problems, metrics)
        reason = "; ".join(problems) or f"o and the final states within bound (worst {worst:.2f} of it)"
        return CheckResult(self.name, "golden", case.name, "fail" if problems else "pass", reason[:600], ratio=worst,
                           metrics=metrics)

    def _check_slot_isolation(self, case, device):
        why = self.case_unsupported(case)
        if why:
            return CheckResult(self.name, "slot_isolation", case.name, "skip", why)
        if case.op in REPLAY_OPS:
            return self._judge_replay_case(case, self._run_replay_case(case, device, poison_unread=True),
                                           "slot_isolation")
        return self._judge_pool_case(case, self._run_pool_case(case, device, poison_unread=True), "slot_isolation")

    # -- the cached-replay decode (gdn.replay_decode goldens)
    def replay(self, raw, params, pool, d_cache, k_cache, g_cache, state_indices, write_pos):
        """One token per row: o [N, HV, V]; the checkpoints (pool) and ring caches in place."""
        raise NotImplementedError

    def _replay_masks(self, case, geometry, HV, K, V):
        """(judged, named) element masks of pool and caches: the slots of the rows a kernel serves
        (state index > 0), their cache entries up to the row's write position."""
        t, L = case.tensors, int(case.params["L"])
        rows = [(int(s), int(w)) for s, w in zip(t["state_indices"].tolist(), t["write_pos"].tolist()) if int(s) > 0]
        spans = slot_spans(geometry, HV, K, V)
        pool = torch.zeros(t["pool"].numel(), dtype=torch.bool)
        caches = {n: torch.zeros(t[n].shape, dtype=torch.bool) for n in ("d_cache", "k_cache", "g_cache")}
        for s, w in rows:
            a, b = spans[s]
            pool[a:b] = True
            for n, m in caches.items():
                m[s, :, : min(w, L - 1) + 1] = True
        return pool, caches

    def _run_replay_case(self, case, device, poison_unread=False):
        t, p = case.tensors, case.params
        HV, K, V = int(p["HV"]), int(p["K"]), int(p["V"])
        geometry = t["pool_geometry"].tolist()
        flat = t["pool"].to(device=device, dtype=self.pool_dtype).clone()
        caches = {n: t[n].to(device=device, dtype=self.cache_dtype or t[n].dtype).clone()
                  for n in ("d_cache", "k_cache", "g_cache")}
        pool_mask, cache_masks = self._replay_masks(case, geometry, HV, K, V)
        if poison_unread:  # every element a correct kernel neither reads nor writes
            flat[~pool_mask.to(device)] = float("nan")
            for n, m in cache_masks.items():
                caches[n][~m.to(device)] = float("nan")
        before = {"pool": flat.clone(), **{n: c.clone() for n, c in caches.items()}}
        raw = {n: t[n].to(device) for n in ("mixed_qkv", "a", "b", "A_log", "dt_bias")}
        o = self.replay(raw, p, pool_view(flat, geometry, HV, K, V), caches["d_cache"], caches["k_cache"],
                        caches["g_cache"], t["state_indices"].to(device), t["write_pos"].to(device))
        return dict(o=o, after={"pool": flat, **caches}, before=before, masks={"pool": pool_mask, **cache_masks})

    def _judge_replay_case(self, case, run, check):
        t = case.tensors
        problems, metrics, worst = [], {}, 0.0
        golden = {"pool": t["pool_out"], "d_cache": t["d_cache_out"], "k_cache": t["k_cache_out"],
                  "g_cache": t["g_cache_out"]}
        bounds = {"pool": self.state_bound, "d_cache": self.cache_bound,
                  "k_cache": self.k_cache_bound or self.cache_bound, "g_cache": self.g_cache_bound or self.state_bound}
        o = run["o"].cpu()
        pairs = [("o", o.reshape(t["o"].shape) if o.numel() == t["o"].numel() else o, t["o"], self.o_bound)]
        for n, mask in run["masks"].items():
            after, before = run["after"][n].cpu(), run["before"][n].cpu()
            changed = (bits(after) != bits(before)) & ~mask
            if bool(changed.any()):
                problems.append(f"{n}: {int(changed.sum())} elements outside the served rows' slots and write positions "
                                "changed")
            if bool(mask.any()):
                pairs.append((n, after[mask], golden[n][mask], bounds[n]))
        worst = _judge_tensors(pairs, check, problems, metrics)
        reason = "; ".join(problems) or (f"o, the served checkpoints and cache entries within bound (worst {worst:.2f} "
                                         "of it); every other element bitwise unchanged" +
                                         (" (NaN poison kept its bits, never leaked)" if check == "slot_isolation" else ""))
        return CheckResult(self.name, check, case.name, "fail" if problems else "pass", reason[:600], ratio=worst,
                           metrics=metrics)

    def _check_determinism(self, case, device):
        if case is None:  # the varlen call on DETERMINISM_LENGTHS
            inputs, params, h0 = self._varlen_problem(41, list(DETERMINISM_LENGTHS), device)
            runs = [dict(zip(("o", "final states"), self.varlen(dict(inputs, initial_state=h0.clone()), params)))
                    for _ in range(2)]
            what = f"two varlen calls on the same batch ({', '.join(map(str, DETERMINISM_LENGTHS))} tokens)"
            case_id = "-"
        else:
            why = self.case_unsupported(case)
            if why:
                return CheckResult(self.name, "determinism", case.name, "skip", why)
            if case.op in REPLAY_OPS:
                runs = [dict(o=r["o"], **r["after"]) for r in (self._run_replay_case(case, device) for _ in range(2))]
                what = "two runs on fresh pools and caches"
            else:
                runs = [dict(o=r["o"], pool=r["flat"]) for r in (self._run_pool_case(case, device) for _ in range(2))]
                what = "two runs on fresh pools"
            case_id = case.name
        differ = [n for n in runs[0] if not torch.equal(bits(runs[0][n].cpu()), bits(runs[1][n].cpu()))]
        if differ:
            return CheckResult(self.name, "determinism", case_id, "fail", f"{what} differ: {', '.join(differ)}")
        return CheckResult(self.name, "determinism", case_id, "pass", f"{what}: {', '.join(runs[0])} bitwise equal")

    # -- self-made problems (seeded; judged against references.kda, or the pure-PyTorch kernel)
    def _problem(self, seed, lengths, device="cpu", shape=None, params=None):
        """(inputs, params, states [len(lengths) + 3, HV, K, V] fp32, K-first) of the kernel's
        problem_shape and problem_params, or the ones given."""
        sh = dict(self.problem_shape, **(shape or {}))
        params = dict(self.problem_params if params is None else params)
        H, HV, K, V = sh["H"], sh["HV"], sh["K"], sh["V"]
        gen = torch.Generator().manual_seed(seed)
        T = sum(lengths)

        def bf16(shape, lo, hi):
            return (torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(torch.bfloat16)

        kw = K ** -0.5
        gk = 1 if self.scalar_gate else K
        log_decay = params["gate"] == "log_decay"
        inputs = dict(q=bf16((1, T, H, K), -1, 1), k=bf16((1, T, H, K), -kw, kw), v=bf16((1, T, HV, V), -1, 1),
                      g=bf16((1, T, HV, gk), -1, 0) if log_decay else bf16((1, T, HV, gk), -4, 4),
                      beta=bf16((1, T, HV), 0, 1) if params["beta"] == "as_given" else bf16((1, T, HV), -4, 4),
                      cu_seqlens=torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))]))
        inputs["g"] = inputs["g"].expand(1, T, HV, K).contiguous()
        if not log_decay:  # the gate in the kernel: A_log and dt_bias (one value per head for GDN)
            inputs["A_log"] = (torch.rand(HV, generator=gen, dtype=torch.float64) * 2.7).float()
            inputs["dt_bias"] = (torch.rand(HV, gk, generator=gen, dtype=torch.float64) * 2 - 1).float().expand(
                HV, K).contiguous()
        states = bf16((len(lengths) + 3, HV, K, V), -1, 1).float()
        return {k: v.to(device) for k, v in inputs.items()}, dict(params, state_layout="k_first"), states.to(device)

    @staticmethod
    def _in_layout(states, layout):
        """K-first states [..., K, V] as a contiguous pool of `layout`."""
        return states.transpose(-1, -2).contiguous() if layout == "v_first" else states

    def _check_layout_equivalence(self, case, device):
        lengths = [1, 1, 1] if "multi_token_decode" not in self.modes else [1, 2, 1]
        problems, worst = [], 0.0
        K0, V0 = self.problem_shape["K"], self.problem_shape["V"]
        for K, V in ((K0, V0), (V0, K0)):
            inputs, params, states = self._problem(17 + K, lengths, shape=dict(K=K, V=V), device=device)
            slots = torch.tensor([3, 0, 4], device=device)
            ref_o, ref_pool = TorchServingAdapter().decode_reference(inputs, params, states.double(), slots)
            for layout in self.layouts:
                p = dict(params, state_layout=layout)
                pool = self._in_layout(states.to(self.pool_dtype).clone(), layout)  # .to() alone would alias
                o = self.decode(inputs, p, pool, slots)
                got = pool if layout == "k_first" else pool.transpose(-1, -2)
                worst = max(worst, _judge_tensors([(f"K={K}, V={V}, {layout}: o", o, ref_o, self.o_bound),
                                                   (f"K={K}, V={V}, {layout}: pool", got, ref_pool, self.state_bound)],
                                                  "layout_equivalence", problems))
        status = "fail" if problems else "pass"
        only = "" if len(self.layouts) > 1 else f" (its pool is {self.layouts[0]} only: {self.layout_reason})"
        return CheckResult(self.name, "layout_equivalence", "-", status,
                           "; ".join(problems) or f"{' and '.join(self.layouts)} pools agree with the reference, K != V "
                           f"both ways (worst {worst:.2f} of the bound){only}", ratio=worst)

    def _check_decode_after_prefill(self, case, device):
        T = 12
        inputs, params, states = self._problem(5, [T], device=device)
        layout = self.layouts[0]
        params = dict(params, state_layout=layout)
        one = {k: v for k, v in inputs.items() if k != "cu_seqlens"}
        h0 = self._in_layout(states[:1].clone(), layout)
        HV, V = inputs["v"].shape[2], inputs["v"].shape[3]
        ref_o, ref_final = references.kda(dict(one, initial_state=h0), params)
        single_o, single_final = self.prefill(one, params, h0.clone())
        problems, bitwise, worst = [], [], 0.0
        for split in (0, 1, 7, T - 1, T):
            part = {k: (v[:, :split] if k in TOKEN_INPUTS else v) for k, v in one.items()}
            if split > 0:
                o_pre, state = self.prefill(part, params, h0.clone())
            else:
                o_pre, state = one["q"].new_zeros(1, 0, HV, V, dtype=torch.float64), h0.clone()
            pool = torch.zeros((3,) + tuple(h0.shape[1:]), dtype=self.pool_dtype, device=device)
            pool[1] = state[0].to(self.pool_dtype)
            outs = [o_pre.double().cpu()]
            for t in range(split, T):
                tok = {k: (v[:, t : t + 1] if k in TOKEN_INPUTS else v) for k, v in one.items()}
                tok["cu_seqlens"] = torch.tensor([0, 1], device=device)
                outs.append(self.decode(tok, params, pool, torch.tensor([1], device=device)).double().cpu())
            o = torch.cat(outs, dim=1)
            worst = max(worst, _judge_tensors([(f"split {split}: o", o, ref_o, self.o_bound),
                                               (f"split {split}: final state", pool[1:2], ref_final, self.state_bound)],
                                              "decode_after_prefill", problems))
            bitwise.append(bool(torch.equal(o.to(single_o.dtype), single_o.cpu())) and
                           bool(torch.equal(pool[1:2].cpu(), single_final.to(self.pool_dtype).cpu())))
        if self.split_bitwise and not all(bitwise):
            problems.append(f"not bitwise equal to the kernel's own single shot at splits "
                            f"{[s for s, b in zip((0, 1, 7, T - 1, T), bitwise) if not b]} (the state is carried in the "
                            "kernel's own precision, so a split must not change a bit)")
        res = CheckResult(self.name, "decode_after_prefill", "-", "fail" if problems else "pass",
                          "; ".join(problems) or f"every split within the bound of the fp64 single shot (worst "
                          f"{worst:.2f}); bitwise equal to the kernel's own single shot at {sum(bitwise)} of "
                          f"{len(bitwise)} splits", ratio=worst)
        res.extra["bitwise_equal_to_single_shot"] = bitwise
        return res

    def _check_intermediate_states(self, case, device):
        t, p = case.tensors, case.params
        kp = p  # the KDA keys beside the serving parameters (one object)
        chunk = int(p["blocks"]["chunk"])
        inputs = kda_inputs(t, device)
        inputs.pop("cu_seqlens", None)
        h0 = t["initial_state"].to(device)
        h = self.intermediate_states(dict(inputs, initial_state=h0), kp, chunk).cpu()
        positions = [int(x) for x in t["checkpoint_positions"].tolist()]
        ckpt = {b: t["checkpoints"][i] for i, b in enumerate(positions)}
        ckpt[0] = h0[0].double()
        T = t["q"].shape[1]
        problems, worst, margin = [], 0.0, math.inf
        expected_chunks = (T + chunk - 1) // chunk
        if h.shape[0] != expected_chunks:
            problems.append(f"{h.shape[0]} intermediate states for T = {T}, chunk {chunk}: expected {expected_chunks}")
        for c in range(min(h.shape[0], expected_chunks)):
            b = c * chunk
            ref = ckpt[b]
            worst = max(worst, _judge_tensors([(f"h[{c}] against the state after {b} tokens", h[c], ref, self.h_bound)],
                                              "intermediate_states", problems))
            for nb in (b - 1, b + 1):
                if nb in ckpt:  # judged against the state one token off, h[c] must fail
                    d, off_limit, off_passed = self.h_bound.judge(h[c], ckpt[nb])
                    margin = min(margin, d / off_limit)
                    if off_passed:
                        problems.append(f"h[{c}] is within the bound of the state after {nb} tokens too "
                                        f"({d:.3e} <= {off_limit:.3e}): an off-by-one would pass")
        return CheckResult(self.name, "intermediate_states", case.name, "fail" if problems else "pass",
                           "; ".join(problems)[:600] or f"h[c] = state after c * {chunk} tokens within the bound "
                           f"(worst {worst:.2f}), neighbours at least {margin:.1f} bounds away", ratio=worst)

    def _check_accepted_zero(self, case, device):
        inputs, params, states = self._problem(23, [2, 2, 2], device=device)
        layout = self.layouts[0]
        params = dict(params, state_layout=layout)
        W = 3
        idx = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], device=device)
        accepted = torch.tensor([2, 0, 1], device=device)
        shape = tuple(self._in_layout(states[:1], layout).shape[1:])
        pool = torch.full((9,) + shape, float("nan"), dtype=self.pool_dtype, device=device)
        for n, a in ((0, 2), (2, 1)):  # the only states read by a correct kernel
            pool[idx[n, a - 1]] = self._in_layout(states[n], layout).to(self.pool_dtype)
        try:
            o, _ = self.verify(inputs, params, pool, idx, accepted, in_place=True)
        except Exception as e:  # rejecting the count is the defined behaviour
            return CheckResult(self.name, "accepted_zero", "-", "pass",
                               f"accepted count 0 rejected: {type(e).__name__}: {e}".splitlines()[0][:300])
        o = o.double().cpu()
        bad = int((~torch.isfinite(o[0, 2:4])).sum())
        if bad:
            return CheckResult(self.name, "accepted_zero", "-", "fail",
                               f"accepted count 0 read a slot outside its row: {bad} of {o[0, 2:4].numel()} outputs of "
                               "sequence 1 are NaN (FLA's entering index becomes column -1, i.e. the previous row's last "
                               f"entry, slot {int(idx[0, W - 1])}); a kernel must reject 0 or read nothing")
        others = int((~torch.isfinite(o[0, :2])).sum() + (~torch.isfinite(o[0, 4:])).sum())
        if others:
            return CheckResult(self.name, "accepted_zero", "-", "fail",
                               f"{others} outputs of sequences 0 and 2 (accepted counts 2 and 1) are NaN: they read a "
                               "slot other than the one their accepted count names")
        return CheckResult(self.name, "accepted_zero", "-", "pass",
                           "accepted count 0 neither rejected nor read outside the row (no NaN reached an output)")


    # The shape and options of the empty-sequence problem (FlashKDA overrides: K = V = 128, its gate).
    varlen_shape = dict(H=1, HV=2, K=8, V=12)
    varlen_params = dict(gate="log_decay", gate_base="e", beta="as_given", qk_l2norm=False, scale=None,
                         lower_bound=None, state_layout="k_first")

    def _varlen_problem(self, seed, lengths, device):
        """(inputs, params, initial states [N, ...] in the varlen call's layout) of a varlen batch
        of the kernel's varlen_shape and varlen_params."""
        params = dict(self.varlen_params)
        inputs, _, states = self._problem(seed, lengths, device=device, shape=self.varlen_shape, params=params)
        h0 = states[: len(lengths)].clone()
        if params["state_layout"] == "v_first":
            h0 = h0.transpose(-1, -2).contiguous()
        return inputs, params, h0

    def _check_empty_sequences(self, case, device):
        lengths = [3, 0, 4, 0, 0, 5, 0]
        inputs, params, h0 = self._varlen_problem(31, lengths, device)
        ref_o, ref_final = references.kda(dict(inputs, initial_state=h0), params)
        o, final = self.varlen(dict(inputs, initial_state=h0.clone()), params)
        o, final = o.cpu(), final.cpu()
        problems, worst = [], 0.0
        for n, L in enumerate(lengths):
            if L == 0:
                if not torch.equal(final[n].float(), h0[n].cpu()):
                    bad = int((final[n].float() != h0[n].cpu()).sum())
                    nan = int(torch.isnan(final[n].float()).sum())
                    problems.append(f"sequence {n} (no tokens): final state is not its initial state ({bad} of "
                                    f"{final[n].numel()} elements differ, {nan} NaN)")
        full = [n for n, L in enumerate(lengths) if L]
        worst = max(worst, _judge_tensors([("o", o, ref_o, self.o_bound),
                                           ("final states of the sequences with tokens", final[full], ref_final[full],
                                            self.state_bound)], "empty_sequences", problems))
        return CheckResult(self.name, "empty_sequences", "-", "fail" if problems else "pass",
                           "; ".join(problems)[:600] or f"every empty sequence's final state is its initial state bit for "
                           f"bit; outputs and the other final states within the bound (worst {worst:.2f})", ratio=worst)


class TorchServingAdapter(ServingAdapter):
    """The pure-PyTorch serving kernel (CPU or GPU): fp64 arithmetic, fp32 pool, the reference
    semantics of include/k3ref/serving/. A mutation makes it wrong on purpose, to test the checks:
      accepted_off_by_one      entering column a - 2 of the flat index table (at a = 1: the
                               previous row's last entry, the neighbour's slot)
      write_unnamed_slot       the last state written also lands in the first slot the call
                               does not name
      layout_swap              a V-first pool read and written as if K-first
      checkpoint_late          intermediate state c taken one token after c * chunk
      verify_writes_committed  verify also writes its final state into the entering slot
      empty_sequence_state     a varlen sequence without tokens returns a zero final state (not
                               its initial state)
      replay_no_decay          the cached-replay decode rebuilds the state without the decays of
                               the later cached gates
    """

    MUTATIONS = (None, "accepted_off_by_one", "write_unnamed_slot", "layout_swap", "checkpoint_late",
                 "verify_writes_committed", "empty_sequence_state", "replay_no_decay")
    modes = ("decode", "verify", "per_token", "pad", "multi_token_decode", "prefill", "intermediate", "varlen",
             "replay")
    golden_ops = POOL_OPS + GDN_POOL_OPS + REPLAY_OPS + CHECKPOINT_OPS
    # fp64 arithmetic and an fp64 pool against the 256-bit goldens: everything to 1e-12 (its policy).
    cache_dtype = pool_dtype = torch.float64
    split_bitwise = True
    policy = "rel-rms:1e-12"
    contract = "PyTorch; fp64 recurrence, fp64 outputs and pool"

    def __init__(self, mutation=None):
        super().__init__()
        if mutation not in self.MUTATIONS:
            raise ValueError(f"unknown mutation {mutation!r}; known: {self.MUTATIONS[1:]}")
        self.mutation = mutation
        self.name = "torch.serving" + (f"[{mutation}]" if mutation else "")
        self.kind = "mutant" if mutation else "kernel"

    # -- the recurrence (fp64) over one sequence
    @staticmethod
    def _run(prep, scale, begin, end, S):
        q, k, v, decay, beta = prep
        HV, H = v.shape[2], q.shape[2]
        head = torch.arange(HV, device=q.device) // (HV // H)
        outs, states = [], []
        for t in range(begin, end):
            S = decay[0, t][:, :, None] * S
            kt = k[0, t][head]
            u = beta[0, t][:, None] * (v[0, t] - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt[:, :, None] * u[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, scale * q[0, t][head]))
            states.append(S)
        return outs, states

    def _prep(self, inputs, params):
        prep = torch_model.prepare(inputs, params)
        K = inputs["q"].shape[-1]
        scale = params.get("scale")
        return prep, K ** -0.5 if scale is None else float(scale)

    def _v_first(self, params):
        return params.get("state_layout") == "v_first" and self.mutation != "layout_swap"

    def _read(self, pool, s, params):
        x = pool[s].double()
        if params.get("state_layout") == "v_first" and self.mutation == "layout_swap":
            HV, A, B = x.shape
            return x.contiguous().reshape(HV, B, A)  # the V x K bytes read as K x V
        return x.transpose(-1, -2) if self._v_first(params) else x

    def _stored(self, S, params, shape):
        """A K-first state as the pool stores it (layout_swap: the K x V bytes stored as V x K)."""
        if params.get("state_layout") == "v_first" and self.mutation == "layout_swap":
            return S.reshape(shape)
        return S.transpose(-1, -2) if self._v_first(params) else S

    def _write(self, pool, s, S, params):
        pool[s] = self._stored(S, params, pool[s].shape).to(pool.dtype)

    def _unnamed_write(self, pool, named, S, params):
        if self.mutation == "write_unnamed_slot" and S is not None:
            free = [s for s in range(pool.shape[0]) if s not in named]
            if free:
                self._write(pool, free[0], S, params)

    def decode(self, inputs, params, pool, slot_of_sequence):
        prep, scale = self._prep(inputs, params)
        cu = [int(x) for x in inputs["cu_seqlens"].tolist()]
        o = torch.zeros(inputs["v"].shape, dtype=torch.float64, device=inputs["v"].device)
        slots = [int(x) for x in slot_of_sequence.tolist()]
        last = None
        for n in range(len(cu) - 1):
            if cu[n + 1] == cu[n] or slots[n] == PAD:
                continue
            outs, states = self._run(prep, scale, cu[n], cu[n + 1], self._read(pool, slots[n], params))
            o[0, cu[n] : cu[n + 1]] = torch.stack(outs)
            self._write(pool, slots[n], states[-1], params)
            last = states[-1]
        self._unnamed_write(pool, set(slots), last, params)
        return o

    def decode_reference(self, inputs, params, states, slots):
        """fp64 decode on a K-first [slots, HV, K, V] copy: (o, pool after)."""
        pool = states.clone()
        o = TorchServingAdapter().decode(inputs, dict(params, state_layout="k_first"), pool, slots)
        return o, pool

    def verify(self, inputs, params, pool, state_indices, num_accepted, in_place=True):
        prep, scale = self._prep(inputs, params)
        cu = [int(x) for x in inputs["cu_seqlens"].tolist()]
        N, W = state_indices.shape
        flat = [int(x) for x in state_indices.reshape(-1).tolist()]
        acc = [int(x) for x in num_accepted.tolist()]
        o = torch.zeros(inputs["v"].shape, dtype=torch.float64, device=inputs["v"].device)
        HV, K, V = inputs["v"].shape[2], inputs["q"].shape[3], inputs["v"].shape[3]
        token_states = None
        if not in_place:
            shape = (cu[-1], HV, V, K) if params.get("state_layout") == "v_first" else (cu[-1], HV, K, V)
            token_states = torch.zeros(shape, dtype=pool.dtype, device=pool.device)
        last = None
        for n in range(N):
            L = cu[n + 1] - cu[n]
            if L == 0:
                continue
            if self.mutation == "accepted_off_by_one":
                entering = flat[n * W + acc[n] - 2]
            else:
                if not 1 <= acc[n] <= W:
                    raise ValueError(f"num_accepted[{n}] = {acc[n]} is outside [1, W = {W}]: it names no entering state")
                entering = flat[n * W + acc[n] - 1]
            if entering == PAD:
                continue
            if in_place and L > W:
                raise ValueError(f"sequence {n} has {L} tokens for {W} columns")
            outs, states = self._run(prep, scale, cu[n], cu[n + 1], self._read(pool, entering, params))
            o[0, cu[n] : cu[n + 1]] = torch.stack(outs)
            for j, S in enumerate(states):
                if in_place:
                    if flat[n * W + j] != PAD:
                        self._write(pool, flat[n * W + j], S, params)
                else:
                    token_states[cu[n] + j] = self._stored(S, params, token_states.shape[1:]).to(pool.dtype)
            if self.mutation == "verify_writes_committed":
                self._write(pool, entering, states[-1], params)
            last = states[-1]
        self._unnamed_write(pool, {s for s in flat if s != PAD}, last, params)
        return o, token_states

    def replay(self, raw, params, pool, d_cache, k_cache, g_cache, state_indices, write_pos):
        inputs = gdn_as_kda(raw, int(params["H"]), int(params["K"]))
        prep, scale = self._prep(inputs, params)
        q, k, v, decay, beta = prep
        N, HV, V, L = v.shape[1], v.shape[2], v.shape[3], d_cache.shape[2]
        head = torch.arange(HV, device=v.device) // (HV // q.shape[2])
        o = torch.zeros(N, HV, V, dtype=torch.float64, device=v.device)
        for n, (s, w) in enumerate(zip(state_indices.tolist(), write_pos.tolist())):
            if s <= 0:  # the engines' null slot 0 and -1: padding
                continue
            gates = g_cache[s].double()  # [HV, L] log decays
            later = (lambda c: torch.zeros(HV, dtype=torch.float64, device=v.device)) if self.mutation == "replay_no_decay" \
                else (lambda c: gates[:, c:w].sum(-1))
            S = torch.exp(later(0))[:, None, None] * self._read(pool, s, params)
            for c in range(w):
                S = S + torch.exp(later(c + 1))[:, None, None] * k_cache[s][head, c].double()[:, :, None] * \
                    d_cache[s][:, c].double()[:, None, :]
            outs, states = self._run(prep, scale, n, n + 1, S)
            o[n] = outs[0]
            if w == L - 1:  # the flush: the state after the token is the new checkpoint
                self._write(pool, s, states[0], params)
                continue
            kt = k[0, n][head]
            d = beta[0, n][:, None] * (v[0, n] - torch.einsum("hkv,hk->hv", decay[0, n][:, :, None] * S, kt))
            d_cache[s][:, w] = d.to(d_cache.dtype)
            k_cache[s][:, w] = k[0, n].to(k_cache.dtype)
            g_cache[s][:, w] = torch.log(decay[0, n][:, 0]).to(g_cache.dtype)
        return o

    def prefill(self, inputs, params, initial_state):
        prep, scale = self._prep(inputs, params)
        S = initial_state[0].double()
        if params.get("state_layout") == "v_first":
            S = S.transpose(-1, -2)
        T = inputs["q"].shape[1]
        outs, states = self._run(prep, scale, 0, T, S)
        o = torch.stack(outs)[None] if outs else torch.zeros(1, 0, *inputs["v"].shape[2:], dtype=torch.float64)
        final = states[-1] if states else S
        if params.get("state_layout") == "v_first":
            final = final.transpose(-1, -2)
        return o, final[None]

    def varlen(self, inputs, params):
        o, final = torch_model.kda_forward(inputs, params)
        if self.mutation == "empty_sequence_state":
            cu = inputs["cu_seqlens"].tolist()
            for n in range(len(cu) - 1):
                if cu[n + 1] == cu[n]:
                    final[n] = 0
        return o, final

    def intermediate_states(self, inputs, params, chunk):
        prep, scale = self._prep(inputs, params)
        v_first = params.get("state_layout") == "v_first"
        S = inputs["initial_state"][0].double()
        S = S.transpose(-1, -2) if v_first else S
        T = inputs["q"].shape[1]
        _, states = self._run(prep, scale, 0, T, S)
        late = 1 if self.mutation == "checkpoint_late" else 0
        h = [S if c * chunk + late == 0 else states[min(c * chunk + late, T) - 1] for c in range((T + chunk - 1) // chunk)]
        h = torch.stack(h)
        return h.transpose(-1, -2) if v_first else h


class ChunkPrefill:
    """A chunked-prefill kernel (modes varlen and prefill) that an engine pairs with its own
    decode kernel: prefill is the varlen call on one sequence, and decode (decode_after_prefill
    only) is `decode_partner`'s, on the same engine module (`mod`), so the prefilled state is
    continued token by token as the engine serves it."""

    def prefill(self, inputs, params, initial_state):
        cu = torch.tensor([0, inputs["q"].shape[1]], device=inputs["q"].device)
        return self.varlen(dict(inputs, initial_state=initial_state, cu_seqlens=cu), params)

    def decode(self, inputs, params, pool, slot_of_sequence):
        partner = self.decode_partner()
        partner.mod = self.mod
        return partner.decode(inputs, params, pool, slot_of_sequence)


class ServingModes:
    """A recurrent kernel adapted in its two serving modes, one adapter each (`kernel_name[mode]`).
    Each check runs once over the two: decode, the split and the layouts with continuous
    batching; verify, accepted count 0 and the plain varlen call with spec decoding."""

    kernel_name = None

    def __init__(self, mode="spec_decode"):
        super().__init__()
        if mode not in ("continuous_batching", "spec_decode"):
            raise ValueError(f"unknown mode {mode!r}")
        self.mode = mode
        self.name = f"{self.kernel_name}[{mode}]"
        self.modes = ("decode", "prefill") if mode == "continuous_batching" else ("verify", "varlen")


class FlaServingAdapter(ServingModes, ServingAdapter):
    """FLA's fused_recurrent_kda_fwd with ssm_state_indices (continuous batching, the pool as
    initial_state, inplace_final_state=True) and num_accepted_tokens (spec decoding). Decode maps
    to 1-D ssm_state_indices with one token per sequence (FLA stores the state after token t into
    index [n, t]: with more tokens it would write its neighbours' slots); prefill is the plain
    varlen call. Not supported (skipped with the reason): padding (-1: FLA has no guard and
    addresses the memory before the pool) and the per-token output (FLA allocates N rows but
    writes row bos + t)."""

    requires_cuda = True
    split_bitwise = True
    _unpicklable = ("fwd", "plain")
    policy = "fla-serving"  # policy/policies.json: its rules are the bounds (the state never below 1e-6)
    state_bound = PolicyBound("serving.decode", "pool_out", at_least=1e-6)
    policy_reason = "fp32 recurrence on bf16 inputs: 1.0x the bf16 output floor measured (kda.recurrent)"
    contract = "Triton; fp32 state and arithmetic on bf16 inputs, o rounded to bf16, fp32 pool"
    pad_reason = "FLA reads slot -1 (before the pool's start) for a -1 index"
    per_token_reason = "with inplace_final_state=False FLA allocates N state rows but writes row bos + t"
    multi_token_reason = "FLA's continuous batching stores the state after token t into index column t"

    kernel_name = "fla.fused_recurrent_kda"

    def load(self):
        need_cuda()
        load_fla(self.path_of("fla_path"))
        import importlib

        mod = importlib.import_module("fla.ops.kda.fused_recurrent")
        self.fwd = mod.fused_recurrent_kda_fwd
        self.plain = mod.fused_recurrent_kda

    def version(self):
        return fla_version()

    @staticmethod
    def _kw(inputs, params):
        return dict(fla_option_kwargs(inputs, params), state_v_first=params.get("state_layout") == "v_first")

    def decode(self, inputs, params, pool, slot_of_sequence):
        cu = inputs["cu_seqlens"]
        if bool(((cu[1:] - cu[:-1]) > 1).any()):
            raise ValueError(self.multi_token_reason)
        o, _ = self.fwd(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], initial_state=pool,
                        inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=slot_of_sequence.to(torch.int32),
                        **self._kw(inputs, params))
        return o

    def verify(self, inputs, params, pool, state_indices, num_accepted, in_place=True):
        if not in_place:
            raise ValueError(self.per_token_reason)
        o, _ = self.fwd(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], initial_state=pool,
                        inplace_final_state=True, cu_seqlens=inputs["cu_seqlens"],
                        ssm_state_indices=state_indices.to(torch.int32).contiguous(),
                        num_accepted_tokens=num_accepted.to(torch.int32), **self._kw(inputs, params))
        return o, None

    def varlen(self, inputs, params):
        o, final = self.plain(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                              initial_state=inputs["initial_state"].float(), output_final_state=True,
                              cu_seqlens=inputs["cu_seqlens"], **self._kw(inputs, params))
        return o, final

    def prefill(self, inputs, params, initial_state):
        o, final = self.plain(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                              initial_state=initial_state.float(), output_final_state=True, **self._kw(inputs, params))
        return o, final


class FlaChunkIntermediateAdapter(ServingAdapter):
    """FLA's chunk_kda: with return_intermediate_states=True under torch.inference_mode(), h
    [B, NT, HV, K, V] (bf16), h[c] the state entering chunk c of 64 tokens; and its plain varlen
    call for the empty-sequence check."""

    requires_cuda = True
    _unpicklable = ("fn",)
    modes = ("intermediate", "varlen")
    golden_ops = CHECKPOINT_OPS
    policy = "fla-chunk-serving"  # policy/policies.json: o 3x, h 3x, the final state 4x the bf16 floor
    o_bound = PolicyBound("serving.checkpoints", "o")
    # chunk_kda's final state is fp32 storage but its contract rounds the state to bf16 as an
    # operand of w h and q h (docs/contracts.md, fla_chunk: state_operand): the policy table's
    # "chunk" rule, 4x the bf16 floor. The fp32 floor used before failed a correct kernel on an
    # H200 (1.34e-3 on the sequences with tokens, FLA bc3b101d); empty sequences stay bitwise.
    state_bound = PolicyBound("serving.checkpoints", "final_state")
    varlen_shape = dict(H=1, HV=2, K=16, V=32)
    warmup_weight = 100  # chunk_kda autotunes (warmup.cost_estimate)
    policy_reason = "chunked UT transform, bf16 products (2.0x-2.7x the bf16 floor on o), h stored in bf16"
    contract = "Triton; chunks of 64 in UT form, bf16 tensor-core products, h rounded to bf16"
    name = "fla.chunk_kda[serving]"

    def load(self):
        need_cuda()
        self.fn = load_fla(self.path_of("fla_path")).chunk_kda

    def version(self):
        return fla_version()

    def varlen(self, inputs, params):
        o, final = self.fn(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                           initial_state=inputs["initial_state"].float(), output_final_state=True,
                           cu_seqlens=inputs["cu_seqlens"], **FlaServingAdapter._kw(inputs, params))[:2]
        return o, final

    def intermediate_states(self, inputs, params, chunk):
        if chunk != 64:
            raise ValueError(f"chunk_kda's intermediate states are per 64-token chunk, the golden asks {chunk}")
        kw = FlaServingAdapter._kw(inputs, params)
        with torch.inference_mode():
            out = self.fn(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                          initial_state=inputs["initial_state"].float(), output_final_state=True,
                          return_intermediate_states=True, **kw)
        return out[2][0]


class FlashKdaVarlenAdapter(ServingAdapter):
    """FlashKDA's varlen forward (flash_kda.fwd, through the KDA adapter's call): K = V = 128, no
    GVA, its lower-bound gate, sigmoid beta, L2 norm, V-first state; the empty-sequence check."""

    requires_cuda = True
    modes = ("varlen",)
    golden_ops = ()
    name = "flashkda.fwd[varlen]"
    varlen_shape = dict(H=2, HV=2, K=128, V=128)
    varlen_params = dict(gate="lower_bound", gate_base="e", beta="sigmoid", qk_l2norm=True, scale=None,
                         lower_bound=-5.0, state_layout="v_first")
    policy = "flashkda-varlen"  # policy/policies.json: 4x the bf16 floor
    o_bound = PolicyBound("kda.recurrent", "o")
    state_bound = PolicyBound("kda.recurrent", "final_state")
    policy_reason = "chunk 16, fp16 Neumann inverse, bf16 state between chunks: 3.4x-3.5x the bf16 floor on o measured"
    contract = "CUTLASS (sm_90); chunks of 16, bf16 state between chunks, bf16 output"
    _unpicklable = ("inner",)
    # The KDA adapter of FlashKDA that this one wraps, by spec as the registry finds the built-ins
    # (the KDA adapters stand above the checks, this family's included).
    inner_spec = "k3ref.gpu_check.adapters:FlashKdaAdapter"

    def load(self):
        from .registry import resolve

        [self.inner] = resolve(self.inner_spec, self.run_options)
        self.inner.load()

    def version(self):
        return module_version("flash_kda")

    def varlen(self, inputs, params):
        return self.inner.run(inputs, params)


def serving_adapters():
    """The built-in serving adapters (register with `--adapter k3ref.gpu_check.serving_check:serving_adapters`)."""
    return [FlaServingAdapter("continuous_batching"), FlaServingAdapter("spec_decode"), FlaChunkIntermediateAdapter(),
            FlashKdaVarlenAdapter()]


def torch_serving_kernels():
    """The CPU serving kernel and its mutants (`--adapter k3ref.gpu_check.serving_check:torch_serving_kernels`)."""
    return [TorchServingAdapter(m) for m in TorchServingAdapter.MUTATIONS]


def load_serving_suite(directory):
    return golden_io.load_suite(directory, ops=POOL_OPS + GDN_POOL_OPS + REPLAY_OPS + CHECKPOINT_OPS + VARLEN_OPS)


# --------------------------------------------------------------------------- the engines' table

def engine_table(adapters, suite, device, checks=None):
    """Every serving check (or those of `checks`) of every adapter: one row per (kernel, check,
    case) with the verdict, the figure (worst error / bound), the bound's multiple and floor
    dtype, the reason and the engine source (version()). A kernel that does not load gives one
    row with its reason."""
    rows = []
    for a in adapters:
        start = time.perf_counter()
        try:
            a.load()
            source = a.version()
        except Exception as e:  # fail closed, one line; the other kernels still run
            rows.append(dict(kernel=a.name, check="load", case="-", verdict="unavailable", figure=None, bound=None,
                             reason=f"{type(e).__name__}: {e}".splitlines()[0][:400], source=""))
            continue
        for check in (c for c in SERVING_CHECKS if checks is None or c in checks):
            for case_id, case, why in a.cases(check, suite):
                if why:
                    rows.append(dict(kernel=a.name, check=check, case=case_id, verdict="n/a", figure=None, bound=None,
                                     reason=why[:400], source=source))
                    continue
                r = a.run_check(check, case, device)
                try:
                    bound = f"{a.o_bound.describe()} (o), {a.state_bound.describe()} (state)"
                except Exception as e:
                    bound = f"unreadable: {e}"
                rows.append(dict(kernel=a.name, check=check, case=case_id,
                                 verdict={"skip": "n/a"}.get(r.status, r.status), figure=r.ratio, bound=bound,
                                 reason=r.reason, source=source, seconds=round(r.seconds, 3), metrics=r.metrics))
        rows.append(dict(kernel=a.name, check="(all)", case="-", verdict="time", figure=None, bound=None,
                         reason=f"{time.perf_counter() - start:.1f} s", source=source))
    return rows


def apply_known_limitations(rows, entries):
    """The known-limitations registry on the engines' table, strictly, as the pytest plugin
    applies it: a failing row that an entry names becomes "known" (its reason the entry's); a
    passing one becomes "xpass" (the kernel was fixed, or the entry is wrong: either way the
    table no longer vouches for the registry), which fails the table."""
    from .collection import limitation_for

    out = []
    for r in rows:
        cases = [x["case"] for x in rows if x["kernel"] == r["kernel"] and x["check"] == r["check"]]
        known = limitation_for(entries, r["kernel"], r["check"], r["case"], cases) \
            if r["verdict"] in ("pass", "fail") else None
        if known and r["verdict"] == "fail":
            r = dict(r, verdict="known", reason=f"{known} (measured: {r['reason']})")
        elif known:
            r = dict(r, verdict="xpass", reason=f"passed, but the registry expects a failure: {known}")
        out.append(r)
    return out


FAILING = ("fail", "error", "unavailable", "xpass")
CELL_SYMBOLS = (("pass", "P"), ("known", "K"), ("fail", "F"), ("error", "E"), ("xpass", "X"))


def table_cells(rows):
    """{kernel: {check: cell}} over the rows (counts over cases: 2P 1K; "-" where not applicable;
    the reason for a kernel that did not load)."""
    cells = {}
    for k in dict.fromkeys(r["kernel"] for r in rows):
        mine = [r for r in rows if r["kernel"] == k]
        down = [r for r in mine if r["verdict"] == "unavailable"]
        if down:
            cells[k] = {"(load)": "unavailable: " + down[0]["reason"][:150]}
            continue
        cells[k] = {c: "".join(f"{n}{sym}" for v, sym in CELL_SYMBOLS
                               if (n := sum(r["verdict"] == v for r in mine if r["check"] == c))) or "-"
                    for c in SERVING_CHECKS}
    return cells


def measurement_of(rows, measured_on=None, commands=(), recorded=None):
    """The engines' table as a measurements/ file (k3ref.measurement's schema): the kernel x
    check cells, every row that is not a pass or n/a with its reason, and each kernel's source.
    Rows measured on another machine and merged here: measured_on names its device, and
    `recorded` holds the versions its row files recorded (measurement.versions() there)."""
    from .. import measurement

    cells = table_cells(rows)
    columns = [{"key": "kernel", "title": "kernel"}] + [{"key": c, "title": c} for c in SERVING_CHECKS]
    grid = [dict({"kernel": k}, **({c: v.get(c, v.get("(load)") if c == SERVING_CHECKS[0] else None)
                                    for c in SERVING_CHECKS})) for k, v in cells.items()]
    notable = [dict(kernel=r["kernel"], check=r["check"], case=r["case"], verdict=r["verdict"],
                    figure=r.get("figure"), reason=r["reason"][:400])
               for r in rows if r["verdict"] not in ("pass", "n/a", "time")]
    sources = [dict(kernel=k, source=next((r["source"] for r in rows if r["kernel"] == k and r.get("source")), None),
                    seconds=" + ".join(r["reason"] for r in rows if r["kernel"] == k and r["verdict"] == "time") or None)
               for k in cells]
    m = measurement.record(
        "h200_engine_serving", "The serving engines' own kernels under every serving check",
        tables={"cells": {"columns": columns, "rows": grid, "null": "-",
                          "caption": "counts over cases: P pass, K a known limitation (a finding), F fail, E error, "
                                     "X passed against the registry; - not applicable to the kernel's modes"},
                "notable": {"columns": [{"key": k, "title": k} for k in ("kernel", "check", "case", "verdict")]
                            + [{"key": "figure", "title": "error / bound", "format": "{:.3g}"},
                               {"key": "reason", "title": "reason"}], "rows": notable},
                "sources": {"columns": [{"key": "kernel", "title": "kernel"}, {"key": "source", "title": "source"},
                                        {"key": "seconds", "title": "checks' wall time"}], "rows": sources}},
        commands=list(commands))
    if measured_on:
        m["device"] = measured_on
    if recorded is not None:
        m["versions"] = {k: recorded.get(k) for k in m["versions"]}
    return m


def print_table(rows, out=None):
    """kernel x check: P passes, K known limitations, F failures, E errors, X passes against the
    registry, - n/a (counts over cases), last."""
    out = out or sys.stdout
    cells = table_cells(rows)
    width = max(map(len, cells)) if cells else 10
    out.write(f"{'kernel':<{width}}  " + "  ".join(f"{c[:12]:>12}" for c in SERVING_CHECKS) + "\n")
    for k, v in cells.items():
        if "(load)" in v:
            out.write(f"{k:<{width}}  {v['(load)']}\n")
            continue
        out.write(f"{k:<{width}}  " + "  ".join(f"{v[c]:>12}" for c in SERVING_CHECKS) + "\n")


def main(argv=None):
    """python3 -m k3ref.gpu_check.serving_check --engines [--only NAMES] [--vllm-path DIR]
    [--sglang-path DIR] [--tokenspeed-path DIR] [--fla-path DIR] [--goldens DIR] [--device cuda] [--out FILE.json];
    --list: the kernels' names; --merge FILE... --out FILE: the rows of several runs (one per
    kernel, as gpu_check/device_engines.sh runs them) in one file, and the table."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python3 -m k3ref.gpu_check.serving_check", description=main.__doc__)
    ap.add_argument("--engines", action="store_true", help="the serving engines' kernels (engine_vllm, engine_sglang, engine_tokenspeed)")
    ap.add_argument("--only", help="comma-separated kernel names")
    ap.add_argument("--list", action="store_true", help="print the kernels' names and exit")
    ap.add_argument("--checks", help="comma-separated serving checks (default: all of them), so that one kernel's "
                    "checks can run in several processes side by side")
    ap.add_argument("--skip-checks", help="comma-separated serving checks not to run")
    ap.add_argument("--merge", nargs="+", metavar="FILE", help="merge the rows of these files (a missing one: the "
                    "kernel named by its stem died; its .log's last line is the reason)")
    ap.add_argument("--vllm-path"), ap.add_argument("--sglang-path"), ap.add_argument("--tokenspeed-path")
    ap.add_argument("--fla-path")
    ap.add_argument("--goldens", default=str(Path(__file__).resolve().parents[3] / "goldens"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="the rows as JSON")
    ap.add_argument("--known-limitations", metavar="FILE", help="known-limitations file (default: the package's)")
    ap.add_argument("--measurement", metavar="FILE", help="also write the table as a measurements/ file")
    ap.add_argument("--measured-on", metavar="TEXT", help="the device the rows were measured on, for --measurement "
                    "with --merge of rows from another machine (default: this process's device)")
    args = ap.parse_args(argv)
    from .protocol import RunOptions, kernel_paths_of
    from .registry import ENGINE_SPECS, resolve  # the engines' modules import this one: named, not imported

    opts = RunOptions(device=args.device, kernel_paths=kernel_paths_of(vars(args)))
    specs = ENGINE_SPECS if args.engines else ("k3ref.gpu_check.serving_check:serving_adapters",)
    adapters = [a for spec in specs for a in resolve(spec, opts)]
    if args.only:
        wanted = set(args.only.split(","))
        adapters = [a for a in adapters if a.name in wanted]
    if args.list:
        print("\n".join(a.name for a in adapters))
        return 0
    from .. import measurement

    meta = dict(format="k3ref-serving-table", version=1, device=args.device, torch=torch.__version__,
                versions=measurement.versions())
    recorded = None
    if args.merge:
        rows = []
        for f in map(Path, args.merge):
            if f.is_file():
                part = json.loads(f.read_text())
                rows += part["rows"]
                # the first file's versions (an older file: its torch and triton lines)
                recorded = recorded or part.get("versions") or {k: part.get(k) for k in ("torch", "triton")}
            else:
                log = f.with_suffix(".log")
                last = (log.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1] if log.is_file() \
                    else "(no log)"
                rows.append(dict(kernel=f.stem, check="load", case="-", verdict="unavailable", figure=None, bound=None,
                                 reason=f"its process died or ran out of time: {last[:300]}", source=""))
    else:
        checks = set(args.checks.split(",")) if args.checks else set(SERVING_CHECKS)
        skipped = set(args.skip_checks.split(",")) if args.skip_checks else set()
        unknown = sorted((checks | skipped) - set(SERVING_CHECKS))
        if unknown:
            print(f"serving_check: unknown check {', '.join(unknown)} (the checks: {', '.join(SERVING_CHECKS)})",
                  file=sys.stderr)
            return 2
        rows = engine_table(adapters, load_serving_suite(args.goldens), args.device, checks - skipped)
    from .collection import load_limitations

    try:
        rows = apply_known_limitations(rows, load_limitations(args.known_limitations))
    except ValueError as e:
        print(f"serving_check: {e}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(meta, rows=rows), indent=1, default=str))
    if args.measurement:
        command = " ".join(["python3 -m k3ref.gpu_check.serving_check", *(argv or sys.argv[1:])])
        measurement.write(measurement_of(rows, args.measured_on, [command], recorded), args.measurement)
    for r in rows:
        if r["verdict"] in FAILING:
            print(f"{r['verdict'].upper()} {r['kernel']} {r['check']}[{r['case']}]: {r['reason'][:300]}")
    print_table(rows)
    return 1 if any(r["verdict"] in FAILING for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
