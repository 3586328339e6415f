"""What the installed version of a kernel accepts, found from the kernel itself (its
signature, its source, a call): a case that needs an option or a feature the version lacks is
not applicable, "not supported by this version: option X", never a numeric failure.

- Options: a keyword is accepted when the function names it as a parameter, or when it has
  **kwargs and its source reads that key from them (`kwargs.get("A_log")`, `kwargs["x"]`,
  `kwargs.pop("x")`, `"x" in kwargs`: FLA's chunk_kda takes A_log and dt_bias so), or passes
  them on (`f(**kwargs)`: the callee takes them or refuses them itself). A keyword
  that would only fall into **kwargs is swallowed by an older version that ignores it, and
  its results would then be judged as errors of 1e2 to 1e32x: such a call is refused.
  Keywords at a neutral value (None, False) change nothing and are not refused.
- Features without a keyword (GVA, HV > H): the adapter's call itself is the trial. When it
  raises, the same problem with one value head per query head (HV = H) is run; if that one
  succeeds, the version does not support the feature (remembered for the process, so that
  the metamorphic checks pick a configuration without it); if it fails too, the first
  exception stands (an error, not a refusal).
"""
import ast
import inspect
import textwrap

import torch


from .protocol import NotSupported  # noqa: F401 (probe.NotSupported, where the probe raises it)


_ACCEPTED = {}
FORWARDS = "**"  # in the keys read: the function passes its **kwargs on to another call


def accepted_keywords(fn):
    """(named parameters, keys its source reads from **kwargs, whether it has **kwargs)."""
    fn = inspect.unwrap(fn)
    key = getattr(fn, "__code__", None) or id(fn)
    if key in _ACCEPTED:
        return _ACCEPTED[key]
    sig = inspect.signature(fn)
    named = {p.name for p in sig.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    var_kw = next((p.name for p in sig.parameters.values() if p.kind == p.VAR_KEYWORD), None)
    read = set()
    if var_kw:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            tree = None
        for node in ast.walk(tree) if tree is not None else ():
            # kwargs.get("x") / kwargs.pop("x") / kwargs["x"] / "x" in kwargs
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == var_kw and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                read.add(node.args[0].value)
            elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == var_kw
                  and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
                read.add(node.slice.value)
            elif isinstance(node, ast.Call) and any(kw.arg is None and isinstance(kw.value, ast.Name)
                                                    and kw.value.id == var_kw for kw in node.keywords):
                read.add(FORWARDS)  # f(**kwargs): the callee takes them, or refuses them itself
            elif (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
                  and isinstance(node.left.value, str) and len(node.comparators) == 1
                  and isinstance(node.comparators[0], ast.Name) and node.comparators[0].id == var_kw):
                read.add(node.left.value)
    out = (frozenset(named), frozenset(read), var_kw is not None)
    _ACCEPTED[key] = out
    return out


def neutral(value):
    return value is None or value is False


def unsupported_keyword(fn, kwargs):
    """The first keyword of `kwargs` (at a non-neutral value) that fn does not accept, or None.
    A signature of (*args, **kwargs) alone (a wrapper that hides the function) says nothing:
    None."""
    named, read, var_kw = accepted_keywords(fn)
    if var_kw and (not named or FORWARDS in read):
        return None
    for name, value in kwargs.items():
        if not neutral(value) and name not in named and name not in read:
            return name
    return None


def refuse_unknown(fn, kwargs):
    """Raises NotSupported when fn would not take one of these keywords."""
    name = unsupported_keyword(fn, kwargs)
    if name is not None:
        named, _, var_kw = accepted_keywords(fn)
        how = "it would fall into **kwargs, unread" if var_kw else "no such parameter"
        raise NotSupported(f"not supported by this version: option {name} ({how})")


def one_head_per_query_head(inputs):
    """The inputs with value heads 0, r, 2r, ... (r = HV / H): one per query head, HV = H."""
    H, HV = inputs["q"].shape[2], inputs["v"].shape[2]
    r = HV // H
    out = dict(inputs)
    for name in ("v", "g", "beta"):
        out[name] = inputs[name][:, :, ::r].contiguous()
    for name, dim in (("A_log", 0), ("dt_bias", 0), ("initial_state", 1)):
        t = inputs.get(name)
        if t is not None:
            out[name] = t.index_select(dim, torch.arange(0, HV, r, device=t.device)).contiguous()
    return out


def call_with_gva_trial(holder, call, inputs):
    """call(inputs); when HV > H and it raises, the HV = H control decides: GVA unsupported
    (holder.gva = False, NotSupported raised) or an error (the first exception re-raised)."""
    H, HV = inputs["q"].shape[2], inputs["v"].shape[2]
    if HV == H:
        return call(inputs)
    if getattr(holder, "gva", None) is False:
        raise NotSupported(gva_reason(H, HV))
    try:
        out = call(inputs)
    except Exception as first:
        try:
            call(one_head_per_query_head(inputs))
        except Exception:
            raise first from None
        holder.gva = False
        raise NotSupported(gva_reason(H, HV) + f"; it raised {type(first).__name__}: "
                           + str(first).splitlines()[0][:200] + ", and runs with HV = H") from None
    holder.gva = True
    return out


def gva_reason(H, HV):
    return f"not supported by this version: GVA ({HV} value heads over {H} query heads)"


def _stand_in_inputs(params, shapes):
    """Placeholders for the per-head and per-sequence inputs params imply (what decides keywords)."""
    x = {}
    if params.get("gate", "log_decay") != "log_decay":
        x["A_log"] = torch.zeros(1)
        x["dt_bias"] = torch.zeros(1)
    if params.get("initial_state", True):
        x["initial_state"] = torch.zeros(1)
    if params.get("cu_seqlens"):
        x["cu_seqlens"] = torch.zeros(2, dtype=torch.int64)
    return x


def trial_device(adapter):
    return "cuda" if getattr(adapter, "requires_cuda", False) and torch.cuda.is_available() else "cpu"


def gva_trial(adapter, params, shapes, call):
    """Runs the kernel once at these shapes and options (those the case compiles and autotunes
    anyway, T capped at 4,096); sets adapter.gva. Returns the refusal's reason or None."""
    from . import problems

    c = dict(name="probe", H=shapes["H"], HV=shapes["HV"], K=shapes["K"], V=shapes["V"],
             gate=params.get("gate", "log_decay"), lower_bound=params.get("lower_bound"),
             g_range=(-1.0, 0.0) if params.get("gate", "log_decay") == "log_decay" else (-4.0, 4.0),
             beta=params.get("beta", "as_given"), qk_l2norm=bool(params.get("qk_l2norm")),
             state_layout=params.get("state_layout", "k_first"))
    T = max(1, min(int(shapes.get("T") or 16), 4096))
    cu = params.get("cu_seqlens")
    cu = list(cu) if cu and cu[-1] == T else None
    inputs, p = problems.make_problem(c, T, 0, trial_device(adapter), cu_seqlens=cu,
                                      initial_state=bool(params.get("initial_state", True)))
    try:
        call_with_gva_trial(adapter, lambda x: call(x, p), inputs)
    except NotSupported as e:
        return str(e).split(";")[0]
    except Exception:  # the trial says nothing about GVA: the case's own run will
        return None
    return None


def version_reason(adapter, params, shapes, call):
    """None, or what of (params, shapes) the loaded kernel `adapter.fn` does not accept."""
    name = unsupported_keyword(adapter.fn, adapter.keywords(_stand_in_inputs(params, shapes), params))
    if name is not None:
        return f"not supported by this version: option {name}"
    if shapes and shapes.get("HV", 1) > shapes.get("H", 1):
        if getattr(adapter, "gva", None) is None:
            return gva_trial(adapter, params, shapes, call)
        if adapter.gva is False:
            return gva_reason(shapes["H"], shapes["HV"])
    return None
