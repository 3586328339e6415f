"""CPU stand-ins of libk3gc's fp32 KDA kernel and its four scale mutants, for the scale tier's
host-side tests (test_scale.py): the PyTorch recurrence, with the mutant's mistake at the
limits given. `tier_standins` gives them at the run's limits (--k3ref-scale-limits), as an
adapter spec for `--k3ref-tier scale` (`--k3ref-adapter scale_standins:tier_standins`); `exits`
is a mutant that ends its process in every case (a crash of a mutant's case is a catch)."""
import os

import torch

from k3ref import kernel_domains_file
from k3ref.gpu_check import problems, scale, torch_model
from k3ref.gpu_check.adapters import KdaAdapter

TILE = 16  # libk3gc's fp32 kernel stages 16 tokens at a time (its read-past mutant's tile)


def _storage_after(t):
    """t's elements followed by whatever its storage holds after them (flat)."""
    st = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    size = (st.nbytes() // t.element_size()) if hasattr(st, "nbytes") else st.size()
    return torch.as_strided(t, (size - t.storage_offset(),), (1,), t.storage_offset())


class StandIn(KdaAdapter):
    """The PyTorch recurrence, bf16 output, fp32 state; with `mutation`, the CPU form of that
    libk3gc scale mutant (k3gc.h) at `limits`."""

    accepts_out = True
    policy = "recurrent"

    def __init__(self, mutation=None, limits=scale.FULL):
        super().__init__()
        self.mutation, self.limits = mutation, limits
        self.name = "standin" + (f".{mutation}" if mutation else "")
        self.kind = "mutant" if mutation else "kernel"
        self.domain = kernel_domains_file.builtin("torch.fp64_bf16")
        # the correct one has a backward (autograd through the fp64 recurrence; the roundings
        # pass gradients through): the gradients case's kernel; the mutants have none
        self.gradients = None if mutation else "autograd"

    def run(self, inputs, params, out=None):
        L, m = self.limits, self.mutation
        if m == "exits":
            os._exit(3)
        x = dict(inputs)
        hook = None
        if m == "bf16_state_long_t":
            hook = lambda pos, S: S.to(torch.bfloat16).to(torch.float64) if pos >= L.window else S  # noqa: E731
        if m == "int32_offset_wrap":  # offsets wrap modulo the limit: reads past it come from the start
            for n in problems.TOKEN_INPUTS:
                t = x[n]
                if t.numel() > L.index:
                    x[n] = t.reshape(-1)[torch.arange(t.numel()) % L.index].view(t.shape)
        o, final = torch_model.kda_forward(x, params, state_hook=hook)
        o, final = o.to(torch.bfloat16), final.float()
        buf = out if out is not None else torch.zeros_like(o)
        HV = o.shape[2]
        seqs = torch_model.sequences(inputs)
        if m == "int32_offset_wrap" and o.numel() > L.index:
            flat, src = buf.reshape(-1), o.reshape(-1)
            flat[: L.index] = src[: L.index]
            flat[: src.numel() - L.index] = src[L.index :]  # the wrapped writes land at the start
            return buf, final
        if m == "grid_drops_sequences":
            for n, (b, begin, end) in enumerate(seqs):
                for hv in range(HV):
                    if n * HV + hv >= L.grid:  # never computed: the buffer and an unwritten state stay
                        o[b, begin:end, hv] = buf[b, begin:end, hv]
                        final[n, hv] = 0
        if m == "last_chunk_read_past_end":
            H = inputs["q"].shape[2]
            T = inputs["q"].shape[1]
            for n, (b, begin, end) in enumerate(seqs):
                count = (end - begin) - TILE * ((end - begin - 1) // TILE) if end > begin else 0
                if not 1 <= count <= TILE // 2:
                    continue
                rows = range(b * T + end, b * T + end + TILE - count)  # flat token rows read past the end
                for hv in range(HV):
                    bad = False
                    for name, head, width in (("k", hv // (HV // H), inputs["k"].shape[3]),
                                              ("v", hv, inputs["v"].shape[3]), ("g", hv, inputs["g"].shape[3]),
                                              ("beta", hv, 1)):
                        t = inputs[name]
                        per_token = t[0, 0].numel()
                        mem = _storage_after(t)
                        for r in rows:
                            lo = r * per_token + head * width
                            if lo + width <= mem.numel():
                                bad = bad or not bool(torch.isfinite(mem[lo : lo + width].double()).all())
                    if bad:  # 0 * NaN in the state's update: the whole state of the head is NaN
                        final[n, hv] = float("nan")
        buf.copy_(o)
        return buf, final


def tier_standins(run_options):
    """The correct stand-in and the four scale mutants' at the run's limits."""
    L = scale.limits_of(run_options)
    return [StandIn(None, L)] + [StandIn(m, L) for m in scale.lib.SCALE_MUTANTS]


def exiting_mutant(run_options):
    return StandIn("exits", scale.limits_of(run_options))
