"""k3ref._core's binding of libk3gc (python/core/k3gc.cc), without CUDA: stand-in libraries built
here with the C compiler from gpu_check/include/k3gc.h take the library's place. One echoes
the k3gc_kda_args it receives, so every field Python passes is read back as the library sees
it; one was built from another header (a renamed mutant, a renumbered code) and is refused.
The tree's own libk3gc.so, where nvcc built one, answers its argument checks (no GPU needed
before its first launch). Skipped without k3ref._core or a C compiler."""
import shutil
import subprocess
from pathlib import Path

import pytest

from k3ref._data import compiled

try:
    core = compiled()
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = ROOT / "gpu_check" / "include"

ECHO = r"""
#include <stdio.h>
#include "k3gc_names.h"
static char message[1024];
const char* k3gc_mutation_name(int m) { return k3gc_mutation_name_of(m); }
int k3gc_code(const char* kind, const char* name) { return k3gc_code_of(kind, name) + SHIFT; }
int k3gc_compare(const void* c, int cd, const void* r, int rd, int64_t n, int format, double atol, double rtol,
                 int64_t inner, int64_t extent, int64_t window, double* we, double* wr, k3gc_stats* out, void* s) {
  out->count = n; out->err_sq = atol; out->ref_sq = rtol; out->max_abs_index = (int64_t)(uintptr_t)c;
  out->max_ulp_index = (int64_t)(uintptr_t)r; out->first_offending = inner * 1000000 + extent * 1000 + window;
  out->candidate_nan = cd * 100 + rd * 10 + format; out->reference_inf = (int64_t)(uintptr_t)s;
  out->first_nonfinite_mismatch = (int64_t)((uintptr_t)we + (uintptr_t)wr);
  return 0;
}
int k3gc_kda_forward(const k3gc_kda_args* a, int precision, int mutation, void* stream) {
  snprintf(message, sizeof message,
           "q=%zu k=%zu v=%zu g=%zu beta=%zu input_dtype=%d A_log=%zu dt_bias=%zu gate=%d lower_bound=%g "
           "beta_mode=%d qk_l2norm=%d scale=%g B=%lld T=%lld H=%lld HV=%lld K=%lld V=%lld cu_seqlens=%zu N=%lld "
           "initial_state=%zu final_state=%zu state_dtype=%d state_v_first=%d o=%zu output_dtype=%d "
           "precision=%d mutation=%d stream=%zu",
           (size_t)a->q, (size_t)a->k, (size_t)a->v, (size_t)a->g, (size_t)a->beta, a->input_dtype,
           (size_t)a->A_log, (size_t)a->dt_bias, a->gate, a->lower_bound, a->beta_mode, a->qk_l2norm, a->scale,
           (long long)a->B, (long long)a->T, (long long)a->H, (long long)a->HV, (long long)a->K, (long long)a->V,
           (size_t)a->cu_seqlens, (long long)a->N, (size_t)a->initial_state, (size_t)a->final_state,
           a->state_dtype, a->state_v_first, (size_t)a->o, a->output_dtype, precision, mutation, (size_t)stream);
  return 1;  /* the message is the answer: returned as the call's error */
}
int k3gc_kda_backward(const k3gc_kda_args* a, const k3gc_kda_grads* g, void* stream) {
  snprintf(message, sizeof message,
           "T=%lld d_o=%zu d_o_dtype=%d d_final_state=%zu d_final_state_dtype=%d dq=%zu dk=%zu dv=%zu dg=%zu "
           "dbeta=%zu d_initial_state=%zu dA_log=%zu ddt_bias=%zu stream=%zu",
           (long long)a->T, (size_t)g->d_o, g->d_o_dtype, (size_t)g->d_final_state, g->d_final_state_dtype,
           (size_t)g->dq, (size_t)g->dk, (size_t)g->dv, (size_t)g->dg, (size_t)g->dbeta, (size_t)g->d_initial_state,
           (size_t)g->dA_log, (size_t)g->ddt_bias, (size_t)stream);
  return 1;
}
const char* k3gc_last_error(void) { return message; }
"""

ARGS = dict(q=1001, k=1002, v=1003, g=1004, beta=1005, input_dtype=2, A_log=None, dt_bias=1008, gate=1,
            lower_bound=-5.5, beta_mode=2, qk_l2norm=1, scale=0.125, B=3, T=37, H=2, HV=4, K=100, V=64,
            cu_seqlens=None, N=3, initial_state=1020, final_state=1021, state_dtype=0, state_v_first=1, o=1024,
            output_dtype=3)


def build(tmp_path, name, source, shift=0):
    # any of the build's compilers: a C++ driver compiles C with -x c (CI installs only g++)
    cc = next((c for c in ("cc", "gcc", "c++", "g++") if shutil.which(c)), None)
    if cc is None:
        pytest.skip("no C compiler for the stand-in library")
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / f"lib{name}.so"
    subprocess.run([cc, "-x", "c", "-std=c99", "-shared", "-fPIC", f"-DSHIFT={shift}", f"-I{INCLUDE}", "-o", str(out),
                    str(src)],
                   check=True, capture_output=True, text=True)
    return str(out)


def test_every_field_reaches_the_library_as_given(tmp_path):
    lib = core.K3gc(build(tmp_path, "echo", ECHO))
    with pytest.raises(RuntimeError) as e:
        lib.kda_forward(ARGS, 2, 5, 4242)
    seen = dict(item.split("=") for item in str(e.value).split())
    expected = {k: "0" if v is None else f"{v:g}" if isinstance(v, float) else str(v) for k, v in ARGS.items()}
    expected.update(precision="2", mutation="5", stream="4242")
    assert seen == expected


GRADS = dict(d_o=2001, d_o_dtype=2, d_final_state=None, d_final_state_dtype=1, dq=2005, dk=2006, dv=2007,
             dg=2008, dbeta=2009, d_initial_state=2010, dA_log=None, ddt_bias=2012)


def test_every_gradient_field_reaches_the_library_as_given(tmp_path):
    lib = core.K3gc(build(tmp_path, "echo", ECHO))
    with pytest.raises(RuntimeError) as e:
        lib.kda_backward(ARGS, GRADS, 77)
    seen = dict(item.split("=") for item in str(e.value).split())
    expected = {k: "0" if v is None else str(v) for k, v in GRADS.items()}
    expected.update(T="37", stream="77")
    assert seen == expected
    with pytest.raises(ValueError, match="k3gc kda_backward: no argument dq"):
        lib.kda_backward(ARGS, {k: v for k, v in GRADS.items() if k != "dq"}, 0)
    with pytest.raises(ValueError, match="k3gc kda_backward: unknown argument dx"):
        lib.kda_backward(ARGS, dict(GRADS, dx=1), 0)


def test_the_comparator_s_arguments_and_sums_come_back_by_name(tmp_path):
    lib = core.K3gc(build(tmp_path, "echo", ECHO))
    s = lib.compare(candidate=11, candidate_dtype=1, reference=12, reference_dtype=0, n=77, format=2, atol=0.5,
                    rtol=0.25, inner=4, extent=5, window=6, window_err_sq=100, window_ref_sq=200, stream=9)
    assert (s["count"], s["err_sq"], s["ref_sq"], s["max_abs_index"], s["max_ulp_index"]) == (77, 0.5, 0.25, 11, 12)
    assert (s["first_offending"], s["candidate_nan"], s["reference_inf"], s["first_nonfinite_mismatch"]) == \
        (4005006, 102, 9, 300)
    assert set(s) == {"count", "err_sq", "ref_sq", "floor_sq", "max_abs", "max_abs_index", "max_ulp", "max_ulp_index",
                      "candidate_nan", "candidate_inf", "reference_nan", "reference_inf", "first_nonfinite_mismatch",
                      "first_offending"}


def test_a_missing_unknown_or_mistyped_argument_is_one_line_and_nothing_is_called(tmp_path):
    lib = core.K3gc(build(tmp_path, "echo", ECHO))
    cases = [({k: v for k, v in ARGS.items() if k != "scale"}, "no argument scale"),
             (dict(ARGS, extra=1), "unknown argument extra"), (dict(ARGS, T="37"), "argument T is str")]
    for args, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            lib.kda_forward(args, 0, 0, 0)


def test_a_library_from_another_header_is_refused(tmp_path):
    renamed = ECHO.replace("return k3gc_mutation_name_of(m);",
                           'return m == 3 ? "skip_chunk" : k3gc_mutation_name_of(m);')
    with pytest.raises(RuntimeError, match=r"built from another k3gc.h \(its mutation 3 is skip_chunk, this build's "
                                           r"skip_partial_chunk\)"):
        core.K3gc(build(tmp_path, "renamed", renamed))
    with pytest.raises(RuntimeError, match=r"built from another k3gc.h \(its code of format fp64 is 1, this build's 0\)"):
        core.K3gc(build(tmp_path, "shifted", ECHO, shift=1))


def test_what_is_not_a_library_says_so(tmp_path):
    with pytest.raises(RuntimeError, match="cannot open shared object"):
        core.K3gc(str(tmp_path / "missing.so"))
    other = build(tmp_path, "other", "int something(void) { return 0; }\n")
    with pytest.raises(RuntimeError, match=r"no symbol k3gc_compare \(not a libk3gc\?\)"):
        core.K3gc(other)


def test_the_names_come_from_the_header():
    from k3ref.gpu_check import lib

    names = core.k3gc_mutation_names()
    assert names[0] == "none" and len(names) == len(set(names)) == 14
    assert lib.MUTATIONS == names
    assert set(lib.SCALE_MUTANTS) <= set(names)
    assert [core.k3gc_code("format", f) for f in ("fp64", "fp32", "bf16", "fp16")] == [0, 1, 2, 3]
    assert core.k3gc_code("gate", "no_such_gate") == -1


@pytest.mark.parametrize("path", sorted(ROOT.glob("build*/gpu_check/libk3gc.so")), ids=str)
def test_the_tree_s_build_answers_its_argument_checks(path):
    lib = core.K3gc(str(path))
    with pytest.raises(RuntimeError, match=r"^k3gc_kda_forward: K and V must be in \[1, 128\], got K=200 V=64$"):
        lib.kda_forward(dict(ARGS, K=200), 0, 0, 0)
    with pytest.raises(RuntimeError, match=r"^k3gc_kda_forward: the fp64 reference has no mutants$"):
        lib.kda_forward(dict(ARGS, cu_seqlens=None), 0, 3, 0)
    with pytest.raises(RuntimeError, match=r"^k3gc_kda_backward: K and V must be in \[1, 128\], got K=200 V=64$"):
        lib.kda_backward(dict(ARGS, K=200), GRADS, 0)
    with pytest.raises(RuntimeError, match=r"^k3gc_kda_backward: dA_log needs A_log and ddt_bias needs dt_bias$"):
        lib.kda_backward(dict(ARGS, dt_bias=None), GRADS, 0)
