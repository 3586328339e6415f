"""Adapter and golden checks for a Quantile Balancing implementation: torchtitan's
`torchtitan/models/kimi_k3/quantile_balance.py` (pure PyTorch; runs on the CPU too).

Conventions (docs/qb.md against torchtitan's module, read at pytorch/torchtitan f0f2e698):
- torchtitan ADDS its bias (`topk(scores + bias_E, k + 1)`); k3ref SUBTRACTS beta. So
  bias = -beta, and torchtitan mean-centres every bias it returns: bias_t = mean(beta_t) - beta_t.
- Its cutoff is the (k+1)-th largest biased score: alpha_t + mean(beta_{t-1}) in k3ref's terms.
- Its exact bias `quantile_balance_bias` is `-quantile(s - cutoff, 1 - k/n, 'lower')` per
  expert: with q = m k / n an integer, the 'lower' order statistic at index
  floor((1 - k/n)(m - 1)) = m - 1 - q of the ascending margins is the (q+1)-th largest, so
  it is k3ref's beta_j (the margins are formed in fp32: exact for bf16 scores in (0, 1)).
- `quantile_balance_bias_histogram` reads the quantile from a per-expert histogram of the
  margins over [lo, hi]: the crossing bin holds the exact order statistic (proof in
  docs/gpu_check.md), so |bias_hist - bias_exact| <= bin width before centring, and
  <= 2 bin widths after.

Tolerances: biases and cutoffs within 64 fp32 ulps of max(1, max|beta|) (fp32 margins and an
fp32 mean over n values); selections equal as sets for every token whose k-th and (k+1)-th
biased scores are further apart than that tolerance (torch.topk breaks exact ties its own
way, k3ref by its documented rule); loads equal when no token is such a tie.
"""
import importlib
import importlib.util
import time
from pathlib import Path

import torch

from .. import policy
from .protocol import Adapter, CheckResult

# The table's rule for exact real values (64 fp32 ulps of max(1, max |golden|)): the biases and
# cutoffs of either variant, judged by the one judge on their max abs error.
EXACT = "qb-exact"


def judged(op, tensor, max_abs, scale):
    """(passed, bound) of a max abs error under qb-exact's rule for `tensor` of `op`, at
    `scale` = max(1, max |golden|) (policy.judge_figures; a NaN error fails)."""
    r = policy.judge_figures({"max_abs": max_abs, "count": 1}, op, tensor, EXACT, ulp_scale=scale)
    return r.passed, r.bound


def _load_module_from(path):
    spec = importlib.util.spec_from_file_location("k3gc_torchtitan_quantile_balance", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class TorchtitanQbAdapter(Adapter):
    """torchtitan's exact quantile bias (`histogram=False`) or its histogram estimate."""

    family = "qb"
    kind = "kernel"
    golden_ops = ("qb.solver", "qb.online")
    contract = "PyTorch; fp32 margins and means, torch.topk and torch.quantile ('lower')"
    _unpicklable = ("mod",)
    RELATIVE = Path("torchtitan") / "models" / "kimi_k3" / "quantile_balance.py"

    def __init__(self, histogram=False, num_bins=512):
        self.histogram = histogram
        self.num_bins = num_bins
        self.name = "torchtitan.quantile_balance" + (f"[histogram{num_bins}]" if histogram else "")
        self.policy = "qb-histogram" if histogram else "qb-exact"
        self.policy_reason = ("2 histogram bin widths on the centred bias (the crossing bin holds the exact quantile)"
                              if histogram else "64 fp32 ulps on biases and cutoffs; selections equal outside ties")
        super().__init__()

    def probe(self, device):
        if any(c.exists() for c in self._candidates()):
            return None
        return ("torchtitan's kimi_k3/quantile_balance.py not found (install torchtitan or pass --torchtitan-path "
                "to a checkout)")

    def load(self):
        # The module file alone: importing the torchtitan package pulls in its whole model
        # zoo (and a recent torch); quantile_balance.py needs only torch.
        candidates = self._candidates()
        for c in candidates:
            if c.exists():
                self.mod = _load_module_from(c)
                self.path = str(c)
                return
        raise ImportError("torchtitan's kimi_k3/quantile_balance.py not found (install torchtitan or pass "
                          "--torchtitan-path to a checkout); looked in: " + (", ".join(map(str, candidates)) or "none"))

    def _candidates(self):
        candidates = []
        root = self.path_of("torchtitan_path")
        if root:
            candidates.append(Path(root) / self.RELATIVE)
        spec = importlib.util.find_spec("torchtitan")
        if spec and spec.submodule_search_locations:
            candidates += [Path(p).parent / self.RELATIVE for p in spec.submodule_search_locations]
        return candidates

    def supports(self, case):
        return case.op in self.golden_ops

    def run_check(self, check, case, device):
        return self.check(case, device)

    # ------------------------------------------------------------------ the runs

    def bias_from(self, scores, cutoff, k):
        """(bias, histogram bin width or 0). The histogram's range [lo, hi] is chosen to hold
        every margin (torchtitan clamps margins outside it into the end bins)."""
        if not self.histogram:
            return self.mod.quantile_balance_bias(scores, cutoff, k), 0.0
        margins = (scores - cutoff.unsqueeze(-1)).float()
        lo, hi = float(margins.min()) - 1e-3, float(margins.max()) + 1e-3
        counts = self.mod.margin_histogram(scores, cutoff, num_bins=self.num_bins, lo=lo, hi=hi)
        return self.mod.quantile_balance_bias_histogram(counts, k, lo=lo, hi=hi), (hi - lo) / self.num_bins

    def check(self, case, device="cpu"):
        t0 = time.time()
        try:
            res = self._check_solver(case, device) if case.op == "qb.solver" else self._check_online(case, device)
        except Exception as e:
            res = CheckResult(self.name, "golden", case.name, "error", f"{type(e).__name__}: {e}"[:300])
        res.seconds = time.time() - t0
        return res


    def _scores(self, case, device):
        t = case.tensors
        if "scores" in t:
            s = t["scores"].to(torch.float64)
        else:  # the K3 case: scores = x w^T + u, exact in float64 (docs/qb.md)
            s = t["x"].double() @ t["w"].double().T + t["u"].double()[None, :]
        return s.to(device)

    def _check_solver(self, case, device):
        p = case.params
        k, iters = int(p["k"]), int(p["iterations"])
        s64 = self._scores(case, device)
        s = s64.float()
        if not torch.equal(s.double(), s64):
            return CheckResult(self.name, "golden", case.name, "skip", "scores are not exact in fp32")
        m, n = s.shape
        beta_ref = case.tensors["beta"].double()    # [T, n]
        alpha_ref = case.tensors["alpha"].double()  # [T, m]
        # One scale for both (the solver's real outputs together), as the tolerance of a tie.
        scale = max(1.0, float(beta_ref.abs().max()), float(alpha_ref.abs().max()))
        tol = judged("qb.solver", "beta", 0.0, scale)[1]
        worst_bias = worst_cut = worst_bins = 0.0
        tie_tokens = mismatched = 0
        loads_equal = True
        sel_its = [int(i) for i in case.tensors["selection_iterations"].tolist()]
        bias = torch.zeros(n, dtype=torch.float32, device=device)
        prev_mean = 0.0
        for t in range(iters):
            if self.histogram:
                # Same cutoffs as the reference for every iteration: the estimate is judged
                # per step, not along its own trajectory (which may drift by design).
                bias = (-(beta_ref[t - 1] - beta_ref[t - 1].mean())).float().to(device) if t else bias
                prev_mean = float(beta_ref[t - 1].mean()) if t else 0.0
            _, cutoff = self.mod.topk_with_cutoff(s, bias, k)
            cut_err = float((cutoff.double().cpu() - (alpha_ref[t] + prev_mean)).abs().max())
            worst_cut = max(worst_cut, cut_err)
            new_bias, width = self.bias_from(s, cutoff, k)
            want = -(beta_ref[t] - beta_ref[t].mean())
            err = float((new_bias.double().cpu() - want).abs().max())
            worst_bias = max(worst_bias, err)
            if width:
                worst_bins = max(worst_bins, err / width)
            if not self.histogram:
                bias = new_bias.float()
                prev_mean = float(beta_ref[t].mean())
            if t + 1 in sel_its and not self.histogram:
                ids, _ = self.mod.topk_with_cutoff(s, bias, k)
                ref_sel = case.tensors["selection"][sel_its.index(t + 1)].long()
                biased = s64.cpu() - beta_ref[t][None, :]
                top = biased.sort(dim=1, descending=True).values
                near_tie = (top[:, k - 1] - top[:, k]).abs() <= 2 * tol
                same = torch.sort(ids.cpu(), 1).values.eq(torch.sort(ref_sel, 1).values).all(1)
                tie_tokens += int(near_tie.sum())
                mismatched += int((~same & ~near_tie).sum())
                if not bool(near_tie.any()):
                    loads = torch.bincount(ids.reshape(-1).cpu(), minlength=n)
                    loads_equal &= torch.equal(loads, case.tensors["loads"][t].long())
        cut_ok = judged("qb.solver", "alpha", worst_cut, scale)[0]
        if self.histogram:
            # Bin widths of this run: a bound no table entry can hold (docs/tolerances.md).
            ok = worst_bins <= 2 and cut_ok
            reason = (f"{iters} iterations from the reference's cutoffs: max |bias - exact| {worst_bias:.3e} = "
                      f"{worst_bins:.3g} bin widths ({'<=' if worst_bins <= 2 else '>'} 2); "
                      f"max cutoff error {worst_cut:.3e} (tolerance {tol:.3e})")
            return CheckResult(self.name, "golden", case.name, "pass" if ok else "fail", reason,
                               ratio=worst_bins / 2)
        ok = judged("qb.solver", "beta", worst_bias, scale)[0] and cut_ok and mismatched == 0 and loads_equal
        reason = (f"{iters} iterations: max |bias + (beta - mean beta)| {worst_bias:.3e}, max cutoff error "
                  f"{worst_cut:.3e} (tolerance {tol:.3e}); selections: {mismatched} tokens differ outside ties "
                  f"({tie_tokens} near-tie tokens not compared); loads {'equal' if loads_equal else 'DIFFER'}")
        return CheckResult(self.name, "golden", case.name, "pass" if ok else "fail", reason,
                           ratio=max(worst_bias, worst_cut) / tol)

    def _check_online(self, case, device):
        # Online QB with 1 iteration per batch, warm start, mean-centred: exactly torchtitan's
        # per-step rule (bias of batch t, solved on batch t from the bias that routed it,
        # routes batch t + 1).
        p = case.params
        if self.histogram or not (p.get("iterations_per_batch") == 1 and p.get("warm_start") and p.get("center_bias")):
            return CheckResult(self.name, "golden", case.name, "skip",
                               "online goldens are compared with the exact bias, 1 warm-started iteration per batch")
        k = int(p["k"])
        aff = case.tensors["affinities"].float().to(device)
        want_bias = case.tensors["qb_beta"].double()  # [B, n] k3ref's beta (subtracted) that routed batch t
        scale = max(1.0, float(want_bias.abs().max()))
        tol = judged("qb.online", "qb_beta", 0.0, scale)[1]
        bias = torch.zeros(aff.shape[2], dtype=torch.float32, device=device)
        worst = 0.0
        mismatched = ties = 0
        for b in range(aff.shape[0]):
            worst = max(worst, float((bias.double().cpu() + want_bias[b]).abs().max()))
            ids, cutoff = self.mod.topk_with_cutoff(aff[b], bias, k)
            biased = aff[b].double().cpu() - want_bias[b][None, :]
            top = biased.sort(dim=1, descending=True).values
            near_tie = (top[:, k - 1] - top[:, k]).abs() <= 2 * tol
            same = torch.sort(ids.cpu(), 1).values.eq(torch.sort(case.tensors["qb_selection"][b].long(), 1).values).all(1)
            mismatched += int((~same & ~near_tie).sum())
            ties += int(near_tie.sum())
            bias = self.mod.quantile_balance_bias(aff[b], cutoff, k).float()
        ok = judged("qb.online", "qb_beta", worst, scale)[0] and mismatched == 0
        return CheckResult(self.name, "golden", case.name, "pass" if ok else "fail",
                           f"{aff.shape[0]} batches: max |bias + beta| {worst:.3e} (tolerance {tol:.3e}); "
                           f"{mismatched} token selections differ outside ties ({ties} near-tie tokens)",
                           ratio=worst / tol)


def torchtitan_adapters():
    """torchtitan's Quantile Balancing: its own loads, and with the histogram argument."""
    return [TorchtitanQbAdapter(), TorchtitanQbAdapter(histogram=True)]
