// The k3ref command: golden suites, reference KDA outputs for user inputs, and
// comparison of a kernel's outputs against a golden under a named tolerance policy.
//
// Exit codes: 0 success / pass; 1 a difference or a failed check; 2 unusable input
// (bad arguments, unreadable or malformed files).
#include "command_line.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <new>
#include <set>
#include <thread>
#include <unordered_map>

#include "k3ref/check/judgement.h"
#include "k3ref/check/metrics.h"
#include "k3ref/check/policy_table.h"
#include "k3ref/error.h"
#include "golden/suite.h"
#include "golden/kda_family.h"
#include "k3ref/io/file.h"
#include "k3ref/io/kernel_domains.h"
#include "k3ref/io/memory_budget.h"
#include "k3ref/io/safetensors.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/kda/recurrent.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/scalar.h"
#include "k3ref/num/tier.h"
#include "k3ref/tensor/convert.h"
#include "k3ref/vocabulary.h"
#include "report/cost.h"

namespace {

using namespace k3ref;
namespace fs = std::filesystem;

constexpr int exit_ok = 0, exit_fail = 1, exit_unusable = 2;

int default_jobs() { return std::max(1u, std::thread::hardware_concurrency()); }

// Most threads --jobs and --threads accept: more is a typo, and each thread costs memory.
constexpr int max_threads = 1024;

// ---- named-value options -----------------------------------------------------------------
// Their names, help and default are the options vocabulary's (k3ref/vocabulary.h): --gate is
// option "gate", --gate-base "gate_base". A value not in the table fails with CLI11's
// "--gate: must be one of ..., not '...'".

CLI::Option* add_choice_option(CLI::App* app, std::string_view option, std::string& target) {
  const OptionVocabulary& v = option_vocabulary(option);
  target = std::string(v.default_name);
  std::string flag = "--" + std::string(option);
  std::replace(flag.begin(), flag.end(), '_', '-');
  std::string listed;
  for (std::string_view n : v.names()) (listed += listed.empty() ? "" : ",") += n;
  CLI::Validator member(
      [&v](std::string& text) { return v.contains(text) ? std::string() : not_one_of(v.names(), text); },
      "{" + listed + "}");
  return app->add_option(flag, target, v.help())->check(member)->capture_default_str();
}

// ---- strict numeric options ------------------------------------------------------------
// CLI11 2.1 converts numbers with strtod/strtoll: it takes "nan" and "inf" for a double and
// clamps an integer beyond the type's range to its limit without a word. These options
// parse with std::from_chars instead: the whole text must be the number, in range, finite.

template <class Int>
CLI::Option* add_integer_option(CLI::App* app, const std::string& name, Int& target, Int lowest, Int highest,
                                const std::string& description) {
  const std::string shown = name.substr(0, name.find(','));
  return app
      ->add_option_function<std::string>(
          name,
          [&target, shown, lowest, highest](const std::string& text) {
            Int value{};
            const char* end = text.data() + text.size();
            const auto [stop, error] = std::from_chars(text.data(), end, value);
            const std::string range = "[" + std::to_string(lowest) + ", " + std::to_string(highest) + "]";
            if (error == std::errc::result_out_of_range || (error == std::errc() && stop == end && (value < lowest || value > highest)))
              throw CLI::ValidationError(shown, io::excerpt(text) + " is outside " + range);
            if (error != std::errc() || stop != end)
              throw CLI::ValidationError(shown, io::excerpt(text) + " is not a decimal integer in " + range);
            target = value;
          },
          description)
      ->type_name("INT");
}

CLI::Option* add_finite_option(CLI::App* app, const std::string& name, std::optional<double>& target,
                               const std::string& description) {
  return app
      ->add_option_function<std::string>(
          name,
          [&target, name](const std::string& text) {
            double value = 0;
            const char* end = text.data() + text.size();
            const auto [stop, error] = std::from_chars(text.data(), end, value);
            if (error == std::errc::result_out_of_range)
              throw CLI::ValidationError(name, io::excerpt(text) + " is outside the range of a double");
            if (error != std::errc() || stop != end) throw CLI::ValidationError(name, io::excerpt(text) + " is not a number");
            if (!std::isfinite(value)) throw CLI::ValidationError(name, io::excerpt(text) + " is not finite");
            target = value;
          },
          description)
      ->type_name("FLOAT");
}

golden::Progress stderr_progress() {
  return [](std::size_t done, std::size_t total, const std::string& name, double seconds) {
    std::fprintf(stderr, "[%3zu/%zu] %-40s %7.2f s\n", done, total, name.c_str(), seconds);
  };
}

// ---- golden generate / verify / list ---------------------------------------------------

struct GoldenArgs {
  std::string suite = "default";
  std::string out = "goldens";
  std::string dir = "goldens";
  std::string generated;
  std::vector<std::string> only;
  int jobs = default_jobs();
  bool quiet = false;
  bool force = false;
  bool subset = false;  // verify: a subset suite (generate --only) is asked for
  std::string op;        // list: only cases of this operator (or operator prefix)
  std::string kernel;    // list: only cases inside this built-in kernel's domain
  bool json = false;     // list: JSON instead of the table
};

int golden_generate(const GoldenArgs& a) {
  std::vector<golden::Case> cases = golden::suite(a.suite);
  const bool subset = !a.only.empty();
  if (subset) {
    // Catalogue order, each case once however often it is named.
    const std::set<std::string> wanted(a.only.begin(), a.only.end());
    for (const auto& name : wanted)
      if (std::none_of(cases.begin(), cases.end(), [&](const golden::Case& c) { return c.name == name; }))
        throw InvalidArgument("golden generate: argument '--only': no case named " + io::excerpt(name) +
                              " in suite " + io::excerpt(a.suite));
    std::erase_if(cases, [&](const golden::Case& c) { return !wanted.count(c.name); });
  }
  // Before any computing: the directory must take the suite without losing a file that
  // k3ref did not write, and --only never shrinks a manifest that lists more cases.
  golden::check_suite_output(a.out, cases, subset, a.force);
  // One generate at a time per directory: a second one refuses at once instead of interleaving
  // its files and manifest with the first's. Under the lock, the directory is checked again
  // and the temporaries of an interrupted earlier run are removed (nobody else holds them).
  std::error_code ec;
  fs::create_directories(a.out, ec);
  const io::DirectoryLock lock(a.out, "golden generate: --out");
  golden::check_suite_output(a.out, cases, subset, a.force);
  golden::remove_own_temporaries(a.out, cases);
  const auto start = std::chrono::steady_clock::now();
  const auto generated = golden::generate_cases(cases, a.jobs, a.quiet ? golden::Progress{} : stderr_progress());
  golden::write_suite(a.out, a.suite, generated, subset);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("wrote %zu cases and MANIFEST.json to %s in %.1f s\n", generated.size(), io::printable(a.out).c_str(), seconds);
  return exit_ok;
}

int golden_verify(const GoldenArgs& a) {
  golden::VerifyOptions options;
  options.jobs = a.jobs;
  if (!a.generated.empty()) options.generated_dir = fs::path(a.generated);
  if (!a.quiet) options.progress = stderr_progress();
  if (!fs::is_directory(a.dir)) {
    std::fprintf(stderr, "k3ref golden verify: --dir %s: not a directory\n", io::printable(a.dir).c_str());
    return exit_unusable;
  }
  // A manifest that cannot be read or parsed is unusable input (exit 2, one line), not a
  // difference: nothing can be verified against it.
  const golden::Manifest manifest = golden::read_manifest(fs::path(a.dir) / "MANIFEST.json");
  const std::size_t suite_cases = golden::suite(manifest.suite).size();
  // Verifying fewer cases than the suite holds passes only when asked for: a manifest marked
  // as a subset (or cut down to one) must not make a folder of missing files "match".
  if (manifest.subset && !a.subset) {
    std::printf("golden verify: %s: MANIFEST.json marks a subset suite (%zu of the %zu cases of suite '%s'); "
                "verifying a subset needs --subset\n",
                io::printable(a.dir).c_str(), manifest.cases.size(), suite_cases, io::printable(manifest.suite).c_str());
    return exit_fail;
  }
  if (manifest.cases.empty()) {
    std::printf("golden verify: %s: MANIFEST.json lists no case: nothing to verify\n", io::printable(a.dir).c_str());
    return exit_fail;
  }
  const auto problems = golden::verify_suite(a.dir, options);
  for (const auto& p : problems)
    std::printf("DIFFERENT %s%s: %s\n", io::printable(p.file).c_str(),
                p.tensor.empty() ? "" : (" tensor " + io::excerpt(p.tensor)).c_str(), io::printable(p.what).c_str());
  if (!problems.empty()) {
    std::printf("golden verify: %zu problem(s) in %s\n", problems.size(), io::printable(a.dir).c_str());
    return exit_fail;
  }
  std::printf("golden verify: every file in %s matches the %s (%s)\n", io::printable(a.dir).c_str(),
              a.generated.empty() ? "regenerated suite" : ("suite in " + io::printable(a.generated)).c_str(),
              manifest.subset ? ("a subset: " + std::to_string(manifest.cases.size()) + " of " +
                                 std::to_string(suite_cases) + " cases").c_str()
                              : (std::to_string(manifest.cases.size()) + " cases").c_str());
  return exit_ok;
}

// One cell of the list's table: a case's parameter, "-" where the case has none.
std::string list_cell(const nlohmann::json& params, const char* key) {
  const auto it = params.find(key);
  if (it == params.end() || it->is_null()) return "-";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_boolean()) return it->get<bool>() ? "yes" : "no";
  return it->dump();
}

// The storage format of a golden's inputs as the kernel domains name it ("bf16").
std::string input_format_name(DType d) {
  switch (d) {
    case DType::BF16: return "bf16";
    case DType::F16: return "fp16";
    case DType::F32: return "fp32";
    case DType::F64: return "fp64";
    default: return std::string(dtype_name(d));
  }
}

int golden_list(const GoldenArgs& a) {
  const io::KernelDomain* domain = nullptr;
  if (!a.kernel.empty()) {
    const auto& domains = io::KernelDomains::builtin();
    domain = domains.find(a.kernel);
    if (!domain) {
      const auto known = domains.names();
      std::fprintf(stderr, "k3ref golden list: --kernel %s\n",
                   not_one_of(std::vector<std::string_view>(known.begin(), known.end()), a.kernel).c_str());
      return exit_unusable;
    }
  }
  const std::string input_format = input_format_name(golden::KdaInputStorage{}.values_dtype);
  std::vector<golden::Case> cases;
  std::set<std::string> ops;
  std::size_t of_op = 0;
  for (auto& c : golden::suite(a.suite)) {
    ops.insert(c.op);
    // --op names one operator, or a prefix of several ("kda.chunkwise" lists both forms).
    if (!a.op.empty() && c.op != a.op && c.op.rfind(a.op, 0) != 0) continue;
    ++of_op;
    if (!domain || !domain->outside(c.op, c.params, input_format)) cases.push_back(std::move(c));
  }
  if (of_op == 0) {
    std::vector<std::string_view> names(ops.begin(), ops.end());
    std::fprintf(stderr, "k3ref golden list: --op %s\n", not_one_of(names, a.op).c_str());
    return exit_unusable;
  }
  if (a.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& c : cases) out.push_back({{"name", c.name}, {"op", c.op}, {"params", c.params}});
    std::printf("%s\n", out.dump(1).c_str());
    return exit_ok;
  }
  const std::pair<const char*, int> columns[] = {{"B", 3}, {"T", 5}, {"H", 3}, {"HV", 3}, {"K", 4}, {"V", 4},
                                                {"gate", 11}, {"beta", 12}, {"state_layout", 12}};
  std::printf("%-44s %-24s", "case", "op");
  for (const auto& [col, width] : columns) std::printf(" %-*s", width, col);
  std::printf(" varlen\n");
  for (const auto& c : cases) {
    std::printf("%-44s %-24s", c.name.c_str(), c.op.c_str());
    for (const auto& [col, width] : columns) std::printf(" %-*s", width, list_cell(c.params, col).c_str());
    const auto cu = c.params.find("cu_seqlens");
    std::printf(" %s\n", cu != c.params.end() && cu->is_array() ? cu->dump().c_str() : "-");
  }
  std::printf("%zu of the %zu cases of suite '%s'%s%s (--json for every parameter)\n", cases.size(),
              golden::suite(a.suite).size(), a.suite.c_str(), a.op.empty() ? "" : (" with operator " + a.op + "*").c_str(),
              domain ? (" inside the domain of " + a.kernel).c_str() : "");
  return exit_ok;
}

// ---- kda ---------------------------------------------------------------------------------

struct KdaArgs {
  std::string in, out;
  std::string gate, gate_base, beta, state_layout, precision;  // names of the options vocabulary
  std::optional<double> lower_bound, scale;
  bool l2norm = false, all_states = false, no_final_state = false;
  int threads = default_jobs();
  std::optional<double> progress_after;  // seconds; empty: exec::ProgressLines::default_after_seconds
  bool force = false;
  std::string memory_budget;  // bytes, with an optional K/M/G/T suffix (binary); empty: half the machine's memory
};

// The memory budget of a `k3ref kda` or `k3ref inputs` run in bytes: the text of
// --memory-budget, else (empty) half of the machine's physical memory (io/memory_budget.h, the
// rule the Python package's memory_budget= follows too).
std::int64_t memory_budget(const std::string& text) { return io::parse_memory_budget(text, "option --memory-budget"); }

// Bounds on what `k3ref kda` computes, checked from the shapes before anything is
// allocated: a file with T = 0 has no elements, so its size bounds nothing, yet its shapes
// may declare 2^36 heads or 2^40 sequences. The limits are far above any real layer
// (docs/robustness.md): sequence-head pairs N x HV (one state each) and the elements of
// each output (final_state N x HV x K x V; o; all_states B x T x HV x K x V).
constexpr std::int64_t max_kda_sequence_heads = std::int64_t{1} << 20;
constexpr std::int64_t max_kda_output_elements = std::int64_t{1} << 28;

std::string fmt_gib(double bytes) {
  char text[32];
  if (bytes >= static_cast<double>(std::int64_t{1} << 30))
    std::snprintf(text, sizeof text, "%.2f GiB", bytes / static_cast<double>(std::int64_t{1} << 30));
  else
    std::snprintf(text, sizeof text, "%.1f MiB", bytes / static_cast<double>(std::int64_t{1} << 20));
  return text;
}

void check_kda_work(const io::SafetensorsFile& file, const KdaArgs& a) {
  const io::RawTensor* q = file.find("q");
  const io::RawTensor* v = file.find("v");
  if (!q || !v || q->shape.size() != 4 || v->shape.size() != 4) return;  // the library names the problem
  const std::int64_t B = q->shape[0], T = q->shape[1], K = q->shape[3], HV = v->shape[2], V = v->shape[3];
  std::int64_t N = B;
  if (const io::RawTensor* cu = file.find("cu_seqlens"); cu && cu->shape.size() == 1 && cu->shape[0] > 0)
    N = cu->shape[0] - 1;
  const std::string where = io::printable(a.in) + ": tensors 'q', 'v'";
  auto product = [&](std::initializer_list<std::int64_t> factors, const char* what) {
    std::int64_t p = 1;
    for (std::int64_t f : factors)
      if (f < 0 || __builtin_mul_overflow(p, f, &p))
        throw FileError(where + ": " + what + " overflows 63 bits");
    return p;
  };
  const std::int64_t pairs = product({N, HV}, "sequences x value heads");
  if (pairs > max_kda_sequence_heads)
    throw FileError(where + ": N = " + std::to_string(N) + " sequences x HV = " + std::to_string(HV) +
                    " value heads = " + std::to_string(pairs) + " sequence-heads, over the limit of " +
                    std::to_string(max_kda_sequence_heads));
  auto bounded = [&](std::int64_t elements, const char* output) {
    if (elements > max_kda_output_elements)
      throw FileError(where + ": output '" + output + "' would hold " + std::to_string(elements) +
                      " elements, over the limit of " + std::to_string(max_kda_output_elements));
  };
  const std::int64_t final_elements =
      a.no_final_state ? 0 : product({pairs, K, V}, "final_state size N x HV x K x V");
  const std::int64_t o_elements = product({B, T, HV, V}, "o size B x T x HV x V");
  const std::int64_t all_elements = a.all_states ? product({B, T, HV, K, V}, "all_states size B x T x HV x K x V") : 0;
  if (!a.no_final_state) bounded(final_elements, "final_state");
  bounded(o_elements, "o");
  if (a.all_states) bounded(all_elements, "all_states");
  // The working memory, estimated before anything is allocated: the outputs in the tier and
  // as doubles, the inputs lifted to the tier, and each thread's states (the one it carries
  // and those of the sequence-heads it has finished: at most all of them). All are within
  // 2^28 elements by now, so the sums stay far from overflow.
  const num::Tier tier = num::precision_tiers.parse(a.precision.empty() ? "double" : a.precision);
  std::int64_t inputs = 0;
  for (const auto& [name, t] : file.tensors) inputs += static_cast<std::int64_t>(io::checked_element_count(t, name));
  const std::int64_t threads = std::max<std::int64_t>(1, std::min<std::int64_t>(a.threads, pairs));
  io::WorkShape work;
  work.outputs = final_elements + o_elements + all_elements;
  work.inputs = inputs;
  work.sequence_heads = pairs;
  work.threads = a.threads;
  work.K = K;
  work.V = V;
  const double need = io::working_memory(work, tier != num::Tier::double_);
  const std::int64_t budget = memory_budget(a.memory_budget);
  if (need > static_cast<double>(budget))
    throw FileError(where + ": the run needs about " + fmt_gib(need) + " of memory (" +
                    std::string(num::to_string(tier)) + ", " + std::to_string(threads) + " thread(s), K = " +
                    std::to_string(K) + ", V = " +
                    std::to_string(V) + "), over the budget of " + fmt_gib(static_cast<double>(budget)) +
                    " (--memory-budget; default half the machine's memory)");
}

kda::Options<double> kda_options(const KdaArgs& a) {
  kda::Options<double> opt;
  opt.scale = a.scale;
  opt.lower_bound = a.lower_bound;
  opt.qk_l2norm = a.l2norm;
  opt.gate = kda::gate_forms.parse(a.gate);
  opt.gate_base = kda::gate_bases.parse(a.gate_base);
  opt.beta = kda::beta_forms.parse(a.beta);
  opt.state_layout = kda::state_layouts.parse(a.state_layout);
  opt.output_final_state = !a.no_final_state;
  opt.output_all_states = a.all_states;
  opt.num_threads = a.threads;
  return opt;
}

template <class S>
kda::Outputs<double> run_kda(const kda::Inputs<double>& in, const kda::Options<double>& options) {
  const kda::Outputs<S> r = kda::recurrent_forward(kda::lift<S>(in), kda::convert_options<S>(options));
  auto down = [](const Tensor<S>& t) { return t.template map<double>([](const S& x) { return num::to_double_rne(x); }); };
  kda::Outputs<double> out{down(r.o), std::nullopt, std::nullopt};
  if (r.final_state) out.final_state = down(*r.final_state);
  if (r.all_states) out.all_states = down(*r.all_states);
  return out;
}

int kda_command(const KdaArgs& a) {
  // Before any reading or computing: the output must be writable and must not destroy
  // the input, a device, a FIFO or a symlink's target.
  io::check_output_path(a.out, io::OutputCheck{{fs::path(a.in)}, a.force, "--out"});
  const io::SafetensorsFile file = io::read_safetensors(a.in);
  check_kda_work(file, a);
  const kda::Inputs<double> in = kda::inputs_from_file(file, a.in);
  const auto start = std::chrono::steady_clock::now();
  kda::Options<double> opt = kda_options(a);
  const num::Tier tier = num::precision_tiers.parse(a.precision);
  // Lines on stderr every few seconds when the run is estimated to take long (a 256-bit
  // reference of a long sequence takes minutes); none for a short one.
  exec::ProgressLines progress = kda::recurrent_progress(
      "k3ref kda", in, opt, tier != num::Tier::double_,
      a.progress_after.value_or(exec::ProgressLines::default_after_seconds), [](const std::string& line) {
        std::fprintf(stderr, "%s\n", line.c_str());
        std::fflush(stderr);
      });
  opt.progress = progress.hook();
  const kda::Outputs<double> out =
      tier == num::Tier::double_ ? run_kda<double>(in, opt) : run_kda<num::golden_float>(in, opt);
  progress.finish();
  io::SafetensorsFile result;
  kda::add_outputs(result, out);
  // The file is a golden of kda.recurrent (docs/golden-format.md, schema 2): its outputs
  // listed, every option it was computed with (by the command's names in k3ref.options, by
  // the goldens' parameter names in k3ref.params) and the policy it recommends, so that
  // `k3ref compare --golden <this> --candidate <kernel's>` and k3ref.goldens.load_case read it.
  const nlohmann::json number_or_null = nullptr;
  auto optional_number = [&](const std::optional<double>& x) { return x ? nlohmann::json(*x) : number_or_null; };
  const nlohmann::json named = {{kda::gate_forms.option, kda::to_string(opt.gate)},
                                {kda::gate_bases.option, kda::to_string(opt.gate_base)},
                                {kda::beta_forms.option, kda::to_string(opt.beta)},
                                {kda::state_layouts.option, kda::to_string(opt.state_layout)},
                                {num::precision_tiers.option, num::to_string(tier)},
                                {"l2norm", a.l2norm},
                                {"lower_bound", optional_number(a.lower_bound)},
                                {"scale", optional_number(a.scale)},
                                {"all_states", a.all_states},
                                {"no_final_state", a.no_final_state}};
  const nlohmann::json params = {{"gate", kda::to_string(opt.gate)},
                                 {"gate_base", kda::to_string(opt.gate_base)},
                                 {"beta", kda::to_string(opt.beta)},
                                 {"state_layout", kda::to_string(opt.state_layout)},
                                 {"qk_l2norm", a.l2norm},
                                 {"lower_bound", optional_number(a.lower_bound)},
                                 {"scale", optional_number(a.scale)},
                                 {"all_states", a.all_states},
                                 {"final_state", !a.no_final_state}};
  std::string outputs;
  for (const auto& [name, t] : result.tensors) outputs += (outputs.empty() ? "" : ",") + name;
  // The golden metadata of the catalogue's own files (schema, outputs, the policy the
  // kda.recurrent goldens recommend), for a case named after the output file; no seed: the
  // inputs are the user's.
  const golden::Case as_case{fs::path(a.out).stem().string(), "kda.recurrent", 0, params};
  auto metadata = golden::metadata_of(as_case, tier == num::Tier::double_ ? std::string("double")
                                                                         : golden::golden_float_precision(),
                                      result, outputs, "");
  metadata.erase("k3ref.seed");
  // Metadata must be UTF-8: a name that is not is recorded with its odd bytes as \xNN.
  metadata["k3ref.case"] = io::is_valid_utf8(as_case.name) ? as_case.name : io::printable(as_case.name);
  metadata["k3ref.precision"] = std::string(num::to_string(tier));
  metadata["k3ref.options"] = named.dump();
  metadata["k3ref.input_file"] = io::is_valid_utf8(a.in) ? a.in : io::printable(a.in);
  result.metadata = std::move(metadata);
  io::write_safetensors_atomic(a.out, result);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("wrote %s (%s reference, %.2f s)\n", io::printable(a.out).c_str(), a.precision.c_str(), seconds);
  return exit_ok;
}

// ---- inputs ------------------------------------------------------------------------------
// A random, seeded input file for `k3ref kda`, for users with no safetensors writer of their
// own. The values are the golden catalogue's (golden::draw_kda_inputs: the stream, order and
// ranges of the kda.recurrent goldens), the file goes through the writer every command uses,
// and the metadata records the seed and every option (not the file's name): the same
// arguments give the same bytes.

struct InputsArgs {
  std::string out;
  std::int64_t B = 1, T = 16, H = 1, HV = 0, K = 16, V = 16;  // HV 0: as H
  std::optional<std::vector<std::int64_t>> cu_seqlens;      // varlen: B = 1, T = the last offset
  std::uint64_t seed = 0;
  std::string dtype = "bf16";
  bool no_initial_state = false, l2norm = false, force = false;
  std::string gate, gate_base, beta, state_layout;  // names of the options vocabulary
  std::optional<double> lower_bound, scale;
  std::string memory_budget;
};

// --dtype: the storage of q, k, v, g, beta (their values rounded to it). The state is F32
// for bf16 (FLA's kernels want an fp32 state; the goldens store it so), A_log and dt_bias F32
// unless f64.
const std::vector<std::string_view> input_dtypes = {"bf16", "f32", "f64"};

golden::KdaInputStorage input_storage(const std::string& dtype) {
  using num::Format;
  if (dtype == "f32") return {Format::fp32, Format::fp32, Format::fp32, DType::F32, DType::F32, DType::F32};
  if (dtype == "f64") return {Format::fp64, Format::fp64, Format::fp64, DType::F64, DType::F64, DType::F64};
  return {};  // bf16: the goldens' storage
}

// The shortest text that reads back as `x`.
std::string shortest(double x) {
  char text[32];
  const auto [end, ec] = std::to_chars(text, text + sizeof text, x);
  return std::string(text, end);
}

// "0,5,12": the offsets of --cu-seqlens, each a decimal integer in range, starting at 0 and
// non-decreasing.
std::vector<std::int64_t> parse_cu_seqlens(const std::string& text) {
  const std::string option = "--cu-seqlens";
  std::vector<std::int64_t> offsets;
  std::size_t at = 0;
  while (true) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const std::string_view item(text.data() + at, comma - at);
    std::int64_t value = 0;
    const auto [stop, error] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (error != std::errc() || stop != item.data() + item.size() || value < 0 || value > max_kda_output_elements)
      throw CLI::ValidationError(option, "entry " + std::to_string(offsets.size()) + " " + io::excerpt(item) +
                                             " is not a decimal integer in [0, " +
                                             std::to_string(max_kda_output_elements) + "] (in " + io::excerpt(text) +
                                             ")");
    if (offsets.empty() && value != 0) throw CLI::ValidationError(option, "must start at 0, starts at " + std::to_string(value));
    if (!offsets.empty() && value < offsets.back())
      throw CLI::ValidationError(option, "must be non-decreasing, but entry " + std::to_string(offsets.size()) + " = " +
                                             std::to_string(value) + " < " + std::to_string(offsets.back()));
    if (offsets.size() > static_cast<std::size_t>(max_kda_sequence_heads))
      throw CLI::ValidationError(option, "more than " + std::to_string(max_kda_sequence_heads) + " sequences");
    offsets.push_back(value);
    if (comma == text.size()) return offsets;
    at = comma + 1;
  }
}

// The catalogue parameters of the file: shapes and options from the arguments, value ranges
// as the catalogue's cases draw them (the defaults of golden::KdaParams: q, v, initial_state
// in [-1, 1], k in [-1/sqrt(K), 1/sqrt(K)] unless l2norm, log-decays g in [-1, 0], beta in
// [0, 1]; decay factors in [1/e, 1]; raw gates and logits of beta in [-4, 4], A_log and
// dt_bias with the raw gates, as kda_gate_softplus and kda_flashkda_like do).
golden::KdaParams input_params(const InputsArgs& a) {
  golden::KdaParams p;
  p.B = a.B;
  p.T = a.T;
  p.H = a.H;
  p.HV = a.HV == 0 ? a.H : a.HV;
  p.K = a.K;
  p.V = a.V;
  if (a.cu_seqlens) {
    if (a.B != 1)
      throw InvalidArgument("inputs: --cu-seqlens packs the sequences into one batch row; it needs --B 1, got --B " +
                            std::to_string(a.B));
    p.cu_seqlens = *a.cu_seqlens;
    p.T = p.cu_seqlens.back();
  }
  if (p.HV % p.H != 0)
    throw InvalidArgument("inputs: --HV " + std::to_string(p.HV) + " must be a multiple of --H " + std::to_string(p.H) +
                          " (each q/k head serves HV / H value heads)");
  p.initial_state = !a.no_initial_state;
  p.gate = a.gate;
  p.gate_base = a.gate_base;
  const kda::GateForm gate = kda::gate_forms.parse(a.gate);
  if (gate == kda::GateForm::lower_bound && !a.lower_bound)
    throw InvalidArgument("inputs: --gate lower_bound needs --lower-bound (k3ref kda needs it too)");
  if (a.lower_bound && *a.lower_bound >= 0)
    throw InvalidArgument("inputs: --lower-bound " + shortest(*a.lower_bound) + " must be negative (k3ref kda refuses it)");
  if (gate != kda::GateForm::lower_bound && a.lower_bound)
    throw InvalidArgument("inputs: --lower-bound is only used by --gate lower_bound, gate is " + a.gate);
  if (gate == kda::GateForm::decay_factor) {
    p.g_lo = std::exp(-1.0);  // the decays of log-decays in [-1, 0]
    p.g_hi = 1;
  } else if (gate != kda::GateForm::log_decay) {
    p.g_lo = -4;
    p.g_hi = 4;
    p.A_log = p.dt_bias = true;
  }
  p.lower_bound = a.lower_bound;
  p.beta = a.beta;
  if (kda::beta_forms.parse(a.beta) != kda::BetaForm::as_given) {
    p.beta_lo = -4;
    p.beta_hi = 4;
  }
  p.qk_l2norm = a.l2norm;
  p.scale = a.scale;
  p.state_layout = a.state_layout;
  return p;
}

// The limits of `k3ref kda` (a file it would refuse is refused here) and the memory of
// drawing and writing, from the shapes, before anything is allocated.
void check_inputs_work(const golden::KdaParams& p, const InputsArgs& a) {
  const std::int64_t N = p.cu_seqlens.empty() ? p.B : static_cast<std::int64_t>(p.cu_seqlens.size()) - 1;
  auto product = [](std::initializer_list<std::int64_t> factors, const std::string& what) {
    std::int64_t r = 1;
    for (std::int64_t f : factors)
      if (__builtin_mul_overflow(r, f, &r))
        throw InvalidArgument("inputs: " + what + " overflows 63 bits");
    return r;
  };
  const std::int64_t pairs = product({N, p.HV}, "sequences x value heads");
  if (pairs > max_kda_sequence_heads)
    throw InvalidArgument("inputs: N = " + std::to_string(N) + " sequences x HV = " + std::to_string(p.HV) +
                          " value heads = " + std::to_string(pairs) + " sequence-heads, over k3ref kda's limit of " +
                          std::to_string(max_kda_sequence_heads));
  const std::pair<const char*, std::int64_t> tensors[] = {
      {"q and k [B, T, H, K]", product({p.B, p.T, p.H, p.K}, "q size B x T x H x K")},
      {"v and o [B, T, HV, V]", product({p.B, p.T, p.HV, p.V}, "v size B x T x HV x V")},
      {"g [B, T, HV, K]", product({p.B, p.T, p.HV, p.K}, "g size B x T x HV x K")},
      {"initial_state and final_state [N, HV, K, V]", product({pairs, p.K, p.V}, "state size N x HV x K x V")}};
  for (const auto& [what, count] : tensors)
    if (count > max_kda_output_elements)
      throw InvalidArgument("inputs: " + std::string(what) + " would hold " + std::to_string(count) +
                            " elements, over k3ref kda's limit of " + std::to_string(max_kda_output_elements) +
                            " per tensor");
  // q, k, v, g, beta (at most g's size), initial_state, A_log and dt_bias (at most HV x K),
  // all within 2^28 elements each by now: the sum is far from overflow. Each element is
  // drawn as a double, stored (at most 8 bytes) and serialised once more.
  const std::int64_t elements = 2 * tensors[0].second + tensors[1].second + 2 * tensors[2].second +
                                (p.initial_state ? tensors[3].second : 0) + 2 * p.HV * (p.K + 1);
  const double need = static_cast<double>(elements) * 24;
  const std::int64_t budget = memory_budget(a.memory_budget);
  if (need > static_cast<double>(budget))
    throw InvalidArgument("inputs: drawing and writing " + std::to_string(elements) + " elements needs about " +
                          fmt_gib(need) + " of memory, over the budget of " + fmt_gib(static_cast<double>(budget)) +
                          " (--memory-budget; default half the machine's memory)");
}

int inputs_command(const InputsArgs& a) {
  const golden::KdaParams p = input_params(a);
  check_inputs_work(p, a);
  // Before any drawing: the output must be writable and must not replace a device, a FIFO
  // or a symlink's target (the command reads no input).
  io::check_output_path(a.out, io::OutputCheck{{}, a.force, "--out"});
  const golden::KdaInputStorage storage = input_storage(a.dtype);
  num::Random rng(a.seed);
  const kda::Inputs<double> in = golden::draw_kda_inputs(p, rng, storage);
  io::SafetensorsFile file;
  golden::add_kda_inputs(file, in, storage);

  // The options `k3ref kda` must be given for these inputs, and the command that draws them
  // again, both by the command line's names (the defaults left out of the first).
  const kda::Options<double> defaults;
  std::string kda_args;
  auto add = [](std::string& to, const std::string& part) { (to += to.empty() ? "" : " ") += part; };
  if (kda::gate_forms.parse(a.gate) != defaults.gate) add(kda_args, "--gate " + a.gate);
  if (kda::gate_bases.parse(a.gate_base) != defaults.gate_base) add(kda_args, "--gate-base " + a.gate_base);
  if (a.lower_bound) add(kda_args, "--lower-bound " + shortest(*a.lower_bound));
  if (kda::beta_forms.parse(a.beta) != defaults.beta) add(kda_args, "--beta " + a.beta);
  if (a.l2norm) add(kda_args, "--l2norm");
  if (a.scale) add(kda_args, "--scale " + shortest(*a.scale));
  if (kda::state_layouts.parse(a.state_layout) != defaults.state_layout) add(kda_args, "--state-layout " + a.state_layout);
  std::string again = "k3ref inputs --out FILE";
  if (p.cu_seqlens.empty()) {
    add(again, "--B " + std::to_string(p.B) + " --T " + std::to_string(p.T));
  } else {
    std::string cu;
    for (std::int64_t x : p.cu_seqlens) (cu += cu.empty() ? "" : ",") += std::to_string(x);
    add(again, "--cu-seqlens " + cu);
  }
  add(again, "--H " + std::to_string(p.H) + " --HV " + std::to_string(p.HV) + " --K " + std::to_string(p.K) + " --V " +
                 std::to_string(p.V) + " --seed " + std::to_string(a.seed) + " --dtype " + a.dtype);
  if (a.no_initial_state) add(again, "--no-initial-state");
  add(again, "--gate " + a.gate + " --gate-base " + a.gate_base + " --beta " + a.beta + " --state-layout " + a.state_layout);
  if (a.lower_bound) add(again, "--lower-bound " + shortest(*a.lower_bound));
  if (a.l2norm) add(again, "--l2norm");
  if (a.scale) add(again, "--scale " + shortest(*a.scale));
  const nlohmann::json null = nullptr;
  auto optional_number = [&](const std::optional<double>& x) { return x ? nlohmann::json(*x) : null; };
  const nlohmann::json options = {{"B", p.B},
                                  {"T", p.T},
                                  {"H", p.H},
                                  {"HV", p.HV},
                                  {"K", p.K},
                                  {"V", p.V},
                                  {"cu_seqlens", p.cu_seqlens.empty() ? null : nlohmann::json(p.cu_seqlens)},
                                  {"seed", a.seed},
                                  {"dtype", a.dtype},
                                  {"initial_state", !a.no_initial_state},
                                  {kda::gate_forms.option, a.gate},
                                  {kda::gate_bases.option, a.gate_base},
                                  {kda::beta_forms.option, a.beta},
                                  {kda::state_layouts.option, a.state_layout},
                                  {"l2norm", a.l2norm},
                                  {"lower_bound", optional_number(a.lower_bound)},
                                  {"scale", optional_number(a.scale)}};
  file.metadata = {{"k3ref.inputs_for", "kda.recurrent"},
                   {"k3ref.seed", std::to_string(a.seed)},
                   {"k3ref.generator_version", golden::generator_version},
                   {"k3ref.draw_params", golden::to_json(p).dump()},
                   {"k3ref.options", options.dump()},
                   {"k3ref.command", again},
                   {"k3ref.kda_args", kda_args}};
  io::write_safetensors_atomic(a.out, file);
  std::string names;
  for (const auto& [name, t] : file.tensors) (names += names.empty() ? "" : ", ") += name + " " + std::string(dtype_name(t.dtype));
  std::printf("wrote %s (seed %llu): %s\n", io::printable(a.out).c_str(), static_cast<unsigned long long>(a.seed),
              names.c_str());
  std::printf("its reference: k3ref kda --in %s --out ref.safetensors%s\n", io::printable(a.out).c_str(),
              kda_args.empty() ? "" : (" " + kda_args).c_str());
  return exit_ok;
}

// ---- compare -----------------------------------------------------------------------------
// The verdict is check::judge_case's: every golden output under its own rule of the policy
// table, failing closed (include/k3ref/check/judgement.h); this prints it and writes the
// machine-readable reports.

struct CompareArgs {
  std::string golden, candidate, policy = "floor:2", policy_table, json, junit;
  std::vector<std::string> tensors;
  std::int64_t window = 0;
};

check::NamedValues named_values(const io::RawTensor& t, const std::string& file) {
  check::NamedValues v;
  v.shape = t.shape;
  v.dtype = std::string(dtype_name(t.dtype));
  v.numeric = t.dtype != DType::BOOL;
  if (v.numeric) v.values = io::to_f64(t, file).values();
  return v;
}

void write_text(const std::string& path, const std::string& text) {
  io::write_file_atomic(path, std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
}

void write_reports(const CompareArgs& a, const check::CaseJudgement& j, const std::string& case_name) {
  if (!a.json.empty()) write_text(a.json, check::judgement_json(j, a.golden, a.candidate));
  if (!a.junit.empty()) write_text(a.junit, check::judgement_junit(j, case_name));
}

void print_judgement(const CompareArgs& a, const check::CaseJudgement& j, const io::SafetensorsFile& ref,
                     const io::SafetensorsFile& cand) {
  std::printf("%-28s %-8s %-6s %-16s %10s %10s %10s %10s %6s  %s\n", "tensor", "role", "dtype", "rule", "rel_rms",
              "floor", "max_abs", "max_ulp", "nan", "verdict");
  for (const auto& t : j.tensors) {
    std::string rule = t.metric;
    if (t.metric == "floor" || t.metric == "rel-rms" || t.metric == "max-abs-ulps") rule += " " + t.floor_dtype;
    if (t.status == "pass" || t.status == "fail") {
      std::printf("%-28s %-8s %-6s %-16s %10.3e %10.3e %10.3e %10.3g %6lld  %s: %s\n", io::printable(t.tensor).c_str(),
                  t.role.c_str(), t.candidate_dtype.c_str(), rule.c_str(), t.rel_rms, t.floor, t.max_abs, t.max_ulp,
                  static_cast<long long>(t.candidate_nan), t.passed ? "PASS" : "FAIL", io::printable(t.reason).c_str());
    } else {
      std::string status = t.status;
      for (char& c : status) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      std::printf("%-28s %-8s %-6s %-16s %10s %10s %10s %10s %6s  %s: %s\n", io::printable(t.tensor).c_str(),
                  t.role.c_str(), t.candidate_dtype.empty() ? "-" : t.candidate_dtype.c_str(), rule.c_str(), "-", "-",
                  "-", "-", "-", status.c_str(), io::printable(t.reason).c_str());
    }
    if (t.status == "fail" && t.max_abs_index >= 0)
      std::printf("%-28s worst element %s (flat %lld): candidate %.9g, golden %.17g\n", "", t.worst_at.c_str(),
                  static_cast<long long>(t.max_abs_index), t.candidate_value, t.golden_value);
    if (a.window > 0 && t.shape.size() >= 2 && (t.status == "pass" || t.status == "fail")) {
      const Tensor<double> x = io::to_f64(*cand.find(t.tensor), a.candidate);
      const Tensor<double> y = io::to_f64(*ref.find(t.tensor), a.golden);
      const auto by_window = check::rel_rms_by_window(x.values(), y.values(), t.shape, 1, a.window);
      std::printf("%-28s rel RMS by token window of %lld:", "", static_cast<long long>(a.window));
      for (double e : by_window) std::printf(" %.2e", e);
      std::printf("\n");
    }
  }
  std::printf("%s under policy '%s' (%s): %s\n", j.exit_code == 0 ? "PASS" : "FAIL", io::printable(j.policy).c_str(),
              io::printable(j.op).c_str(), io::printable(j.reason).c_str());
}

int compare_command(const CompareArgs& a) {
  // Report paths are checked before anything is read or judged (io/file.h's rules).
  // Outputs never overwrite an input (the policy table included) or each other.
  std::vector<fs::path> inputs{fs::path(a.golden), fs::path(a.candidate)};
  if (!a.policy_table.empty()) inputs.emplace_back(a.policy_table);
  for (const auto& [path, option] : {std::pair{&a.json, "--json"}, {&a.junit, "--junit"}})
    if (!path->empty()) io::check_output_path(*path, io::OutputCheck{inputs, false, option});
  io::check_distinct_outputs({{fs::path(a.json), "--json"}, {fs::path(a.junit), "--junit"}});
  std::string op, case_name = fs::path(a.golden).stem().string();
  try {
    std::optional<check::PolicyTable> loaded;
    if (!a.policy_table.empty()) loaded = check::PolicyTable::load(a.policy_table);
    const check::PolicyTable& table = loaded ? *loaded : check::PolicyTable::builtin();
    const io::SafetensorsFile ref = io::read_safetensors(a.golden);
    const io::SafetensorsFile cand = io::read_safetensors(a.candidate);
    auto meta = [&](const char* key) -> const std::string* {
      auto it = ref.metadata.find(key);
      return it == ref.metadata.end() ? nullptr : &it->second;
    };
    // A golden without its operator or output list cannot be judged by any rule: unusable.
    if (!meta("k3ref.op") || !meta("k3ref.outputs"))
      throw FileError(a.golden + ": no 'k3ref.op' / 'k3ref.outputs' metadata: not a k3ref golden");
    op = *meta("k3ref.op");
    if (meta("k3ref.case")) case_name = *meta("k3ref.case");
    check::JudgeRequest q;
    q.op = op;
    q.policy = a.policy;
    if (a.policy == "recommended") {
      // The policy the golden recommends for its outputs (k3ref.policies, docs/golden-format.md).
      const std::string* listed = meta("k3ref.policies");
      if (!listed) throw FileError(a.golden + ": no 'k3ref.policies' metadata: --policy recommended needs a schema-2 golden");
      std::set<std::string> named;
      try {
        const nlohmann::json j = nlohmann::json::parse(*listed);
        if (!j.is_object() || j.empty()) throw std::invalid_argument("not a non-empty object");
        for (const auto& [output, name] : j.items()) {
          if (!name.is_string()) throw std::invalid_argument("value for " + io::excerpt(output) + " is not a string");
          named.insert(name.get<std::string>());
        }
      } catch (const std::exception& e) {
        throw FileError(a.golden + ": metadata 'k3ref.policies' is not an object of policy names (" +
                        io::excerpt(e.what(), 120) + ")");
      }
      if (named.size() != 1)
        throw InvalidArgument(a.golden + ": its outputs recommend " + std::to_string(named.size()) +
                              " policies; name one with --policy");
      q.policy = *named.begin();
    }
    // Tensors by name, indexed once: SafetensorsFile::find is a linear scan, and a golden
    // may list many thousands of outputs.
    std::unordered_map<std::string, const io::RawTensor*> golden_tensors, candidate_tensors;
    for (const auto& [name, t] : ref.tensors) golden_tensors.emplace(name, &t);
    for (const auto& [name, t] : cand.tensors) candidate_tensors.emplace(name, &t);
    std::set<std::string> output_names;
    for (const auto& name : check::expand_outputs(*meta("k3ref.outputs"))) {
      auto it = golden_tensors.find(name);
      if (it == golden_tensors.end())
        throw FileError(a.golden + ": tensor " + io::excerpt(name) + " (listed in k3ref.outputs) is not in the file");
      q.expected.emplace_back(name, named_values(*it->second, a.golden));
      output_names.insert(name);
    }
    for (const auto& [name, t] : ref.tensors)
      if (!output_names.count(name)) q.known.push_back(name);
    for (const auto& [name, t] : cand.tensors) q.candidate_names.push_back(name);
    q.candidate = [&](const std::string& name) { return named_values(*candidate_tensors.at(name), a.candidate); };
    if (!a.tensors.empty()) q.tensors = a.tensors;
    // For naming the worst element's axes: a varlen golden's token is (sequence, position).
    if (auto it = golden_tensors.find("cu_seqlens"); it != golden_tensors.end())
      for (double v : named_values(*it->second, a.golden).values) q.cu_seqlens.push_back(static_cast<std::int64_t>(v));
    if (const std::string* params = meta("k3ref.params"))
      q.v_first = params->find("\"state_layout\":\"v_first\"") != std::string::npos;
    const check::CaseJudgement j = check::judge_case(table, q);
    write_reports(a, j, case_name);
    if (j.exit_code == exit_unusable) {
      std::fprintf(stderr, "k3ref compare: %s\n", io::printable(j.reason).c_str());
      return exit_unusable;
    }
    print_judgement(a, j, ref, cand);
    return j.exit_code;
  } catch (const std::exception& e) {
    // Unusable input (unreadable file, malformed golden or table): the reports say so too.
    try {
      write_reports(a, check::unusable(op, a.policy, e.what()), case_name);
    } catch (const std::exception&) {
    }
    throw;
  }
}

}  // namespace

namespace k3ref::cli {

// `k3ref report ...`: the cost models' calculators (docs/cost-models.md).
struct ReportArgs {
  report::DecodeQuery decode;
  report::PrefillQuery prefill;
  report::MoeQuery moe;
  std::optional<double> bytes_per_element, flops_per_second, bytes_per_second;
  std::string golden;
  bool json = false;
};

int print_report(const nlohmann::ordered_json& r, bool json) {
  const std::string text = json ? r.dump(2) + "\n" : report::render_text(r);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return exit_ok;
}

int report_moe(ReportArgs& a) {
  auto need = [](const std::optional<double>& v, const char* name) {
    if (!v) throw InvalidArgument(std::string("report moe: ") + name + " is required");
    return *v;
  };
  a.moe.bytes_per_element = a.bytes_per_element.value_or(2.0);
  a.moe.flops_per_second = need(a.flops_per_second, "--flops");
  a.moe.bytes_per_second = need(a.bytes_per_second, "--bandwidth");
  if (!a.golden.empty()) a.moe.golden = a.golden;
  return print_report(report::moe_report(a.moe), a.json);
}

int run(int argc, const char* const* argv, bool execute) {
  CLI::App app{"k3ref: reference and verification for the Kimi K3 operators (KDA, AttnRes, QB)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "k3ref 0.1.0 (golden generator version " + std::string(golden::generator_version) + ")");

  GoldenArgs golden_args;
  CLI::App* golden_cmd = app.add_subcommand("golden", "Generate, verify or list golden suites");
  golden_cmd->require_subcommand(1);
  CLI::App* gen = golden_cmd->add_subcommand("generate", "Generate a suite: one safetensors file per case plus MANIFEST.json");
  gen->add_option("--suite", golden_args.suite, "Suite name")->capture_default_str();
  gen->add_option("--out", golden_args.out, "Output directory")->capture_default_str();
  gen->add_option("--only", golden_args.only, "Generate only these cases (the manifest lists only them)");
  add_integer_option(gen, "--jobs,-j", golden_args.jobs, 1, max_threads, "Cases generated in parallel");
  gen->add_flag("--force", golden_args.force,
                "Write into a directory holding files k3ref did not write (they may be overwritten)");
  gen->add_flag("--quiet,-q", golden_args.quiet, "No progress lines");
  CLI::App* ver = golden_cmd->add_subcommand(
      "verify", "Check a committed suite: manifest, sha256 of each file, and byte equality with a fresh generation");
  ver->add_option("--dir", golden_args.dir, "Directory of the committed suite")->capture_default_str();
  ver->add_option("--generated", golden_args.generated,
                  "Compare with a suite already generated into this directory instead of regenerating");
  add_integer_option(ver, "--jobs,-j", golden_args.jobs, 1, max_threads, "Cases regenerated in parallel");
  ver->add_flag("--quiet,-q", golden_args.quiet, "No progress lines");
  ver->add_flag("--subset", golden_args.subset,
                "Accept a subset suite (written by generate --only): verify only the cases its manifest lists");
  CLI::App* lst = golden_cmd->add_subcommand("list", "List the cases of a suite: a table of their main parameters");
  lst->add_option("--suite", golden_args.suite, "Suite name")->capture_default_str();
  lst->add_option("--op", golden_args.op, "Only cases of this operator, or of operators starting with it (kda.chunkwise)");
  lst->add_option("--kernel", golden_args.kernel,
                  "Only cases inside this built-in kernel's domain (policy/kernel_domains.json)");
  lst->add_flag("--json", golden_args.json, "Every case's name, operator and parameters as JSON");

  KdaArgs kda_args;
  CLI::App* kda_cmd = app.add_subcommand(
      "kda", "Reference KDA outputs (o, final_state) for inputs q, k, v, g, beta [, initial_state, A_log, dt_bias, "
             "cu_seqlens] in a safetensors file");
  kda_cmd->add_option("--in", kda_args.in, "Input safetensors file")->required();
  kda_cmd->add_option("--out", kda_args.out, "Output safetensors file (F64 tensors)")->required();
  add_choice_option(kda_cmd, "gate", kda_args.gate);
  add_choice_option(kda_cmd, "gate_base", kda_args.gate_base);
  add_finite_option(kda_cmd, "--lower-bound", kda_args.lower_bound, "Lower bound of the lower_bound gate (negative)");
  add_choice_option(kda_cmd, "beta", kda_args.beta);
  kda_cmd->add_flag("--l2norm", kda_args.l2norm, "L2-normalise q and k (eps 1e-6)");
  add_finite_option(kda_cmd, "--scale", kda_args.scale, "Query scale (default K^-1/2)");
  add_choice_option(kda_cmd, "state_layout", kda_args.state_layout);
  kda_cmd->add_flag("--all-states", kda_args.all_states, "Also write the state after every token");
  kda_cmd->add_flag("--no-final-state", kda_args.no_final_state, "Do not write final_state");
  add_choice_option(kda_cmd, "precision", kda_args.precision);
  add_integer_option(kda_cmd, "--threads", kda_args.threads, 1, max_threads, "Threads over (sequence, head)");
  add_finite_option(kda_cmd, "--progress-after", kda_args.progress_after,
                    "Print progress on stderr every few seconds when the run is estimated to take at least this "
                    "many seconds (default 5; 0: always; negative: never)");
  kda_cmd->add_option("--memory-budget", kda_args.memory_budget,
                      "Refuse a run estimated to need more memory than this (bytes, or with a K/M/G/T suffix; "
                      "default: half the machine's memory)");
  kda_cmd->add_flag("--force", kda_args.force,
                    "Write --out even when it is the input, a symlink, a device, a FIFO or not UTF-8");

  InputsArgs inputs_args;
  CLI::App* inputs_cmd = app.add_subcommand(
      "inputs", "Write a random, seeded input file for `k3ref kda` (q, k, v, g, beta [, initial_state, A_log, dt_bias, "
                "cu_seqlens]), drawn as the golden catalogue draws its inputs");
  inputs_cmd->add_option("--out", inputs_args.out, "Output safetensors file")->required();
  add_integer_option(inputs_cmd, "--B", inputs_args.B, std::int64_t{1}, max_kda_sequence_heads,
                     "Batch size (default 1; 1 with --cu-seqlens)");
  CLI::Option* tokens = add_integer_option(inputs_cmd, "--T", inputs_args.T, std::int64_t{0}, max_kda_output_elements,
                                           "Tokens per sequence (default 16)");
  CLI::Option* packed =
      inputs_cmd
          ->add_option_function<std::string>(
              "--cu-seqlens", [&inputs_args](const std::string& text) { inputs_args.cu_seqlens = parse_cu_seqlens(text); },
              "Varlen: sequence offsets into one packed batch row, e.g. 0,5,12 (B = 1, T = the last offset)")
          ->type_name("LIST");
  tokens->excludes(packed);
  add_integer_option(inputs_cmd, "--H", inputs_args.H, std::int64_t{1}, max_kda_sequence_heads,
                     "Query/key heads (default 1)");
  add_integer_option(inputs_cmd, "--HV", inputs_args.HV, std::int64_t{1}, max_kda_sequence_heads,
                     "Value heads, a multiple of H (default H; more is GVA)");
  add_integer_option(inputs_cmd, "--K", inputs_args.K, std::int64_t{1}, max_kda_output_elements,
                     "Key head size (default 16)");
  add_integer_option(inputs_cmd, "--V", inputs_args.V, std::int64_t{1}, max_kda_output_elements,
                     "Value head size (default 16)");
  add_integer_option(inputs_cmd, "--seed", inputs_args.seed, std::uint64_t{0}, std::numeric_limits<std::uint64_t>::max(),
                     "Seed of the random stream (default 0); recorded in the file");
  CLI::Validator dtype_member(
      [](std::string& text) {
        return std::find(input_dtypes.begin(), input_dtypes.end(), text) != input_dtypes.end()
                   ? std::string()
                   : not_one_of(input_dtypes, text);
      },
      "{bf16,f32,f64}");
  inputs_cmd
      ->add_option("--dtype", inputs_args.dtype,
                   "Storage of q, k, v, g, beta, values rounded to it (bf16: initial_state, A_log, dt_bias F32, as "
                   "the goldens; f32, f64: every tensor)")
      ->check(dtype_member)
      ->capture_default_str();
  inputs_cmd->add_flag("--no-initial-state", inputs_args.no_initial_state, "Write no initial_state (a zero state)");
  add_choice_option(inputs_cmd, "gate", inputs_args.gate);
  add_choice_option(inputs_cmd, "gate_base", inputs_args.gate_base);
  add_finite_option(inputs_cmd, "--lower-bound", inputs_args.lower_bound,
                    "Lower bound of the lower_bound gate (negative); passed on to k3ref kda");
  add_choice_option(inputs_cmd, "beta", inputs_args.beta);
  inputs_cmd->add_flag("--l2norm", inputs_args.l2norm, "Keys for the in-kernel L2 norm (k in [-1, 1], not 1/sqrt(K))");
  add_finite_option(inputs_cmd, "--scale", inputs_args.scale, "Query scale (default K^-1/2); passed on to k3ref kda");
  add_choice_option(inputs_cmd, "state_layout", inputs_args.state_layout);
  inputs_cmd->add_option("--memory-budget", inputs_args.memory_budget,
                         "Refuse a file estimated to need more memory than this to draw (bytes, or with a K/M/G/T "
                         "suffix; default: half the machine's memory)");
  inputs_cmd->add_flag("--force", inputs_args.force, "Write --out even when it is a symlink, a device, a FIFO or not UTF-8");

  CompareArgs cmp_args;
  CLI::App* cmp = app.add_subcommand(
      "compare",
      "Judge a kernel's output file against a golden, every output under its rule of the policy table; exit 0 "
      "pass, 1 fail (a bound exceeded, a required output missing), 2 unusable input (unknown names, bad files)");
  cmp->add_option("--golden", cmp_args.golden, "Golden safetensors file")->required();
  cmp->add_option("--candidate", cmp_args.candidate, "The kernel's outputs (same tensor names)")->required();
  cmp->add_option("--policy", cmp_args.policy,
                  "Tolerance policy (per tensor rules from the policy table):\n" +
                      check::policy_table_help(check::PolicyTable::builtin()) +
                      "recommended      the policy the golden recommends for its outputs (k3ref.policies)\n")
      ->capture_default_str();
  cmp->add_option("--policy-table", cmp_args.policy_table,
                  "Policy table file (default: the built-in copy of policy/policies.json)");
  cmp->add_option("--tensors", cmp_args.tensors,
                  "Judge only these outputs, each then required (default: every golden output; stage tensors "
                  "are optional)")
      ->delimiter(',');
  add_integer_option(cmp, "--window", cmp_args.window, std::int64_t{0}, std::numeric_limits<std::int64_t>::max(),
                     "Also print the error per window of this many tokens (0: no windows)");
  cmp->add_option("--json", cmp_args.json, "Write the verdict and every tensor's figures as JSON to this file");
  cmp->add_option("--junit", cmp_args.junit, "Write the verdict as JUnit XML (one testcase per tensor) to this file");

  ReportArgs report_args;
  CLI::App* report_cmd = app.add_subcommand("report", "The K3 cost models as calculators: decode, FlashKDA prefill, MoE communication");
  report_cmd->require_subcommand(1);
  constexpr std::int64_t big = std::int64_t{1} << 40;
  CLI::App* rdecode = report_cmd->add_subcommand("decode", "KDA decode per head and token: 7 D^2 FLOP, 8 D^2 bytes (fp32 state read and written)");
  add_integer_option(rdecode, "--head-dim,-D", report_args.decode.head_dim, std::int64_t{1}, std::int64_t{1} << 20, "Head size D = K = V (default 128)");
  add_integer_option(rdecode, "--heads", report_args.decode.heads, std::int64_t{1}, big, "Heads (default 1)");
  add_integer_option(rdecode, "--tokens", report_args.decode.tokens, std::int64_t{1}, big, "Decode steps (default 1)");
  rdecode->add_flag("--json", report_args.json, "Print JSON");
  CLI::App* rprefill = report_cmd->add_subcommand(
      "prefill", "FlashKDA prefill per head: per chunk 12 C^3 + 8 C^2 D + 6 C D^2 FLOP, 8 C^2 + 22 C D bytes, plus 8 D^2 per kernel");
  add_integer_option(rprefill, "--tokens,-T", report_args.prefill.tokens, std::int64_t{1}, big, "Tokens T (default 4096)");
  add_integer_option(rprefill, "--chunk,-C", report_args.prefill.chunk, std::int64_t{1}, std::int64_t{1} << 20, "Chunk size C (default 16)");
  add_integer_option(rprefill, "--head-dim,-D", report_args.prefill.head_dim, std::int64_t{1}, std::int64_t{1} << 20, "Head size D (default 128)");
  add_integer_option(rprefill, "--heads", report_args.prefill.heads, std::int64_t{1}, big, "Heads (default 1)");
  add_integer_option(rprefill, "--kernels", report_args.prefill.kernels, std::int64_t{0}, std::int64_t{64}, "Kernels that read and write the state (default 2)");
  rprefill->add_flag("--json", report_args.json, "Print JSON");
  CLI::App* rmoe = report_cmd->add_subcommand(
      "moe", "Expert parallelism: T_comm / T_comp = (P F) / (6 m B) (1 - 1/E) under uniform routing; simulated, and measured from a golden's routing");
  add_finite_option(rmoe, "--bytes-per-element", report_args.bytes_per_element, "P, bytes per dispatched element (default 2)");
  add_finite_option(rmoe, "--flops", report_args.flops_per_second, "F, a GPU's FLOP/s (required)");
  add_finite_option(rmoe, "--bandwidth", report_args.bytes_per_second, "B, a GPU's dispatch bandwidth in bytes/s (required)");
  add_integer_option(rmoe, "--intermediate", report_args.moe.intermediate, std::int64_t{1}, big, "m, the expert intermediate size (default 3072)");
  add_integer_option(rmoe, "--gpus", report_args.moe.gpus, std::int64_t{1}, std::int64_t{1} << 20, "E, expert-parallel GPUs (default 8)");
  add_integer_option(rmoe, "--experts", report_args.moe.experts, std::int64_t{0}, std::int64_t{1} << 20, "Routed experts: simulate a uniform dispatch (with --top-k); a golden's own by default");
  add_integer_option(rmoe, "--top-k", report_args.moe.top_k, std::int64_t{0}, std::int64_t{1} << 20, "Experts per token of the simulated dispatch");
  add_integer_option(rmoe, "--tokens", report_args.moe.tokens, std::int64_t{0}, big, "Tokens of the simulated dispatch (rounded to a multiple of E n)");
  rmoe->add_option("--golden", report_args.golden, "A golden whose routing is measured (e.g. goldens/qb_online_m48_n16_k4_tie_heavy.safetensors)");
  rmoe->add_option("--tensor", report_args.moe.tensor, "Its selection tensor [..., m, k]")->capture_default_str();
  rmoe->add_flag("--json", report_args.json, "Print JSON");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    // One line, whatever CLI11 would add ("Run with --help ..."), arguments made printable.
    std::fprintf(stderr, "k3ref: %s\n", io::printable(e.what()).c_str());
    return exit_unusable;
  }
  if (!execute) return exit_ok;
  try {
    if (*gen) return golden_generate(golden_args);
    if (*ver) return golden_verify(golden_args);
    if (*lst) return golden_list(golden_args);
    if (*kda_cmd) return kda_command(kda_args);
    if (*inputs_cmd) return inputs_command(inputs_args);
    if (*cmp) return compare_command(cmp_args);
    if (*rdecode) return print_report(report::decode_report(report_args.decode), report_args.json);
    if (*rprefill) return print_report(report::prefill_report(report_args.prefill), report_args.json);
    if (*rmoe) return report_moe(report_args);
  } catch (const FileError& e) {
    std::fprintf(stderr, "k3ref: %s\n", io::printable(e.what()).c_str());
    return exit_unusable;
  } catch (const InvalidArgument& e) {
    std::fprintf(stderr, "k3ref: %s\n", io::printable(e.what()).c_str());
    return exit_unusable;
  } catch (const std::bad_alloc&) {
    // Every size is checked against the bytes present or a documented limit first, so
    // this is the machine's memory, not the input's doing.
    std::fprintf(stderr, "k3ref: out of memory\n");
    return exit_unusable;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "k3ref: error: %s\n", io::printable(e.what()).c_str());
    return exit_unusable;
  }
  return exit_unusable;
}

}  // namespace k3ref::cli
