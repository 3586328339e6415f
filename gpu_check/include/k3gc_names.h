/* gpu_check: the names of k3gc.h's codes, header-only, so that the library (k3gc_code,
 * k3gc_mutation_name) and its Python binding (k3ref._core, which needs the mutants' names
 * before any library is loaded) read one table. */
#ifndef K3GC_NAMES_H
#define K3GC_NAMES_H

#include <string.h>

#include "k3gc.h"

#ifdef __cplusplus
extern "C" {
#endif

static inline const char* k3gc_mutation_name_of(int mutation) {
  switch (mutation) {
    case K3GC_MUT_NONE: return "none";
    case K3GC_MUT_READ_AHEAD: return "read_ahead";
    case K3GC_MUT_DROP_LAST_CHUNK_DECAY: return "drop_last_chunk_decay";
    case K3GC_MUT_SKIP_PARTIAL_CHUNK: return "skip_partial_chunk";
    case K3GC_MUT_IGNORE_INITIAL_STATE: return "ignore_initial_state";
    case K3GC_MUT_VARLEN_OFF_BY_ONE: return "varlen_off_by_one";
    case K3GC_MUT_OOB_HEAD_READ: return "oob_head_read";
    case K3GC_MUT_NAN_RARE_BRANCH: return "nan_rare_branch";
    case K3GC_MUT_FUTURE_ANCHOR: return "future_anchor";
    case K3GC_MUT_OVERWRITE_INPUT: return "overwrite_input";
    case K3GC_MUT_INT32_OFFSET_WRAP: return "int32_offset_wrap";
    case K3GC_MUT_GRID_DROPS_SEQUENCES: return "grid_drops_sequences";
    case K3GC_MUT_LAST_CHUNK_READ_PAST_END: return "last_chunk_read_past_end";
    case K3GC_MUT_BF16_STATE_LONG_T: return "bf16_state_long_t";
    default: return NULL;
  }
}

/* Entry i of the table of named codes (kinds "format", "gate", "beta"): its code, with its
 * kind and name; -1 past the last entry. */
static inline int k3gc_code_entry(int i, const char** kind, const char** name) {
  static const struct {
    const char *kind, *name;
    int code;
  } names[] = {
      {"format", "fp64", K3GC_F64}, {"format", "fp32", K3GC_F32}, {"format", "bf16", K3GC_BF16},
      {"format", "fp16", K3GC_F16}, {"gate", "log_decay", K3GC_GATE_LOG_DECAY},
      {"gate", "softplus", K3GC_GATE_SOFTPLUS}, {"gate", "lower_bound", K3GC_GATE_LOWER_BOUND},
      {"beta", "as_given", K3GC_BETA_AS_GIVEN}, {"beta", "sigmoid", K3GC_BETA_SIGMOID},
      {"beta", "two_sigmoid", K3GC_BETA_TWO_SIGMOID}};
  if (i < 0 || (size_t)i >= sizeof(names) / sizeof(names[0])) return -1;
  *kind = names[i].kind;
  *name = names[i].name;
  return names[i].code;
}

/* -1 for a name or kind it does not know (k3gc_code). */
static inline int k3gc_code_of(const char* kind, const char* name) {
  const char *k, *n;
  int i, code;
  if (kind == NULL || name == NULL) return -1;
  for (i = 0; (code = k3gc_code_entry(i, &k, &n)) >= 0; ++i)
    if (strcmp(k, kind) == 0 && strcmp(n, name) == 0) return code;
  return -1;
}

#ifdef __cplusplus
}
#endif
#endif
