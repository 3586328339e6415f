// libk3gc (gpu_check/include/k3gc.h) from Python: k3ref._core.K3gc(path). The library is
// opened at run time (dlopen) from the path the caller gives, so that a variant of it loads
// beside the tree's build; its functions, structs and codes are typed here by the header
// itself, so the Python side keeps no copy of them. Built with the rest of the module, CUDA or
// not: only opening a library needs one.
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "core.h"
#include "k3gc.h"
#include "k3gc_names.h"

namespace k3ref::python {
namespace {

// The fields of k3gc_kda_args. A value becomes its field by the field's type (assign): a
// device pointer from an int (0 or None: NULL), an integer code or size, or a double.
#define K3GC_KDA_FIELDS(X)                                                                            \
  X(q) X(k) X(v) X(g) X(beta) X(input_dtype) X(A_log) X(dt_bias) X(gate) X(lower_bound) X(beta_mode) \
  X(qk_l2norm) X(scale) X(B) X(T) X(H) X(HV) X(K) X(V) X(cu_seqlens) X(N) X(initial_state)            \
  X(final_state) X(state_dtype) X(state_v_first) X(o) X(output_dtype)

// The fields of k3gc_kda_grads.
#define K3GC_GRADS_FIELDS(X) \
  X(d_o) X(d_o_dtype) X(d_final_state) X(d_final_state_dtype) X(dq) X(dk) X(dv) X(dg) X(dbeta) X(d_initial_state) X(dA_log) X(ddt_bias)

#define K3GC_STATS_FIELDS(X)                                                                       \
  X(count) X(err_sq) X(ref_sq) X(floor_sq) X(max_abs) X(max_abs_index) X(max_ulp) X(max_ulp_index) \
  X(candidate_nan) X(candidate_inf) X(reference_nan) X(reference_inf) X(first_nonfinite_mismatch)  \
  X(first_offending)

template <class Field> void assign(Field& field, const py::handle& value, const char* fn, const char* name) {
  try {
    if constexpr (std::is_pointer_v<Field>) {
      field = value.is_none() ? nullptr : reinterpret_cast<Field>(value.cast<std::uintptr_t>());
    } else if constexpr (std::is_floating_point_v<Field>) {
      field = value.cast<double>();
    } else {
      field = static_cast<Field>(value.cast<std::int64_t>());
    }
  } catch (const py::cast_error&) {
    throw py::type_error(std::string("k3gc ") + fn + ": argument " + name + " is " +
                         std::string(py::str(value.get_type().attr("__name__"))) + ", not a number");
  }
}

// A struct from a dict that names each of its fields (visit(s, f) calls f(field, name) for
// each): a missing field or a key that names none is a ValueError.
template <class Struct, class Visit> Struct filled(const py::dict& values, const char* fn, Visit visit) {
  Struct s{};
  std::vector<std::string> names;
  visit(s, [&](auto& field, const char* name) {
    if (!values.contains(name)) throw py::value_error(std::string("k3gc ") + fn + ": no argument " + name);
    assign(field, values[name], fn, name);
    names.emplace_back(name);
  });
  for (const auto& item : values) {
    const std::string key = py::str(item.first);
    if (std::find(names.begin(), names.end(), key) == names.end())
      throw py::value_error(std::string("k3gc ") + fn + ": unknown argument " + key);
  }
  return s;
}

#define K3GC_VISIT(field) f(s.field, #field);

template <class F> F symbol(void* handle, const std::string& path, const char* name) {
  void* f = dlsym(handle, name);
  if (f == nullptr) throw std::runtime_error(path + ": no symbol " + name + " (not a libk3gc?)");
  return reinterpret_cast<F>(f);
}

struct K3gc {
  std::string path;
  decltype(&k3gc_compare) compare_fn = nullptr;
  decltype(&k3gc_kda_forward) kda_forward_fn = nullptr;
  decltype(&k3gc_kda_backward) kda_backward_fn = nullptr;
  decltype(&k3gc_last_error) last_error_fn = nullptr;

  explicit K3gc(const std::string& p) : path(p) {
    // RTLD_LOCAL: each handle keeps its symbols, so two builds load side by side. Never
    // closed: work the library enqueued may still run, and its CUDA modules go with it.
    void* handle = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) throw std::runtime_error(dlerror());
    compare_fn = symbol<decltype(&k3gc_compare)>(handle, p, "k3gc_compare");
    kda_forward_fn = symbol<decltype(&k3gc_kda_forward)>(handle, p, "k3gc_kda_forward");
    kda_backward_fn = symbol<decltype(&k3gc_kda_backward)>(handle, p, "k3gc_kda_backward");
    last_error_fn = symbol<decltype(&k3gc_last_error)>(handle, p, "k3gc_last_error");
    // A library built from another k3gc.h would read these codes otherwise: refused.
    const auto mutation_name = symbol<decltype(&k3gc_mutation_name)>(handle, p, "k3gc_mutation_name");
    const auto code = symbol<decltype(&k3gc_code)>(handle, p, "k3gc_code");
    for (int m = 0; m <= K3GC_MUT_COUNT; ++m) {
      const char *theirs = mutation_name(m), *ours = k3gc_mutation_name_of(m);
      if ((theirs == nullptr) != (ours == nullptr) || (theirs && std::strcmp(theirs, ours) != 0))
        throw std::runtime_error(p + ": built from another k3gc.h (its mutation " + std::to_string(m) + " is " +
                                 (theirs ? theirs : "none") + ", this build's " + (ours ? ours : "none") + ")");
    }
    const char *kind, *name;
    for (int i = 0, c; (c = k3gc_code_entry(i, &kind, &name)) >= 0; ++i)
      if (code(kind, name) != c)
        throw std::runtime_error(p + ": built from another k3gc.h (its code of " + kind + " " + name + " is " +
                                 std::to_string(code(kind, name)) + ", this build's " + std::to_string(c) + ")");
  }

  void check(int rc, const char* what) const {  // the library's messages name their function
    if (rc == 0) return;
    const std::string message = last_error_fn();
    throw std::runtime_error(message.empty() ? std::string(what) + " failed" : message);
  }

  void kda_forward(const py::dict& values, int precision, int mutation, std::uintptr_t stream) const {
    const auto a = filled<k3gc_kda_args>(values, "kda_forward", [](k3gc_kda_args& s, auto&& f) { K3GC_KDA_FIELDS(K3GC_VISIT) });
    int rc;
    {
      py::gil_scoped_release release;
      rc = kda_forward_fn(&a, precision, mutation, reinterpret_cast<void*>(stream));
    }
    check(rc, "k3gc_kda_forward");
  }

  void kda_backward(const py::dict& args, const py::dict& grads, std::uintptr_t stream) const {
    const auto a = filled<k3gc_kda_args>(args, "kda_backward", [](k3gc_kda_args& s, auto&& f) { K3GC_KDA_FIELDS(K3GC_VISIT) });
    const auto g = filled<k3gc_kda_grads>(grads, "kda_backward", [](k3gc_kda_grads& s, auto&& f) { K3GC_GRADS_FIELDS(K3GC_VISIT) });
    int rc;
    {
      py::gil_scoped_release release;
      rc = kda_backward_fn(&a, &g, reinterpret_cast<void*>(stream));
    }
    check(rc, "k3gc_kda_backward");
  }

  py::dict compare(std::uintptr_t candidate, int candidate_dtype, std::uintptr_t reference, int reference_dtype,
                   std::int64_t n, int format, double atol, double rtol, std::int64_t inner, std::int64_t extent,
                   std::int64_t window, std::uintptr_t window_err_sq, std::uintptr_t window_ref_sq,
                   std::uintptr_t stream) const {
    k3gc_stats s{};
    int rc;
    {
      py::gil_scoped_release release;
      rc = compare_fn(reinterpret_cast<const void*>(candidate), candidate_dtype, reinterpret_cast<const void*>(reference),
                      reference_dtype, n, format, atol, rtol, inner, extent, window,
                      reinterpret_cast<double*>(window_err_sq), reinterpret_cast<double*>(window_ref_sq), &s,
                      reinterpret_cast<void*>(stream));
    }
    check(rc, "k3gc_compare");
    py::dict r;
#define K3GC_PUT(field) r[#field] = s.field;
    K3GC_STATS_FIELDS(K3GC_PUT)
#undef K3GC_PUT
    return r;
  }
};

}  // namespace

void register_k3gc(py::module_& m) {
  m.def("k3gc_mutation_names", [] {
    py::list names;
    for (int i = 0; i < K3GC_MUT_COUNT; ++i) names.append(std::string(k3gc_mutation_name_of(i)));
    return names;
  }, "the names of k3gc.h's mutants, by code");
  m.def("k3gc_code", [](const std::string& kind, const std::string& name) {
    return k3gc_code_of(kind.c_str(), name.c_str());
  }, py::arg("kind"), py::arg("name"), "k3gc.h's code of a format, gate or beta mode; -1 if it has none");
  py::class_<K3gc>(m, "K3gc", "libk3gc opened from a path (k3ref.gpu_check.lib is its Python face)")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def_readonly("path", &K3gc::path)
      .def("kda_forward", &K3gc::kda_forward, py::arg("args"), py::arg("precision"), py::arg("mutation"),
           py::arg("stream"))
      .def("kda_backward", &K3gc::kda_backward, py::arg("args"), py::arg("grads"), py::arg("stream"))
      .def("compare", &K3gc::compare, py::arg("candidate"), py::arg("candidate_dtype"), py::arg("reference"),
           py::arg("reference_dtype"), py::arg("n"), py::arg("format"), py::arg("atol"), py::arg("rtol"),
           py::arg("inner"), py::arg("extent"), py::arg("window"), py::arg("window_err_sq"),
           py::arg("window_ref_sq"), py::arg("stream"));
}

}  // namespace k3ref::python
