"""A CPU emulation, in PyTorch fp32, of what FLA's fused_recurrent_kda_fwd and
fused_recurrent_kda do with their serving arguments, as docs/serving.md states them (read from
fla/ops/kda/fused_recurrent.py; no FLA code here). It has the same parameter names, so the
FLA serving adapters (python/k3ref/gpu_check/serving_check.py) can be wired to it on the CPU:
that tests their calls, and predicts the verdicts of the real kernel. Reads outside the pool
or the index table (index -1, accepted count 0 on row 0) yield NaN states; stores outside an
allocation are dropped and counted in `stray_stores`; a final-state row never stored holds NaN
(the wrapper's torch.empty)."""
import torch

from k3ref.gpu_check import torch_model as reference  # the PyTorch recurrence, a kernel model

stray_stores = []


def _decays_and_betas(q, k, v, g, beta, A_log, dt_bias, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                      use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound):
    params = dict(qk_l2norm=use_qk_l2norm_in_kernel, beta="as_given", gate="log_decay", lower_bound=lower_bound)
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta)
    if use_gate_in_kernel:
        params["gate"] = "lower_bound" if lower_bound is not None else "softplus"
        inputs["A_log"] = A_log
        if dt_bias is not None:
            inputs["dt_bias"] = dt_bias.reshape(v.shape[2], k.shape[3])
    if use_beta_sigmoid_in_kernel:
        params["beta"] = "two_sigmoid" if allow_neg_eigval else "sigmoid"
    return [x.float() for x in reference.prepare(inputs, params)]


def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                            output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
                            ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                            use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                            lower_bound=None, out=None, **kwargs):
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    qf, kf, vf, decay, bf = _decays_and_betas(q, k, v, g, beta, A_log, dt_bias, use_qk_l2norm_in_kernel,
                                              use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                              lower_bound)
    o = torch.zeros_like(v) if out is None else out
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if inplace_final_state:
        assert initial_state is not None
        final = initial_state
    elif output_final_state:
        final = torch.full(shape, float("nan"), dtype=torch.float32, device=q.device)
    else:
        final = None
    batching = ssm_state_indices is not None
    flat = ssm_state_indices.reshape(-1).tolist() if batching else []
    row = ssm_state_indices.stride(0) if batching else 1
    accepted = num_accepted_tokens.tolist() if num_accepted_tokens is not None else None
    head = torch.arange(HV) // (HV // H)
    cu = cu_seqlens.tolist() if cu_seqlens is not None else [n * T for n in range(N + 1)]

    def slot_of(position):  # index table entry, or None for a read outside the table
        return flat[position] if 0 <= position < len(flat) else None

    def to_k_first(x):
        return x.transpose(-1, -2) if state_v_first else x

    for n in range(N):
        bos, eos = cu[n], cu[n + 1]
        if eos == bos:
            continue  # returns before reading or storing anything
        b, t0 = (0, bos) if cu_seqlens is not None else (n, 0)
        if initial_state is None:
            S = torch.zeros(HV, K, V)
        elif batching:
            s = slot_of(n * row + ((accepted[n] - 1) if accepted is not None else 0))
            S = (to_k_first(initial_state[s].float()).clone() if s is not None and 0 <= s < initial_state.shape[0]
                 else torch.full((HV, K, V), float("nan")))
        else:
            S = to_k_first(initial_state[n].float()).clone()
        for t in range(eos - bos):
            i = t0 + t
            S = decay[b, i][:, :, None] * S
            kt = kf[b, i][head]
            u = bf[b, i][:, None] * (vf[b, i] - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt[:, :, None] * u[:, None, :]
            o[b, i] = torch.einsum("hkv,hk->hv", S, scale * qf[b, i][head]).to(o.dtype)
            if batching:
                target = slot_of(n * row + t) if inplace_final_state else bos + t
                if target is None or not 0 <= target < final.shape[0]:
                    stray_stores.append((n, t, target))
                else:
                    final[target] = (S.transpose(-1, -2) if state_v_first else S).to(final.dtype)
        if not batching and final is not None:
            final[n] = (S.transpose(-1, -2) if state_v_first else S).to(final.dtype)
    return o, final


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, state_v_first=False,
                        cu_seqlens=None, **kwargs):
    # The serving arguments, if given, land in kwargs and are not passed on.
    if cu_seqlens is not None and initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError("The number of initial states is expected to be equal to the number of input sequences")
    return fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                                   scale=scale, output_final_state=output_final_state, inplace_final_state=False,
                                   state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                   use_gate_in_kernel=use_gate_in_kernel,
                                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                   allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
              use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
              cu_seqlens=None, lower_bound=None, A_log=None, dt_bias=None, chunk_size=64,
              return_intermediate_states=False, **kwargs):
    """chunk_kda's results without its chunked arithmetic: (o, final_state[, h]), h [B, NT, HV, K, V]
    (V-first: [B, NT, HV, V, K]) in bf16, h[c] the state entering chunk c. Empty varlen sequences
    keep their initial state here (what chunk_kda really does there is for the GPU run to say)."""
    kw = dict(A_log=A_log, dt_bias=dt_bias, scale=scale, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
              use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
              lower_bound=lower_bound)
    o, final = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                       inplace_final_state=False, **kw)
    if cu_seqlens is not None and initial_state is not None:
        cu = cu_seqlens.tolist()
        for n in range(len(cu) - 1):
            if cu[n + 1] == cu[n]:
                final[n] = initial_state[n]
    if not return_intermediate_states:
        return o, final
    assert cu_seqlens is None and q.shape[0] == 1, "the emulation's h covers one sequence"
    T = q.shape[1]
    h = [initial_state[0].float()]
    for c in range(1, (T + chunk_size - 1) // chunk_size):
        part = [x[:, : c * chunk_size] for x in (q, k, v, g, beta)]
        h.append(fused_recurrent_kda_fwd(*part, initial_state=initial_state, output_final_state=True,
                                         inplace_final_state=False, **kw)[1][0])
    return o, final, torch.stack(h)[None].to(torch.bfloat16)
