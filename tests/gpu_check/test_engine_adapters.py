#!/usr/bin/env python3
"""Host-side tests of the serving engines' adapters (python/k3ref/gpu_check/engine_vllm.py,
engine_sglang.py, engine_tokenspeed.py). Their kernels are Triton (GPU only), so here each is replaced by a
stand-in module laid out where the engine keeps it, with the engine function's signature and
k3ref's pure-PyTorch serving kernel (serving_check.TorchServingAdapter) behind it:

- loading (vLLM, SGLang, TokenSpeed): a missing folder, a missing file and another engine copy already imported are
  one-line errors naming what is needed; the package __init__ files are never run (the
  stand-in tokenspeed_kernel/__init__.py raises);
- argument mapping: every engine adapter passes the serving checks its modes cover on the
  goldens of its domain through its stand-in (an fp64 kernel: far inside every bound), and a
  stand-in that reads the pool V-first while the adapter hands it K-first fails;
- the chunked prefills: the KDA goldens of their domain pass through a correct stand-in and
  fail through one that drops the initial state or misplaces chunks after an empty sequence;
  without their operators' rule in the policy table the golden check errors in one line;
  decode after prefill pairs each with its engine's decode kernel; a stand-in whose result
  changes from call to call fails determinism in the replay and the varlen modes;
- the registry lists every engine adapter with a domain (policy/kernel_domains.json) and a
  policy whose rules give its bounds (policy/policies.json).
Needs torch and k3ref._core (K3REF_CORE_PATH=BUILD/python)."""
import json
import sys
import textwrap
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import k3ref  # noqa: E402

try:
    k3ref._compiled()
except ImportError as e:  # the references and the policy table the checks judge with
    pytest.skip(f"k3ref._core not importable ({e})", allow_module_level=True)

from k3ref.gpu_check import engine_sglang as EG  # noqa: E402
from k3ref.gpu_check import engine_tokenspeed as ET  # noqa: E402
from k3ref.gpu_check import engine_vllm as EV  # noqa: E402
from k3ref.gpu_check import registry, serving_check as SC  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SUITE = SC.load_serving_suite(ROOT / "goldens")
ENGINE_NAMES = {"vllm.fused_recurrent_gdn[continuous_batching]", "vllm.fused_recurrent_gdn[spec_decode]",
                "vllm.gdn_replayssm_decode", "tokenspeed.kda_recurrent_decode_pool", "tokenspeed.kda_mtp_verify",
                "tokenspeed.kda_chunk_prefill", "tokenspeed.gdn_decode_step", "sglang.fused_sigmoid_gating[decode]",
                "sglang.fused_sigmoid_gating[target_verify]", "sglang.fused_sigmoid_gating[gdn_decode]",
                "vllm.kda_decode", "vllm.kda_chunk_prefill"}

# ---------------------------------------------------------------------------- stand-ins
# Each calls k3ref's torch serving kernel (fp64) under the engine's own calling convention.
COMMON = '''
import torch
from k3ref.gpu_check.serving_check import TorchServingAdapter

TORCH = TorchServingAdapter()


def kda_form(q, k, v, g, beta, A_log=None, dt_bias=None, cu=None):
    K, HV = q.shape[-1], v.shape[2]
    if g.dim() == 3:  # GDN: one gate per head
        g = g[..., None].expand(*g.shape, K)
    out = dict(q=q, k=k, v=v, g=g.contiguous(), beta=beta)
    if A_log is not None:
        out["A_log"] = A_log
    if dt_bias is not None:
        out["dt_bias"] = dt_bias.reshape(HV, -1).expand(HV, K).contiguous()
    out["cu_seqlens"] = cu if cu is not None else torch.tensor([0, q.shape[1]])
    return out
'''

VLLM_RECURRENT = COMMON + '''
def fused_recurrent_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, inplace_final_state=True,
                                         cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                                         retrieve_parent_token=None, use_qk_l2norm_in_kernel=False):
    params = dict(gate="log_decay", beta="as_given", qk_l2norm=use_qk_l2norm_in_kernel, scale=scale,
                  state_layout=STATE_LAYOUT)
    inputs = kda_form(q, k, v, g, beta, cu=cu_seqlens)
    if not inplace_final_state:  # one state row per token, read from the sequence's initial state
        pool = initial_state.double().clone()
        o, rows = TORCH.verify(inputs, params, pool, torch.zeros(1, q.shape[1], dtype=torch.long),
                               torch.ones(1, dtype=torch.long), in_place=False)
        return o.to(q.dtype), rows.float()
    if STATE_LAYOUT == "v_first":  # the K-first pool's bytes read as [slots, HV, V, K]
        n, HV, K, V = initial_state.shape
        initial_state = initial_state.as_strided((n, HV, V, K), (initial_state.stride(0), V * K, K, 1))
    if ssm_state_indices.dim() == 1:
        o = TORCH.decode(inputs, params, initial_state, ssm_state_indices.long())
        return o.to(q.dtype), initial_state
    acc = num_accepted_tokens.long() if num_accepted_tokens is not None else torch.ones(
        ssm_state_indices.shape[0], dtype=torch.long)
    o, _ = TORCH.verify(inputs, params, initial_state, ssm_state_indices.long(), acc, in_place=True)
    return o.to(q.dtype), initial_state
'''

VLLM_REPLAY = COMMON + '''
def fused_recurrent_gated_delta_rule_replayssm(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache,
                                               k_cache, g_cache, out, ssm_state_indices, write_pos,
                                               use_qk_l2norm_in_kernel=False, block_v=None, num_warps=None,
                                               num_stages=None, nk=None):
    slots, HV, V, K = initial_state.shape
    H = (mixed_qkv.shape[1] - HV * V) // (2 * K)
    params = dict(gate="softplus", beta="sigmoid", qk_l2norm=use_qk_l2norm_in_kernel, scale=scale, H=H, K=K,
                  state_layout="v_first")
    raw = dict(mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    out.copy_(TORCH.replay(raw, params, initial_state, d_cache, k_cache, g_cache, ssm_state_indices.long(),
                           write_pos.long()))
    return out, initial_state
'''

# vLLM's kda.py (its KDA tree, one commit): the recurrent entry point with its null block (an
# index <= 0 neither read nor written), its o allocated like k, its V-first pool and per-token
# rows; the gate kernel; the chunk entry points, whose output lands in v's memory.
VLLM_KDA = COMMON + '''
import torch.nn.functional as F

from vllm.model_executor.custom_op import CustomOp  # noqa: F401  the shim
from vllm.utils.math_utils import cdiv  # noqa: F401  laid out beside the ops, vllm/utils/__init__.py not run


def fused_kda_gate(g, A, head_k_dim, g_bias=None, beta=1.0, threshold=20.0):
    H = A.numel()
    x = g.double() + (g_bias.double() if g_bias is not None else 0.0)
    y = -torch.exp(A.double().reshape(-1)).repeat_interleave(head_k_dim) * F.softplus(x, beta, threshold)
    return y.float().view(*g.shape[:-1], H, head_k_dim)


def fused_recurrent_kda_fwd(q, k, v, g, beta, scale, initial_state, inplace_final_state=True, cu_seqlens=None,
                            ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False):
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    o = torch.empty_like(k)
    out = o.view(B, T, HV, V)  # the kernel's [B, T, HV, V] in k's memory
    pool = initial_state
    if STATE_LAYOUT == "k_first":  # the V-first pool's bytes read as [slots, HV, K, V]
        pool = pool.as_strided((pool.shape[0], HV, K, V), (pool.stride(0), K * V, V, 1), pool.storage_offset())
    params = dict(gate="log_decay", gate_base="e", beta="as_given", qk_l2norm=use_qk_l2norm_in_kernel, scale=scale,
                  lower_bound=None)
    prep, _ = TORCH._prep(dict(q=q, k=k, v=v, g=g, beta=beta), params)

    def read(i):
        S = pool[i].double()
        return S if STATE_LAYOUT == "k_first" else S.transpose(-1, -2)

    def store(i, S):
        pool[i] = (S if STATE_LAYOUT == "k_first" else S.transpose(-1, -2)).to(pool.dtype)

    cu = [int(x) for x in cu_seqlens.tolist()] if cu_seqlens is not None else [0, T]
    final = None if inplace_final_state else q.new_empty(T, HV, V, K, dtype=initial_state.dtype)
    flat = ssm_state_indices.reshape(-1) if ssm_state_indices is not None else None
    stride = ssm_state_indices.stride(0) if ssm_state_indices is not None else 1
    for n in range(len(cu) - 1):
        if cu[n + 1] == cu[n]:
            continue
        if flat is not None:
            i_t = int(num_accepted_tokens[n]) - 1 if num_accepted_tokens is not None else 0
            entering = int(flat[n * stride + i_t])
            if entering <= 0:  # NULL_BLOCK_ID = 0
                continue
            S = read(entering)
        else:
            S = read(cu[n])
        outs, states = TORCH._run(prep, scale, cu[n], cu[n + 1], S)
        for t, (o_t, S_t) in enumerate(zip(outs, states)):
            out[0, cu[n] + t] = o_t.to(o.dtype)
            if inplace_final_state:
                i = int(flat[n * stride + t])
                if i > 0:
                    store(i, S_t)
            else:
                final[cu[n] + t] = S_t.transpose(-1, -2).to(final.dtype)
    return o, (initial_state if inplace_final_state else final)


def _chunk(q, k, v, g, beta, params, A_log=None, dt_bias=None, initial_state=None, cu_seqlens=None):
    inputs = kda_form(q, k, v, g, beta, A_log, dt_bias, cu_seqlens)
    o, final = TORCH.varlen(dict(inputs, initial_state=initial_state), dict(params, state_layout="v_first"))
    v.copy_(o.to(v.dtype))  # chunk_gla_fwd_o_gk(o=v)
    return v, final.float()


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    params = dict(gate="log_decay", beta="as_given", qk_l2norm=use_qk_l2norm_in_kernel, scale=scale)
    return _chunk(q, k, v, g, beta, params, initial_state=initial_state, cu_seqlens=cu_seqlens)


def chunk_kda_with_fused_gate(q, k, v, raw_g, beta, A_log, g_bias, scale=None, initial_state=None,
                              output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    params = dict(gate="softplus", beta="as_given", qk_l2norm=use_qk_l2norm_in_kernel, scale=scale)
    return _chunk(q, k, v, raw_g, beta, params, A_log, g_bias, initial_state, cu_seqlens)
'''

TS_KDA = COMMON + '''
def _params(lower_bound, layout="k_first"):
    gate = "lower_bound" if lower_bound is not None else "softplus"
    return dict(gate=gate, lower_bound=lower_bound, beta="sigmoid", qk_l2norm=True, scale=None, state_layout=layout)


def kda_recurrent_decode_pool(q, k, v, g_raw, beta, A_log, dt_bias, *, h_pool, read_indices, write_indices,
                              cu_seqlens=None, lower_bound=None):
    inputs = kda_form(q, k, v, g_raw, beta, A_log, dt_bias, cu_seqlens)
    cu = [int(x) for x in inputs["cu_seqlens"].tolist()]
    o = torch.zeros(v.shape, dtype=torch.float64)
    for n in range(len(cu) - 1):
        r, w = int(read_indices[n]), int(write_indices[n])
        one = {key: (x[:, cu[n]:cu[n + 1]] if key in ("q", "k", "v", "g", "beta") else x) for key, x in inputs.items()
               if key != "cu_seqlens"}
        h0 = h_pool[r:r + 1].double() if r >= 0 else torch.zeros((1,) + tuple(h_pool.shape[1:]), dtype=torch.float64)
        o_n, final = TORCH.prefill(one, _params(lower_bound), h0)
        o[:, cu[n]:cu[n + 1]] = o_n
        if w >= 0 and cu[n + 1] > cu[n]:
            h_pool[w] = final[0].to(h_pool.dtype)
    return o.to(v.dtype)


def kda_recurrent_decode(q, k, v, g_raw, beta, A_log, dt_bias=None, *, initial_state=None, cu_seqlens=None,
                         lower_bound=None, beta_is_logit=True):
    inputs = kda_form(q, k, v, g_raw, beta, A_log, dt_bias)
    inputs.pop("cu_seqlens")
    o, final = TORCH.prefill(inputs, _params(lower_bound), initial_state.double())
    return o.to(v.dtype), final.float()


def kda_chunk_prefill(q, k, v, g_raw, beta, A_log, dt_bias=None, *, initial_state=None, cu_seqlens=None,
                      lower_bound=None, beta_is_logit=True):
    inputs = kda_form(q, k, v, g_raw, beta, A_log, dt_bias, cu_seqlens)
    o, final = TORCH.varlen(dict(inputs, initial_state=initial_state), _params(lower_bound))
    return o.to(v.dtype), final.float()
'''

TS_MTP = COMMON + '''
def fused_recurrent_kda_mtp(q, k, v, g, beta, A_log, dt_bias, h_pool, read_indices, write_indices, *, h_pool_out=None,
                            scale=None, lower_bound=None, recurrent_layout="k_major", use_qk_l2norm_in_kernel=True,
                            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True):
    B, T = q.shape[:2]
    flat = lambda x: x.reshape((1, B * T) + tuple(x.shape[2:]))  # noqa: E731
    inputs = kda_form(flat(q), flat(k), flat(v), flat(g), flat(beta), A_log, dt_bias, torch.arange(B + 1) * T)
    gate = "lower_bound" if lower_bound is not None else "softplus"
    params = dict(gate=gate, lower_bound=lower_bound, beta="sigmoid", qk_l2norm=True, scale=scale,
                  state_layout="v_first" if recurrent_layout == "v_major" else "k_first")
    # the entering page in column 0 of a scratch row, then the positions' pages
    idx = torch.cat([read_indices.long()[:, None], write_indices.reshape(B, T).long()], 1)
    o = torch.zeros((1, B * T) + tuple(v.shape[2:]), dtype=torch.float64)
    for n in range(B):
        one = {key: (x[:, n * T:(n + 1) * T] if key in ("q", "k", "v", "g", "beta") else x) for key, x in inputs.items()
               if key != "cu_seqlens"}
        h0 = h_pool[idx[n, 0]:idx[n, 0] + 1].double() if idx[n, 0] >= 0 else torch.zeros(
            (1,) + tuple(h_pool.shape[1:]), dtype=torch.float64)
        for t in range(T):  # the state after token t into page write_indices[n, t] (< 0: not stored)
            part = {key: (x[:, : t + 1] if key in ("q", "k", "v", "g", "beta") else x) for key, x in one.items()}
            o_t, final = TORCH.prefill(part, params, h0)
            o[0, n * T + t] = o_t[0, t]
            if idx[n, t + 1] >= 0:
                h_pool[idx[n, t + 1]] = final[0].to(h_pool.dtype)
    return o.reshape((B, T) + tuple(v.shape[2:])).to(v.dtype)
'''

TS_GDN = COMMON + '''
def triton_gdn_decode_step(q, k, v, *, A_log, a, dt_bias, b, initial_state, initial_state_indices, scale=None,
                           output_state_indices=None, use_qk_l2norm=True):
    B = q.shape[0]
    flat = lambda x: x.reshape((1, B) + tuple(x.shape[2:]))  # noqa: E731
    inputs = kda_form(flat(q), flat(k), flat(v), flat(a), flat(b), A_log, dt_bias, torch.arange(B + 1))
    params = dict(gate="softplus", beta="sigmoid", qk_l2norm=use_qk_l2norm, scale=scale, state_layout="v_first")
    o = torch.zeros((1, B) + tuple(v.shape[2:]), dtype=torch.float64)
    for n in range(B):
        i = int(initial_state_indices[n])
        one = {key: (x[:, n:n + 1] if key in ("q", "k", "v", "g", "beta") else x) for key, x in inputs.items()
               if key != "cu_seqlens"}
        h0 = initial_state[i:i + 1].double() if i >= 0 else torch.zeros((1,) + tuple(initial_state.shape[1:]),
                                                                           dtype=torch.float64)
        o_n, final = TORCH.prefill(one, params, h0)
        o[:, n] = o_n[:, 0]
        if i >= 0:
            initial_state[i] = final[0].to(initial_state.dtype)
    return o.reshape((B, 1) + tuple(v.shape[2:])).to(v.dtype)
'''


SGLANG = COMMON + '''
def fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b,
                                           initial_state_source, initial_state_indices, scale=None,
                                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, is_kda=False,
                                           disable_state_update=False, intermediate_states_buffer=None,
                                           intermediate_state_indices=None, cache_steps=None,
                                           retrieve_parent_token=None):
    B, T, HV = q.shape[0], q.shape[1], v.shape[2]
    g = a.reshape(B, T, HV, -1) if is_kda else a.reshape(B, T, HV)
    inputs = kda_form(q, k, v, g, b, A_log, dt_bias, cu_seqlens)
    params = dict(gate="softplus", beta="sigmoid", qk_l2norm=use_qk_l2norm_in_kernel, scale=scale,
                  state_layout="v_first")
    cu = [int(x) for x in inputs["cu_seqlens"].tolist()]
    o = torch.zeros(v.shape, dtype=torch.float64)
    pool = initial_state_source
    for n in range(len(cu) - 1):
        i = int(initial_state_indices[n])
        one = {key: (x[:, cu[n]:cu[n + 1]] if key in ("q", "k", "v", "g", "beta") else x) for key, x in inputs.items()
               if key != "cu_seqlens"}
        h0 = pool[i:i + 1].double() if i >= 0 else torch.zeros((1,) + tuple(pool.shape[1:]), dtype=torch.float64)
        final = h0
        for t in range(cu[n + 1] - cu[n]):  # the state after each token into the snapshot buffer
            part = {key: (x[:, : t + 1] if key in ("q", "k", "v", "g", "beta") else x) for key, x in one.items()}
            o_t, final = TORCH.prefill(part, params, h0)
            o[0, cu[n] + t] = o_t[0, t]
            if intermediate_states_buffer is not None and int(intermediate_state_indices[n]) >= 0:
                intermediate_states_buffer[int(intermediate_state_indices[n]), t] = final[0].float()
        if not disable_state_update and i >= 0:
            pool[i] = final[0].to(pool.dtype)
    return o.to(v.dtype)
'''


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def fresh_modules():
    """Forget the engines' packages (the loaders refuse a second copy) and give a fake triton
    (the shim imports it; no Triton here)."""
    saved = dict(sys.modules)
    for name in list(sys.modules):
        if name.split(".")[0] in ("vllm", "tokenspeed_kernel", "sglang"):
            del sys.modules[name]
    if "triton.language" not in sys.modules:  # (another module's stand-in may hold "triton" alone)
        triton = types.ModuleType("triton")
        triton.language = types.ModuleType("triton.language")
        sys.modules["triton"], sys.modules["triton.language"] = triton, triton.language
    yield
    for name in list(sys.modules):
        if name not in saved:
            del sys.modules[name]
    sys.modules.update(saved)


@pytest.fixture
def vllm_tree(tmp_path):
    def make(layout="k_first"):
        ops = tmp_path / "vllm" / "model_executor" / "layers" / "fla" / "ops"
        write(ops / "fused_recurrent.py", f"STATE_LAYOUT = {layout!r}\n" + VLLM_RECURRENT)
        write(ops / "fused_recurrent_replayssm.py", VLLM_REPLAY)
        write(tmp_path / "vllm" / "__init__.py", "raise ImportError('the stand-in package __init__ ran')\n")
        write(tmp_path / "COMMITS.txt", "vllm/model_executor/layers/fla/ops/fused_recurrent.py 0123456789abcdef0123\n")
        return tmp_path
    return make


@pytest.fixture
def vllm_kda_tree(tmp_path):
    """vLLM's KDA tree under DIR/kda/ (beside vllm_tree's GDN files in DIR), named in DIR's COMMITS.txt."""
    def make(layout="v_first"):
        root = tmp_path / "kda"
        ops = root / "vllm" / "model_executor" / "layers" / "fla" / "ops"
        write(ops / "kda.py", f"STATE_LAYOUT = {layout!r}\n" + VLLM_KDA)
        for f in EV.KDA_FILES[1:]:  # kda.py's imports (the stand-in imports none of them)
            write(ops / f"{f}.py", "raise ImportError('a sibling of the stand-in ran')\n")
        write(root / "vllm" / "utils" / "math_utils.py", "def cdiv(a, b):\n    return -(a // -b)\n")
        write(root / "vllm" / "utils" / "__init__.py", "raise ImportError('vllm/utils/__init__.py ran')\n")
        write(root / "vllm" / "__init__.py", "raise ImportError('the stand-in package __init__ ran')\n")
        with open(tmp_path / "COMMITS.txt", "a") as f:
            f.write("kda/vllm/model_executor/layers/fla/ops/kda.py f3b2a819f7f4ee05e0ac46ab72ca1e9f41f27bd5\n")
        return tmp_path
    return make


@pytest.fixture
def sglang_tree(tmp_path):
    tmp_path = tmp_path / "sglang"
    fla = tmp_path / "python" / "sglang" / "srt" / "layers" / "attention" / "fla"
    write(fla / "fused_sigmoid_gating_recurrent.py", "from sglang.srt.layers.attention.fla.utils import is_intel\n"
          + SGLANG)
    write(tmp_path / "python" / "sglang" / "__init__.py", "raise ImportError('the stand-in package __init__ ran')\n")
    write(fla / "utils.py", "raise ImportError('the real utils ran')\n")
    return tmp_path


@pytest.fixture
def tokenspeed_tree(tmp_path):
    tmp_path = tmp_path / "tokenspeed"  # beside vllm_tree's, each with its COMMITS.txt
    root = tmp_path / "tokenspeed-kernel" / "python"
    pkg = root / "tokenspeed_kernel"
    write(pkg / "__init__.py", "raise ImportError('the stand-in package __init__ ran')\n")
    write(pkg / "ops" / "attention" / "triton" / "linear" / "kda.py", TS_KDA)
    write(pkg / "thirdparty" / "triton" / "fla_kda_recurrent.py", TS_MTP)
    write(pkg / "ops" / "attention" / "triton" / "gated_delta_rule.py", TS_GDN)
    write(tmp_path / "COMMITS.txt", "tokenspeed-kernel/python/tokenspeed_kernel f4d8ec6e039c028c7ee71317ccfb84e56ae2b45c\n")
    return tmp_path


# The rules the chunked prefills' golden check needs in their policies (vllm-kda-chunk,
# tokenspeed-kda-chunk) for each KDA golden operator: their serving.checkpoints bound on the
# outputs (o, final_state); the chunkwise goldens' stage tensors, which the table requires a
# rule for and the serving check never reads, as the chunk policy has them.
CHUNK_RULE = {"metric": "floor", "multiple": 4}
CHUNK_RULES = {"kda.recurrent": {"output": CHUNK_RULE},
               "kda.chunkwise_fla": {"output": CHUNK_RULE, "stage": CHUNK_RULE},
               "kda.chunkwise_flashkda": {"output": CHUNK_RULE, "stage": CHUNK_RULE}}


@pytest.fixture
def chunk_policy(tmp_path, monkeypatch):
    """The shipped policy table with (or without) CHUNK_RULES for the KDA golden operators in
    the chunked prefills' policies, as the table the checks read."""
    from k3ref import policy

    def make(with_rule=True):
        data = json.loads(policy.table_path().read_text())
        for name in ("vllm-kda-chunk", "tokenspeed-kda-chunk"):
            rules = data["policies"][name]["rules"]
            for op in SC.VARLEN_OPS:
                if with_rule:
                    rules[op] = CHUNK_RULES[op]
                else:
                    rules.pop(op, None)
        f = tmp_path / f"policies_{with_rule}.json"
        f.write_text(json.dumps(data))
        monkeypatch.setattr(policy, "_DEFAULT", policy.PolicyTable.load(f))
    return make


def flaky(entry, output=None):
    """`entry` whose result (its return value, or the tensor `output(args, kwargs)` names) gains
    one ulp in its first element on every second call: an accumulation order that changes
    between launches."""
    calls = [0]

    def run(*args, **kw):
        res = entry(*args, **kw)
        calls[0] += 1
        x = output(args, kw) if output is not None else (res[0] if isinstance(res, tuple) else res)
        if calls[0] % 2 == 0:
            ints = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}[x.dtype]
            x.view(-1)[:1].view(ints).add_(1)
        return res
    return run


def run_checks(adapter):
    """{(check, case): (status, reason)} of every check the adapter's modes cover, on the CPU."""
    out = {}
    for check in adapter.checks:
        for case_id, case, why in adapter.cases(check, SUITE):
            if why:
                out[(check, case_id)] = ("skip", why)
                continue
            r = adapter.run_check(check, case, "cpu")
            out[(check, case_id)] = (r.status, r.reason)
    return out


def ran(results):
    return {k: v for k, v in results.items() if v[0] != "skip"}


# ---------------------------------------------------------------------------- loading

class TestLoading:
    def test_a_folder_without_the_ops_names_what_is_needed(self, tmp_path, fresh_modules):
        with pytest.raises(RuntimeError) as e:
            EV.load_ops("fused_recurrent", str(tmp_path))
        msg = str(e.value)
        assert "\n" not in msg and "--vllm-path" in msg and "vllm/model_executor/layers/fla/ops" in msg

    def test_tokenspeed_folder_without_the_package(self, tmp_path, fresh_modules):
        with pytest.raises(RuntimeError) as e:
            ET.load_module("ops.attention.triton.linear.kda", str(tmp_path))
        msg = str(e.value)
        assert "\n" not in msg and "--tokenspeed-path" in msg and "tokenspeed_kernel" in msg

    def test_tokenspeed_package_without_the_module(self, tokenspeed_tree, fresh_modules):
        with pytest.raises(RuntimeError, match="has no ops/attention/triton/nope.py"):
            ET.load_module("ops.attention.triton.nope", str(tokenspeed_tree))

    def test_sglang_folder_without_the_kernel(self, tmp_path, fresh_modules):
        with pytest.raises(RuntimeError) as e:
            EG.load_module(str(tmp_path))
        assert "\n" not in str(e.value) and "--sglang-path" in str(e.value)

    def test_no_path_and_no_installed_engine(self, fresh_modules, monkeypatch):
        import importlib.util

        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("vllm", "tokenspeed_kernel", "sglang")
                            else real(n, *a))
        with pytest.raises(RuntimeError, match="or an installed vllm"):
            EV.load_ops("fused_recurrent", None)
        with pytest.raises(RuntimeError, match="or an installed tokenspeed_kernel"):
            ET.load_module("ops.attention.triton.linear.kda", None)
        with pytest.raises(RuntimeError, match="or an installed sglang"):
            EG.load_module(None)

    def test_package_inits_are_not_run_and_the_commit_is_reported(self, vllm_tree, tokenspeed_tree, fresh_modules):
        mod = EV.load_ops("fused_recurrent", str(vllm_tree()))
        assert "@0123456789ab" in SC.engine_version("vllm", mod)
        ts = ET.load_module("ops.attention.triton.linear.kda", str(tokenspeed_tree))
        assert "@f4d8ec6e039c" in SC.engine_version("tokenspeed", ts)
        assert "vllm.triton_utils" in sys.modules and "vllm.platforms" in sys.modules  # the shims

    def test_a_second_copy_is_refused(self, vllm_tree, tmp_path_factory, fresh_modules):
        EV.load_ops("fused_recurrent", str(vllm_tree()))
        other = tmp_path_factory.mktemp("other")
        write(other / "vllm" / "model_executor" / "layers" / "fla" / "ops" / "fused_recurrent.py", "")
        with pytest.raises(RuntimeError, match="another vllm is already imported"):
            EV.load_ops("fused_recurrent", str(other))

    def test_vllm_kda_ops_come_from_their_own_tree(self, vllm_kda_tree, fresh_modules):
        path = vllm_kda_tree()
        assert EV.kda_root(path) == path / "kda"
        mod = EV.load_kda_ops(str(path))  # vllm/__init__.py, vllm/utils/__init__.py and the siblings not run
        assert Path(mod.__file__).is_relative_to(path / "kda")
        assert "kda.py@f3b2a819f7f4" in SC.engine_version("vllm", mod)
        assert "vllm.model_executor.custom_op" in sys.modules and "vllm.utils.math_utils" in sys.modules

    def test_vllm_kda_tree_missing_a_module_names_it(self, vllm_kda_tree, fresh_modules):
        path = vllm_kda_tree()
        (path / "kda" / EV.OPS / "solve_tril.py").unlink()
        with pytest.raises(RuntimeError) as e:
            EV.load_kda_ops(str(path))
        assert "lack solve_tril.py" in str(e.value) and "\n" not in str(e.value) and "one commit" in str(e.value)

    def test_vllm_gdn_and_kda_trees_are_refused_in_one_process(self, vllm_tree, vllm_kda_tree, fresh_modules):
        path = vllm_tree()
        vllm_kda_tree()
        EV.load_ops("fused_recurrent", str(path))
        with pytest.raises(RuntimeError, match="run the GDN and the KDA kernels in separate processes"):
            EV.load_kda_ops(str(path))

    def test_a_module_that_fails_to_import_gives_one_line(self, tmp_path, fresh_modules):
        write(tmp_path / "vllm" / "model_executor" / "layers" / "fla" / "ops" / "fused_recurrent.py",
              "from .op import exp\n")
        with pytest.raises(RuntimeError) as e:
            EV.load_ops("fused_recurrent", str(tmp_path))
        assert "ModuleNotFoundError" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------- mapping

def loaded(adapter, mod):
    adapter.mod = mod
    # The stand-ins carry fp64 between tokens but store fp32 pools: a split is not bitwise their
    # single shot (the real kernels carry fp32 both ways, which the device run checks).
    adapter.split_bitwise = False
    return adapter


class TestMapping:
    def test_vllm_recurrent_modes_pass_through_the_stand_in(self, vllm_tree, fresh_modules):
        mod = EV.load_ops("fused_recurrent", str(vllm_tree()))
        for mode, expected in (("continuous_batching", {"golden", "slot_isolation", "layout_equivalence",
                                                        "decode_after_prefill", "determinism"}),
                               ("spec_decode", {"golden", "slot_isolation", "accepted_zero", "empty_sequences",
                                                "determinism"})):
            res = ran(run_checks(loaded(EV.VllmGdnRecurrentAdapter(mode), mod)))
            assert {c for c, _ in res} == expected, (mode, res)
            bad = {k: v for k, v in res.items() if v[0] != "pass"}
            assert not bad, bad
        # the goldens in its domain ran: the K-first decode and the K-first engine verify
        assert ("golden", "gdn_decode_k_first") in ran(run_checks(loaded(EV.VllmGdnRecurrentAdapter(
            "continuous_batching"), mod)))

    def test_vllm_recurrent_with_a_v_first_stand_in_fails(self, vllm_tree, fresh_modules):
        mod = EV.load_ops("fused_recurrent", str(vllm_tree("v_first")))
        res = ran(run_checks(loaded(EV.VllmGdnRecurrentAdapter("continuous_batching"), mod)))
        assert res[("golden", "gdn_decode_k_first")][0] == "fail"
        assert res[("layout_equivalence", "-")][0] == "fail"

    def test_vllm_replay_passes_the_engine_replay_golden(self, vllm_tree, fresh_modules):
        mod = EV.load_ops("fused_recurrent_replayssm", str(vllm_tree()))
        res = ran(run_checks(loaded(EV.VllmGdnReplayAdapter(), mod)))
        assert set(res) == {(c, "gdn_replay_decode_engine") for c in ("golden", "slot_isolation", "determinism")}
        assert all(v[0] == "pass" for v in res.values()), res
        assert "o, pool, d_cache, k_cache, g_cache bitwise equal" in res[("determinism", "gdn_replay_decode_engine")][1]

    def test_a_flaky_replay_fails_determinism_on_o_and_on_an_appended_cache(self, vllm_tree, fresh_modules):
        mod = EV.load_ops("fused_recurrent_replayssm", str(vllm_tree()))
        entry = mod.fused_recurrent_gated_delta_rule_replayssm
        adapter = loaded(EV.VllmGdnReplayAdapter(), mod)
        case = "gdn_replay_decode_engine"
        for what, output in (("o", lambda a, kw: a[10]), ("d_cache", lambda a, kw: a[7][3, 0, 0])):
            # o (the out argument), or the d entry row 0 appends (slot 3, head 0, write position 0)
            mod.fused_recurrent_gated_delta_rule_replayssm = flaky(entry, output)
            res = ran(run_checks(adapter))
            status, reason = res[("determinism", case)]
            assert status == "fail" and reason.endswith(f"differ: {what}"), reason
            assert res[("golden", case)][0] == "pass"  # one ulp: inside every bound

    def test_vllm_kda_decode_passes_through_the_stand_in(self, vllm_kda_tree, fresh_modules):
        mod = EV.load_kda_ops(str(vllm_kda_tree()))
        res = run_checks(loaded(EV.VllmKdaDecodeAdapter(), mod))
        ok = ran(res)
        assert {c for c, _ in ok} == {"golden", "slot_isolation", "layout_equivalence", "decode_after_prefill",
                                      "accepted_zero", "empty_sequences", "determinism"}, ok
        # the goldens of its domain: H K = HV V, V-first, a padded slot and slot 0 (index 1 behind the null block)
        assert {case for (c, case) in ok if c == "golden"} == {"gdn_decode_v_first_engine",
                                                               "serving_verify_per_token_engine"}
        assert "H K = 24, HV V = 32" in res[("golden", "serving_decode_v_first_padded_gva")][1]
        # vLLM's verify enters at column num_accepted - 1 with no guard: a count 0 reads the previous
        # row's last entry (FLA's defect, in vLLM's copy)
        assert ok.pop(("accepted_zero", "-"))[1].startswith("accepted count 0 read a slot outside its row")
        bad = {k: v for k, v in ok.items() if v[0] != "pass"}
        assert not bad, bad

    def test_vllm_kda_decode_needs_the_null_block_and_the_v_first_pool(self, vllm_kda_tree, fresh_modules,
                                                                       monkeypatch):
        mod = EV.load_kda_ops(str(vllm_kda_tree()))
        with monkeypatch.context() as m:  # slot 0 handed to the kernel as index 0: vLLM's null block
            m.setattr(EV, "null_block_indices", lambda idx: idx.to(torch.int32).contiguous())
            res = ran(run_checks(loaded(EV.VllmKdaDecodeAdapter(), mod)))
            assert res[("golden", "gdn_decode_v_first_engine")][0] == "fail"
            assert res[("layout_equivalence", "-")][0] == "fail"
        for name in [n for n in sys.modules if n.split(".")[0] == "vllm"]:
            del sys.modules[name]
        mod = EV.load_kda_ops(str(vllm_kda_tree("k_first")))  # a kernel reading the pool K-first
        res = ran(run_checks(loaded(EV.VllmKdaDecodeAdapter(), mod)))
        assert res[("golden", "gdn_decode_v_first_engine")][0] == "fail"
        assert res[("layout_equivalence", "-")][0] == "fail"

    def test_vllm_kda_chunk_prefill_passes_the_empty_sequences_both_gates(self, vllm_kda_tree, fresh_modules):
        mod = EV.load_kda_ops(str(vllm_kda_tree()))
        adapter = loaded(EV.VllmKdaChunkPrefillAdapter(), mod)
        for params in (adapter.varlen_params, dict(adapter.varlen_params, gate="log_decay", beta="as_given")):
            adapter.varlen_params = params  # chunk_kda_with_fused_gate, then chunk_kda
            res = ran(run_checks(adapter))
            for check in ("empty_sequences", "determinism", "decode_after_prefill"):
                assert res[(check, "-")][0] == "pass", (check, res[(check, "-")])
        inputs, params, states = adapter._problem(3, [2, 3], shape=adapter.varlen_shape, params=adapter.varlen_params)
        v = inputs["v"].clone()
        adapter.varlen(dict(inputs, initial_state=states[:2].transpose(-1, -2).contiguous()), params)
        assert torch.equal(inputs["v"], v)  # the kernel writes o into a copy of v, not the caller's v

    def test_vllm_kda_chunk_prefill_catches_the_chunk_table_of_vllms_index_py(self, vllm_kda_tree, fresh_modules,
                                                                              chunk_policy):
        """findings/vllm-kda-chunk-empty-sequences: a stand-in whose chunks are placed by vLLM's
        prepare_chunk_indices expression (index.py at f3b2a819: the sequence column
        indices.eq(0).cumsum(0) - 1 skips empty sequences): the sequences it misplaces keep v as
        their output and get an uninitialised final state. The empty-sequence check fails on
        them and only them (the empty sequences' states stay right), and the package's registry
        makes that row known, a pass of it an unexpected pass. The golden check fails on the
        varlen goldens with an empty sequence before others, and only on them."""
        from k3ref.gpu_check import collection

        chunk_policy()

        def vllm_table(lengths, chunk=64):
            idx = torch.cat([torch.arange(-(-L // chunk)) for L in lengths])
            return torch.stack([idx.eq(0).cumsum(0) - 1, idx], 1).tolist()

        def correct_table(lengths, chunk=64):
            counts = torch.tensor([-(-L // chunk) for L in lengths])
            seq = torch.repeat_interleave(torch.arange(len(lengths)), counts)
            return torch.stack([seq, torch.arange(len(seq)) - (torch.cumsum(counts, 0) - counts)[seq]], 1).tolist()

        assert vllm_table([3, 0, 4, 0, 0, 5, 0]) == [[0, 0], [1, 0], [2, 0]]  # the check's batch
        assert correct_table([3, 0, 4, 0, 0, 5, 0]) == [[0, 0], [2, 0], [5, 0]]
        assert vllm_table([3, 4, 5]) == correct_table([3, 4, 5])  # no empty sequence: the same table

        def misplaced(entry):
            def run(q, k, v, *args, cu_seqlens=None, **kw):
                v0 = v.clone()
                o, final = entry(q, k, v, *args, cu_seqlens=cu_seqlens, **kw)
                cu = [int(x) for x in cu_seqlens.tolist()]
                lengths = [b - a for a, b in zip(cu, cu[1:])]
                for n in {c[0] for c, w in zip(correct_table(lengths), vllm_table(lengths)) if c != w}:
                    o[:, cu[n]:cu[n + 1]] = v0[:, cu[n]:cu[n + 1]]  # o is written into v: never written
                    final[n] = 2.5e34  # built from torch.empty w, u
                return o, final
            return run

        mod = EV.load_kda_ops(str(vllm_kda_tree()))
        adapter = loaded(EV.VllmKdaChunkPrefillAdapter(), mod)
        right = ran(run_checks(adapter))[("empty_sequences", "-")]
        mod.chunk_kda_with_fused_gate = misplaced(mod.chunk_kda_with_fused_gate)
        mod.chunk_kda = misplaced(mod.chunk_kda)
        for params in (adapter.varlen_params, dict(adapter.varlen_params, gate="log_decay", beta="as_given")):
            adapter.varlen_params = params
            status, reason = ran(run_checks(adapter))[("empty_sequences", "-")]
            assert status == "fail" and "o: relative RMS error" in reason, reason
            assert "final states of the sequences with tokens" in reason and "no tokens" not in reason, reason
        golden = {case: v[0] for (c, case), v in ran(run_checks(adapter)).items() if c == "golden"}
        assert {case for case, v in golden.items() if v != "pass"} == {"kda_varlen", "kda_varlen_no_initial_state"}
        rows = [_row(adapter.name, "empty_sequences", "-", "fail", reason),
                _row("vllm.kda_decode", "accepted_zero", "-", "fail", "64 of 64 NaN")]
        registry_ = collection.load_limitations()
        assert [r["verdict"] for r in SC.apply_known_limitations(rows, registry_)] == ["known", "known"]
        assert right[0] == "pass"
        fixed = SC.apply_known_limitations([_row(adapter.name, "empty_sequences", "-", "pass")], registry_)
        assert fixed[0]["verdict"] == "xpass"  # the day vLLM fixes the table, the table goes red

    def test_vllm_kda_chunk_prefill_runs_the_kda_goldens_of_its_domain(self, vllm_kda_tree, fresh_modules,
                                                                       chunk_policy):
        chunk_policy()
        mod = EV.load_kda_ops(str(vllm_kda_tree()))
        adapter = loaded(EV.VllmKdaChunkPrefillAdapter(), mod)
        res = run_checks(adapter)
        golden = {case: v for (c, case), v in res.items() if c == "golden"}
        ok = {case for case, v in golden.items() if v[0] == "pass"}
        assert not {case: v for case, v in golden.items() if v[0] not in ("pass", "skip")}
        # varlen with empty sequences, no initial state, both gates, a V-first golden (its states
        # transposed into the kernel's V-first call: a K-first golden too), the chunkwise goldens
        assert {"kda_varlen", "kda_varlen_no_initial_state", "kda_t1", "kda_k100_v72", "kda_gate_softplus",
                "kda_state_v_first", "kda_t100", "kda_chunkwise_fla_c64_t100",
                "kda_chunkwise_flashkda_c16_decay_at_minus5"} <= ok, sorted(ok)
        assert "dense batch of B = 2" in golden["kda_b2_t37"][1]
        assert "HV/H = 3" in golden["kda_gva_h2_hv6"][1]  # one head per value head
        assert "gate lower_bound" in golden["kda_gate_lower_bound"][1]
        all_states = next(c for c in SUITE if c.name == "kda_all_states")  # HV/H = 2 for this kernel first
        assert "all_states" in SC.ServingAdapter._varlen_case_unsupported(all_states)
        assert "beta two_sigmoid" in golden["kda_beta_two_sigmoid"][1]
        assert "golden" in adapter.checks and {c for c, _ in ran(res)} == {"golden", "decode_after_prefill",
                                                                          "empty_sequences", "determinism"}
        assert all(v[0] == "pass" for v in ran(res).values()), {k: v for k, v in ran(res).items() if v[0] != "pass"}

    def test_a_wrong_chunk_prefill_fails_the_kda_goldens(self, vllm_kda_tree, fresh_modules, chunk_policy):
        chunk_policy()
        mod = EV.load_kda_ops(str(vllm_kda_tree()))
        adapter = loaded(EV.VllmKdaChunkPrefillAdapter(), mod)
        fused, plain = mod.chunk_kda_with_fused_gate, mod.chunk_kda

        def no_initial_state(entry):  # initial_state dropped: a zero state
            return lambda *a, initial_state=None, **kw: entry(*a, initial_state=torch.zeros_like(initial_state), **kw)

        mod.chunk_kda_with_fused_gate, mod.chunk_kda = no_initial_state(fused), no_initial_state(plain)
        golden = {case: v for (c, case), v in ran(run_checks(adapter)).items() if c == "golden"}
        assert golden["kda_gate_softplus"][0] == "fail" and golden["kda_t100"][0] == "fail"
        assert "o: relative RMS error" in golden["kda_t100"][1]  # its final state has forgotten the initial one
        assert golden["kda_t64_no_initial_state"][0] == "pass"  # a zero initial state: nothing to drop

        def swapped_final(entry):  # the final state returned K-first from a V-first call
            def run(*a, **kw):
                o, final = entry(*a, **kw)
                return o, final.transpose(-1, -2).contiguous()
            return run

        mod.chunk_kda_with_fused_gate, mod.chunk_kda = swapped_final(fused), swapped_final(plain)
        res = ran(run_checks(adapter))
        assert res[("golden", "kda_state_v_first")][0] == "fail"  # K = 32, V = 16: the shape differs
        assert res[("decode_after_prefill", "-")][0] == "fail"  # the decode continues a transposed state

    def test_the_kda_goldens_without_the_policy_rule_error_in_one_line(self, vllm_kda_tree, tokenspeed_tree,
                                                                       fresh_modules, chunk_policy):
        chunk_policy(with_rule=False)
        for adapter, mod in ((EV.VllmKdaChunkPrefillAdapter(), EV.load_kda_ops(str(vllm_kda_tree()))),
                             (ET.TokenSpeedKdaChunkPrefillAdapter(),
                              ET.load_module("ops.attention.triton.linear.kda", str(tokenspeed_tree)))):
            res = ran(run_checks(loaded(adapter, mod)))
            golden = {case: v for (c, case), v in res.items() if c == "golden"}
            assert golden and all(v[0] == "error" for v in golden.values()), golden
            reason = next(iter(golden.values()))[1]
            assert "\n" not in reason and f"policy '{adapter.policy}' has no rules for operator 'kda." in reason
            assert "policy/policies.json" in reason
            assert all(v[0] == "pass" for (c, _), v in res.items() if c != "golden")

    def test_a_flaky_chunk_prefill_fails_determinism(self, vllm_kda_tree, tokenspeed_tree, fresh_modules):
        mod = EV.load_kda_ops(str(vllm_kda_tree()))
        adapter = loaded(EV.VllmKdaChunkPrefillAdapter(), mod)
        assert ran(run_checks(adapter))[("determinism", "-")][0] == "pass"
        mod.chunk_kda_with_fused_gate = flaky(mod.chunk_kda_with_fused_gate)
        status, reason = ran(run_checks(adapter))[("determinism", "-")]
        assert status == "fail" and reason == "two varlen calls on the same batch (70, 3, 130 tokens) differ: o", reason
        ts = ET.load_module("ops.attention.triton.linear.kda", str(tokenspeed_tree))
        entry = ts.kda_chunk_prefill
        ts.kda_chunk_prefill = flaky(entry, lambda a, kw: a[0])  # q, the caller's input: not an output
        assert ran(run_checks(loaded(ET.TokenSpeedKdaChunkPrefillAdapter(), ts)))[("determinism", "-")][0] == "pass"
        ts.kda_chunk_prefill = flaky(entry)
        status, reason = ran(run_checks(loaded(ET.TokenSpeedKdaChunkPrefillAdapter(), ts)))[("determinism", "-")]
        assert status == "fail" and reason.endswith("differ: o"), reason

    def test_tokenspeed_adapters_pass_through_the_stand_ins(self, tokenspeed_tree, fresh_modules, chunk_policy):
        chunk_policy()
        path = str(tokenspeed_tree)
        kda = ET.load_module("ops.attention.triton.linear.kda", path)
        mtp = ET.load_module("thirdparty.triton.fla_kda_recurrent", path)
        gdn = ET.load_module("ops.attention.triton.gated_delta_rule", path)
        cases, checks = {}, {}
        for adapter, mod in ((ET.TokenSpeedKdaPoolDecodeAdapter(), kda), (ET.TokenSpeedKdaMtpVerifyAdapter(), mtp),
                             (ET.TokenSpeedKdaChunkPrefillAdapter(), kda), (ET.TokenSpeedGdnDecodeAdapter(), gdn)):
            res = ran(run_checks(loaded(adapter, mod)))
            bad = {k: v for k, v in res.items() if v[0] != "pass"}
            assert res and not bad, (adapter.name, bad)
            cases[adapter.name] = {case for _, case in res}
            checks[adapter.name] = {c for c, _ in res}
        # each ran a golden of its domain (K3's safe gate; GDN's gating; the padded entries; the
        # chunked prefill on the K3-gated KDA goldens, a V-first one transposed into its K-first call)
        assert "serving_decode_safe_gate_engine" in cases["tokenspeed.kda_recurrent_decode_pool"]
        assert {"kda_flashkda_varlen_t130", "kda_flashkda_like", "kda_fla_chunk_like",
                "kda_flashkda_one_token"} <= cases["tokenspeed.kda_chunk_prefill"]
        assert "kda_flashkda_scale_half" not in cases["tokenspeed.kda_chunk_prefill"]  # it takes no scale
        assert checks["tokenspeed.kda_chunk_prefill"] == {"golden", "decode_after_prefill", "empty_sequences",
                                                          "determinism"}
        assert {"gdn_verify_accepted_1_2_L", "gdn_verify_k_first_engine"} <= cases["tokenspeed.kda_mtp_verify"]
        assert "gdn_decode_v_first_engine" in cases["tokenspeed.gdn_decode_step"]

    def test_sglang_adapters_pass_through_the_stand_in(self, sglang_tree, fresh_modules):
        mod = EG.load_module(str(sglang_tree))  # its utils.py and the package __init__ not run
        cases = {}
        for adapter in EG.adapters():
            res = ran(run_checks(loaded(adapter, mod)))
            bad = {k: v for k, v in res.items() if v[0] != "pass"}
            assert res and not bad, (adapter.name, bad)
            cases[adapter.name] = {case for _, case in res}
        assert {"gdn_decode_v_first_engine"} <= cases["sglang.fused_sigmoid_gating[decode]"]
        assert "serving_verify_per_token_engine" in cases["sglang.fused_sigmoid_gating[target_verify]"]
        assert "gdn_decode_v_first_engine" in cases["sglang.fused_sigmoid_gating[gdn_decode]"]

    def test_a_kda_case_is_outside_a_gdn_kernel(self):
        a = EV.VllmGdnRecurrentAdapter("continuous_batching")
        inputs, params, _ = SC.TorchServingAdapter()._problem(3, [1, 1])  # a gate per channel
        with pytest.raises(ValueError, match="varies over K"):
            EV.gdn_gating(inputs, params)
        assert a.scalar_gate and ET.TokenSpeedGdnDecodeAdapter.scalar_gate


# ---------------------------------------------------------------------------- registry

class TestRegistry:
    def test_the_built_ins_list_every_engine_kernel(self):
        names = {a.name for a in registry.builtin_adapters()}
        assert ENGINE_NAMES <= names
        assert registry.kernel_by_name("vllm.gdn_replayssm_decode").name == "vllm.gdn_replayssm_decode"

    def test_each_declares_a_domain_and_a_policy_with_its_bounds(self):
        from k3ref import kernel_domains_file, policy

        table = policy.load_table()
        for a in registry.builtin_adapters():
            if a.name not in ENGINE_NAMES:
                continue
            assert kernel_domains_file.builtin(a.name).about  # policy/kernel_domains.json
            assert a.policy in table.policy_names() and a.contract and a.policy_reason, a.name
            assert a.o_bound.multiple > 0 and a.state_bound.multiple > 0  # read from the policy's rules
            assert a.requires_cuda

    def test_the_kernel_paths_are_options(self):
        from k3ref.gpu_check.protocol import KERNEL_PATHS

        envs = {env for _, env, _ in KERNEL_PATHS}
        assert {"K3REF_VLLM_PATH", "K3REF_TOKENSPEED_PATH"} <= envs


# ---------------------------------------------------------------------------- the engines' table

def _row(kernel, check, case, verdict, reason="r"):
    return dict(kernel=kernel, check=check, case=case, verdict=verdict, figure=1.5 if verdict == "fail" else 0.5,
                bound="b", reason=reason, source="src")


def _entries(tmp_path, *entries):
    import json

    from k3ref.gpu_check import collection

    p = tmp_path / "limits.json"
    p.write_text(json.dumps({"entries": [dict(reason="the finding", **e) for e in entries]}))
    return p, collection.load_limitations(p)


class TestEngineTable:
    KERNEL = "vllm.fused_recurrent_gdn[spec_decode]"

    def test_a_named_failure_is_known_and_a_named_pass_fails_the_table(self, tmp_path):
        _, entries = _entries(tmp_path, {"adapter": self.KERNEL, "check": "accepted_zero"},
                              {"adapter": self.KERNEL, "check": "golden", "case": "c2"})
        rows = SC.apply_known_limitations(
            [_row(self.KERNEL, "accepted_zero", "-", "fail", "48 of 48 NaN"), _row(self.KERNEL, "golden", "c1", "fail"),
             _row(self.KERNEL, "golden", "c2", "pass"), _row("other", "accepted_zero", "-", "fail")], entries)
        assert [r["verdict"] for r in rows] == ["known", "fail", "xpass", "fail"]
        assert "the finding" in rows[0]["reason"] and "48 of 48 NaN" in rows[0]["reason"]
        cells = SC.table_cells(rows)
        assert cells[self.KERNEL]["accepted_zero"] == "1K" and cells[self.KERNEL]["golden"] == "1F1X"

    def test_merge_exit_codes_follow_the_registry(self, tmp_path, capsys):
        import json

        limits, _ = _entries(tmp_path, {"adapter": self.KERNEL, "check": "accepted_zero"})
        part = tmp_path / "rows.json"
        part.write_text(json.dumps({"versions": {"torch": "2.11", "triton": "3.6", "cuda": "13.0"}, "rows": [
            _row(self.KERNEL, "accepted_zero", "-", "fail"), _row(self.KERNEL, "golden", "c1", "pass")]}))
        out = tmp_path / "m.json"
        assert SC.main(["--merge", str(part), "--known-limitations", str(limits), "--measurement", str(out),
                        "--measured-on", "GPU X"]) == 0  # the one failure is a finding
        m = json.loads(out.read_text())
        assert m["device"] == "GPU X" and m["versions"]["torch"] == "2.11" and m["versions"]["triton"] == "3.6"
        assert m["versions"]["cuda"] == "13.0"
        assert m["versions"]["fla"] is None  # not recorded by the rows: never this host's
        grid = {r["kernel"]: r for r in m["tables"]["cells"]["rows"]}
        assert grid[self.KERNEL]["accepted_zero"] == "1K" and grid[self.KERNEL]["golden"] == "1P"
        assert [r["verdict"] for r in m["tables"]["notable"]["rows"]] == ["known"]
        empty, _ = _entries(tmp_path)
        assert SC.main(["--merge", str(part), "--known-limitations", str(empty)]) == 1  # unregistered: a failure
        assert "FAIL " + self.KERNEL in capsys.readouterr().out
