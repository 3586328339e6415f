"""The KDA layer in NumPy (float64), written from docs/kda-layer.md: projections, the short
convolution per document from its entering window, SiLU, the KDA stages and recurrence of
this oracle (stages, run), the gated RMSNorm and the output projection.

The layer's known defects are modelled as mutants (`mutant=`), so the cross-check can show
that the goldens catch each:

    mask_overrides_cu_seqlens  documents taken from the attention mask even when cu_seqlens
                               are given (an all-ones mask makes one document of the batch)
    conv_state_dropped         the convolution starts from zeros instead of the entering
                               conv state (the state not carried across a decode step)
    gate_not_repeated          value head hv reads the gate and beta of value head hv // (HV / H),
                               as if they were per q/k head (not repeated per value head)
    gate_before_norm           the output gate applied before the RMSNorm instead of after

`rounding` (a function of an array) models a kernel's precision: it is applied where a bf16
layer kernel rounds (every projection, the convolution's output, the recurrence's output,
the norm's output, y); the recurrence and the norm themselves stay in float64.
"""
import numpy as np

from oracle import run, sigmoid, stages, wide

MUTANTS = ("mask_overrides_cu_seqlens", "conv_state_dropped", "gate_not_repeated", "gate_before_norm")
WEIGHTS = ("q_proj", "k_proj", "v_proj", "q_conv", "k_conv", "v_conv", "q_conv_bias", "k_conv_bias", "v_conv_bias",
           "f_a", "f_b", "b_proj", "A_log", "dt_bias", "g_a", "g_b", "g_bias", "norm_weight", "o_proj")


def silu(x):
    return x * sigmoid(x)


class Layer:
    def __init__(self, t, p, mutant=None, rounding=None):
        assert mutant is None or mutant in MUTANTS, mutant
        self.round = rounding or (lambda x: x)
        self.w = {n: wide(t[n]) for n in WEIGHTS if n in t}
        self.p, self.mutant = p, mutant
        self.H, self.HV, self.K, self.V, self.W = p["H"], p["HV"], p["K"], p["V"], p["conv_size"]
        self.C = 2 * self.H * self.K + self.HV * self.V
        self.M = max(self.W - 1, 0)

    def lin(self, x, name, bias=None):
        y = x @ self.w[name].T
        return self.round(y + self.w[bias] if bias and bias in self.w else y)

    def conv(self, x, state):
        """One document's conv inputs x [L, C] from its entering window state [C, W - 1]:
        outputs [L, C] (activated) and the window after each token [L, C, W - 1]."""
        L = x.shape[0]
        if self.W == 0:
            y = x if self.p["activation"] == "none" else silu(x)
            return y, np.zeros((L, self.C, 0))
        weight = np.concatenate([self.w["q_conv"], self.w["k_conv"], self.w["v_conv"]])
        bias = np.concatenate([self.w.get(n, np.zeros(d)) for n, d in
                               (("q_conv_bias", self.H * self.K), ("k_conv_bias", self.H * self.K),
                                ("v_conv_bias", self.HV * self.V))])
        if self.mutant == "conv_state_dropped":
            state = np.zeros_like(state)
        window = np.concatenate([state, x.T], axis=1)  # [C, W - 1 + L], oldest first
        y = np.stack([bias + (weight * window[:, t : t + self.W]).sum(1) for t in range(L)]) if L else np.zeros((0, self.C))
        tape = np.stack([window[:, t + 1 : t + 1 + self.M] for t in range(L)]) if L else np.zeros((0, self.C, self.M))
        return self.round(y if self.p["activation"] == "none" else silu(y)), tape

    def document(self, x, S0, conv0):
        """One document x [L, D] from recurrent state S0 [HV, K, V] (K-first) and conv window
        conv0 [C, W - 1]: y [L, D], the recurrent state and the conv window after each token."""
        L, HK, HV, K, V = x.shape[0], self.H * self.K, self.HV, self.K, self.V
        pre = np.concatenate([self.lin(x, "q_proj"), self.lin(x, "k_proj"), self.lin(x, "v_proj")], axis=1)
        mixed, conv_tape = self.conv(pre, conv0)
        g = self.lin(self.lin(x, "f_a"), "f_b") if "f_a" in self.w else self.lin(x, "f_b")
        beta = self.lin(x, "b_proj")
        g, beta = g.reshape(L, HV, K), beta.reshape(L, HV)
        if self.mutant == "gate_not_repeated":
            group = HV // self.H
            g, beta = g[:, [hv // group for hv in range(HV)]], beta[:, [hv // group for hv in range(HV)]]
        t = {"q": mixed[None, :, :HK].reshape(1, L, self.H, K), "k": mixed[None, :, HK : 2 * HK].reshape(1, L, self.H, K),
             "v": mixed[None, :, 2 * HK :].reshape(1, L, HV, V), "g": g[None], "beta": beta[None]}
        if "A_log" in self.w:
            t["A_log"] = self.w["A_log"]
        if "dt_bias" in self.w:
            t["dt_bias"] = self.w["dt_bias"].reshape(HV, K)
        kp = {"qk_l2norm": self.p["qk_l2norm"], "gate": self.p["gate"], "lower_bound": self.p["lower_bound"],
              "gate_base": "e", "beta": self.p["beta"], "scale": None}
        q, k, v, decay, b, scale = stages(t, kp)
        o, states = np.zeros((L, HV, V)), np.zeros((L, HV, K, V))
        final = run(q[0], k[0], v[0], decay[0], b[0], scale, S0, range(L), o, states)
        o = self.round(o)
        if self.p["output_norm"]:
            z = None
            if "g_b" in self.w:
                z = (self.lin(self.lin(x, "g_a"), "g_b", "g_bias") if "g_a" in self.w
                     else self.lin(x, "g_b", "g_bias")).reshape(L, HV, V)
            if self.mutant == "gate_before_norm" and z is not None:
                o = o * sigmoid(z)
            o = o / np.sqrt((o * o).mean(-1, keepdims=True) + self.p["norm_eps"])
            if "norm_weight" in self.w:
                o = o * self.w["norm_weight"]
            if self.mutant != "gate_before_norm" and z is not None:
                o = o * sigmoid(z)
        y = self.round(self.round(o).reshape(L, HV * V) @ self.w["o_proj"].T)
        conv_final = conv_tape[-1] if L else conv0
        return y, final, states, conv_final, conv_tape

    # ---- the three operators ----

    def forward(self, t):
        """layer.kda: {"y", "final_state", "final_conv_state"}."""
        p, x = self.p, wide(t["hidden_states"])
        B, T, D = x.shape
        mask = t.get("attention_mask")
        cu = [int(c) for c in t["cu_seqlens"]] if "cu_seqlens" in t else None
        if cu is not None and not (self.mutant == "mask_overrides_cu_seqlens" and mask is not None):
            docs = [(0, [*range(cu[n], cu[n + 1])]) for n in range(len(cu) - 1)]
        else:  # the mask (or every token) of each row
            docs = [(b, [s for s in range(T) if mask is None or mask[b, s] != 0]) for b in range(B)]
        N = len(docs)
        h0, c0 = t.get("initial_state"), t.get("initial_conv_state")
        y = np.zeros((B, T, D))
        final, conv_final = np.zeros((N, self.HV, self.K, self.V)), np.zeros((N, self.C, self.M))
        for n, (b, rows) in enumerate(docs):
            S0 = wide(h0[n]) if h0 is not None and n < len(h0) else np.zeros((self.HV, self.K, self.V))
            w0 = wide(c0[n]) if c0 is not None and n < len(c0) else np.zeros((self.C, self.M))
            yn, final[n], _, conv_final[n], _ = self.document(x[b, rows], S0, w0)
            y[b, rows] = yn
        return {"y": y, "final_state": final, "final_conv_state": conv_final}

    def pooled(self, t, op):
        """layer.kda_decode / layer.kda_verify over the pools: {"y", "pool_out", "conv_pool_out"
        [, "token_states", "conv_tape"]}."""
        slots, stride, offset, v_first = (int(g) for g in t["pool_geometry"])
        HV, K, V = self.HV, self.K, self.V
        pool, conv_pool = wide(t["pool"]).copy(), wide(t["conv_pool"]).copy()

        def read(s):
            block = pool[offset + s * stride : offset + s * stride + HV * K * V]
            return block.reshape(HV, V, K).transpose(0, 2, 1).copy() if v_first else block.reshape(HV, K, V).copy()

        def stored(state):
            return state.transpose(0, 2, 1) if v_first else state

        def write(s, state):
            pool[offset + s * stride : offset + s * stride + HV * K * V] = stored(state).reshape(-1)

        x = wide(t["hidden_states"])
        cu = [int(c) for c in t["cu_seqlens"]]
        y = np.zeros((x.shape[0], x.shape[1]))
        out = {}
        if op == "layer.kda_decode":
            for n, slot in enumerate(int(s) for s in t["slot_of_sequence"]):
                if cu[n] == cu[n + 1] or slot == -1:
                    continue
                y[cu[n] : cu[n + 1]], S, _, conv, _ = self.document(x[cu[n] : cu[n + 1]], read(slot), conv_pool[slot].copy())
                write(slot, S)
                conv_pool[slot] = conv
        else:
            idx, accepted = t["state_indices"].astype(int), [int(a) for a in t["num_accepted"]]
            per_token = "token_states" in t
            token_states = np.zeros((x.shape[0], HV, V, K) if v_first else (x.shape[0], HV, K, V))
            tape_out = np.zeros((x.shape[0], self.C, self.M))
            writes = []
            for n in range(len(cu) - 1):
                if cu[n] == cu[n + 1]:
                    continue
                enter = idx[n, accepted[n] - 1]
                if enter == -1:
                    continue
                yn, _, states, _, tape = self.document(x[cu[n] : cu[n + 1]], read(enter), conv_pool[enter].copy())
                y[cu[n] : cu[n + 1]] = yn
                for j in range(cu[n + 1] - cu[n]):
                    if per_token:
                        token_states[cu[n] + j] = stored(states[j])
                        tape_out[cu[n] + j] = tape[j]
                    elif idx[n, j] != -1:
                        writes.append((idx[n, j], states[j], tape[j]))
            for s, state, tape in writes:  # after every sequence read its entering slot
                write(s, state)
                conv_pool[s] = tape
            if per_token:
                out["token_states"], out["conv_tape"] = token_states, tape_out
        out.update({"y": y, "pool_out": pool, "conv_pool_out": conv_pool})
        return out


def layer_outputs(t, p, op, mutant=None, rounding=None):
    """The outputs of a layer golden's operator `op` from its tensors t and parameters p."""
    layer = Layer(t, p, mutant, rounding)
    return layer.forward(t) if op == "layer.kda" else layer.pooled(t, op)
