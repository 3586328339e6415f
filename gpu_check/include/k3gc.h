/* gpu_check: C interface of the CUDA library (docs/gpu_check.md).
 *
 * Device pointers in, statistics out. Every function returns 0 on success and a
 * non-zero code otherwise; k3gc_last_error() then says what went wrong. All work is
 * enqueued on `stream` (a cudaStream_t, NULL for the legacy default stream); the
 * statistics functions synchronise that stream before returning.
 */
#ifndef K3GC_H
#define K3GC_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { K3GC_F64 = 0, K3GC_F32 = 1, K3GC_BF16 = 2, K3GC_F16 = 3 } k3gc_dtype;

/* The sums and extremes of a candidate against a reference, accumulated in fp64. No figure
 * is derived here: the caller makes them figures and verdicts in k3ref's one judge
 * (k3ref::check::rel_rms_of_sums: rel RMS = sqrt(err_sq / ref_sq), floor = sqrt(floor_sq / ref_sq)). */
typedef struct {
  int64_t count;                  /* elements compared */
  double err_sq, ref_sq;          /* sums of (x - r)^2 and r^2 over pairs that are both finite */
  double floor_sq;                /* sum of (r rounded to `format` - r)^2 over the same pairs */
  double max_abs;
  int64_t max_abs_index;
  double max_ulp;                 /* in ulps of `format` at the reference */
  int64_t max_ulp_index;
  int64_t candidate_nan, candidate_inf, reference_nan, reference_inf;
  int64_t first_nonfinite_mismatch; /* first index where finiteness differs, -1 if none */
  int64_t first_offending;        /* first index with |x-r| > atol + rtol*|r| or a finiteness mismatch */
} k3gc_stats;

/* Compares n elements. `format` is the candidate's output dtype (ulps and floor).
 * When window_err_sq and window_ref_sq (device arrays of n_windows doubles, zeroed here)
 * are given, element i adds to window ((i / inner) % extent) / window, i.e. the error by
 * token position for a [B, T, HV, V] tensor with inner = HV*V, extent = T. */
int k3gc_compare(const void* candidate, int candidate_dtype, const void* reference, int reference_dtype,
                 int64_t n, int format, double atol, double rtol,
                 int64_t inner, int64_t extent, int64_t window,
                 double* window_err_sq, double* window_ref_sq,
                 k3gc_stats* out, void* stream);

typedef enum { K3GC_GATE_LOG_DECAY = 0, K3GC_GATE_SOFTPLUS = 1, K3GC_GATE_LOWER_BOUND = 2 } k3gc_gate;
typedef enum { K3GC_BETA_AS_GIVEN = 0, K3GC_BETA_SIGMOID = 1, K3GC_BETA_TWO_SIGMOID = 2 } k3gc_beta;

/* The deliberately wrong kernels: each is the fp32 kernel with one mistake. */
typedef enum {
  K3GC_MUT_NONE = 0,
  K3GC_MUT_READ_AHEAD = 1,             /* the query of token t is read from token t+1 */
  K3GC_MUT_DROP_LAST_CHUNK_DECAY = 2,  /* no decay inside the last 16-token chunk */
  K3GC_MUT_SKIP_PARTIAL_CHUNK = 3,     /* a partial final chunk is not computed */
  K3GC_MUT_IGNORE_INITIAL_STATE = 4,
  K3GC_MUT_VARLEN_OFF_BY_ONE = 5,      /* sequences after the first read from cu_seqlens[n] - 1 */
  K3GC_MUT_OOB_HEAD_READ = 6,          /* K rounded up to a power of two when reading q, k, g */
  K3GC_MUT_NAN_RARE_BRANCH = 7,        /* NaN when a gate is below -6 */
  K3GC_MUT_FUTURE_ANCHOR = 8,          /* decay via a chunk-middle anchor (a future row) */
  K3GC_MUT_OVERWRITE_INPUT = 9,        /* writes beta * v back into v */
  /* The scale mutants: identical to the fp32 kernel below the sizes where they break, so only
   * the scale tier (docs/gpu_check.md) can catch them. */
  K3GC_MUT_INT32_OFFSET_WRAP = 10,     /* flat token-tensor offsets kept in 31 bits: past 2^31 elements
                                          they wrap to the start of the tensor */
  K3GC_MUT_GRID_DROPS_SEQUENCES = 11,  /* (sequence, head) pairs on a grid axis capped at 65,535:
                                          the pairs beyond it are never computed */
  K3GC_MUT_LAST_CHUNK_READ_PAST_END = 12, /* a last 16-token tile holding 1 to 8 tokens is loaded
                                          whole, the rows past the end zeroed by multiplying with 0
                                          (harmless on finite memory, NaN on NaN) */
  K3GC_MUT_BF16_STATE_LONG_T = 13,     /* past 4,096 tokens of a sequence the state is kept in bf16 */
  K3GC_MUT_COUNT = 14
} k3gc_mutation;

/* KDA forward, conventions of docs/conventions.md. Shapes: q, k [B,T,H,K]; v [B,T,HV,V];
 * g [B,T,HV,K] (log decay, or the raw gate input when gate != LOG_DECAY); beta [B,T,HV];
 * A_log [HV] and dt_bias [HV*K] fp32 or NULL; with cu_seqlens (device, int64, N+1) B = 1.
 * States [N,HV,K,V] (or [N,HV,V,K] when state_v_first) of state_dtype, either may be NULL.
 * K, V <= 128. */
typedef struct {
  const void *q, *k, *v, *g, *beta;
  int input_dtype;
  const float* A_log;
  const float* dt_bias;
  int gate;
  double lower_bound;
  int beta_mode;
  int qk_l2norm;
  double scale;
  int64_t B, T, H, HV, K, V;
  const int64_t* cu_seqlens;
  int64_t N;
  const void* initial_state;
  void* final_state;
  int state_dtype;
  int state_v_first;
  void* o;
  int output_dtype;
} k3gc_kda_args;

/* precision 0: the fp64 reference (mutation must be 0), its plain kernel (the definition);
 * 1: fp32 arithmetic; 2: the fp64 reference's fast form (mutation must be 0): bit for bit the
 * results of precision 0 (tests/gpu_check/test_fp64_reference.py), what long references run.
 * It stages its inputs as fp64 into a device workspace of at most 1 GiB, taken on `stream`
 * (cudaMallocAsync) for the call: windows of 2^27 / ((2 H + 2 HV) * 128 + HV) tokens (at least
 * 8), the state carried across them in fp64 (a second 2 * HV * 128 * 128 doubles when there is
 * more than one window); with cu_seqlens it first reads cu_seqlens to the host, synchronising
 * `stream`, and refuses one that decreases or leaves [0, T]. Any other value is an error. */
int k3gc_kda_forward(const k3gc_kda_args* args, int precision, int mutation, void* stream);

/* The gradients of the fp64 reference (k3gc_kda_backward), every one fp64 and of its input's
 * shape: dq, dk [B,T,H,K]; dv [B,T,HV,V]; dg [B,T,HV,K] (of g as given: the raw gate input
 * when gate != LOG_DECAY); dbeta [B,T,HV] (of beta as given); d_initial_state in the state
 * layout ([N,HV,K,V] or [N,HV,V,K]); dA_log [HV] and ddt_bias [HV*K] when the forward has
 * A_log and dt_bias. An output left NULL is not written (dq..dbeta are needed when T > 0).
 * d_o [B,T,HV,V] of d_o_dtype; d_final_state (state layout, d_final_state_dtype) or NULL for 0. */
typedef struct {
  const void* d_o;
  int d_o_dtype;
  const void* d_final_state;
  int d_final_state_dtype;
  double *dq, *dk, *dv, *dg, *dbeta, *d_initial_state, *dA_log, *ddt_bias;
} k3gc_kda_grads;

/* KDA backward in fp64: the gradients of the forward of precision 0 for `args` (its o and
 * final_state are not read) given the outputs' gradients. One plain definition, deterministic
 * (every sum in a fixed order; no atomics), tested against the 256-bit gradient goldens and
 * PyTorch's autograd of the fp64 recurrence (tests/gpu_check/test_fp64_backward.py). Per
 * (sequence, value head) it runs the recurrence forward once, keeping the state at every 64th
 * token, then backward 64 tokens at a time from the state recomputed there. Device memory,
 * taken on `stream` for the call: (2 H + 4 HV) * 128 + 3 HV doubles per token, and 128 KiB per
 * kept state of a batch of (sequence, head) pairs sized to about 8 GiB. */
int k3gc_kda_backward(const k3gc_kda_args* args, const k3gc_kda_grads* grads, void* stream);

/* The code of a name: kind "format" (the policy table's fp64, fp32, bf16, fp16: a k3gc_dtype),
 * "gate" (log_decay, softplus, lower_bound) or "beta" (as_given, sigmoid, two_sigmoid);
 * -1 for a name or kind it does not know. */
int k3gc_code(const char* kind, const char* name);

const char* k3gc_mutation_name(int mutation);
const char* k3gc_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
