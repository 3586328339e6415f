// The k3ref command: golden suites, reference KDA outputs for user inputs, and
// comparison of a kernel's outputs against a golden under a named tolerance policy.
//
// Exit codes: 0 success / pass; 1 a difference or a failed check; 2 unusable input
// (bad arguments, unreadable or malformed files).
#include "command_line.h"

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <thread>

#include "k3ref/check/metrics.h"
#include "k3ref/error.h"
#include "k3ref/golden/suite.h"
#include "k3ref/io/safetensors.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/kda/recurrent.h"
#include "k3ref/num/scalar.h"

namespace {

using namespace k3ref;
namespace fs = std::filesystem;

constexpr int exit_ok = 0, exit_fail = 1, exit_unusable = 2;

int default_jobs() { return std::max(1u, std::thread::hardware_concurrency()); }

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
};

int golden_generate(const GoldenArgs& a) {
  std::vector<golden::Case> cases = golden::suite(a.suite);
  if (!a.only.empty()) {
    std::vector<golden::Case> picked;
    for (const auto& name : a.only) {
      auto it = std::find_if(cases.begin(), cases.end(), [&](const golden::Case& c) { return c.name == name; });
      if (it == cases.end()) throw InvalidArgument("golden generate: argument '--only': no case named '" + name + "'");
      picked.push_back(*it);
    }
    cases = picked;
  }
  const auto start = std::chrono::steady_clock::now();
  const auto generated = golden::generate_cases(cases, a.jobs, a.quiet ? golden::Progress{} : stderr_progress());
  golden::write_suite(a.out, a.suite, generated);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("wrote %zu cases and MANIFEST.json to %s in %.1f s\n", generated.size(), a.out.c_str(), seconds);
  return exit_ok;
}

int golden_verify(const GoldenArgs& a) {
  golden::VerifyOptions options;
  options.jobs = a.jobs;
  if (!a.generated.empty()) options.generated_dir = fs::path(a.generated);
  if (!a.quiet) options.progress = stderr_progress();
  if (!fs::is_directory(a.dir)) {
    std::fprintf(stderr, "k3ref golden verify: %s: not a directory\n", a.dir.c_str());
    return exit_unusable;
  }
  const auto problems = golden::verify_suite(a.dir, options);
  for (const auto& p : problems)
    std::printf("DIFFERENT %s%s: %s\n", p.file.c_str(), p.tensor.empty() ? "" : (" tensor '" + p.tensor + "'").c_str(),
                p.what.c_str());
  if (!problems.empty()) {
    std::printf("golden verify: %zu problem(s) in %s\n", problems.size(), a.dir.c_str());
    return exit_fail;
  }
  std::printf("golden verify: every file in %s matches the %s\n", a.dir.c_str(),
              a.generated.empty() ? "regenerated suite" : ("suite in " + a.generated).c_str());
  return exit_ok;
}

int golden_list(const GoldenArgs& a) {
  for (const auto& c : golden::suite(a.suite)) std::printf("%-40s %-16s %s\n", c.name.c_str(), c.op.c_str(), c.params.dump().c_str());
  return exit_ok;
}

// ---- kda ---------------------------------------------------------------------------------

struct KdaArgs {
  std::string in, out;
  std::string gate = "log_decay", gate_base = "e", beta = "as_given", state_layout = "k_first";
  std::optional<double> lower_bound, scale;
  bool l2norm = false, all_states = false, no_final_state = false;
  std::string precision = "double";
  int threads = default_jobs();
};

template <class S>
kda::Outputs<double> run_kda(const kda::Inputs<double>& in, const KdaArgs& a) {
  kda::Options<S> opt;
  if (a.scale) opt.scale = S(*a.scale);
  if (a.lower_bound) opt.lower_bound = S(*a.lower_bound);
  opt.qk_l2norm = a.l2norm;
  opt.gate = *kda::gate_form_from_string(a.gate);
  opt.gate_base = *kda::gate_base_from_string(a.gate_base);
  opt.beta = *kda::beta_form_from_string(a.beta);
  opt.state_layout = *kda::state_layout_from_string(a.state_layout);
  opt.output_final_state = !a.no_final_state;
  opt.output_all_states = a.all_states;
  opt.num_threads = a.threads;
  const kda::Outputs<S> r = kda::recurrent_forward(kda::lift<S>(in), opt);
  auto down = [](const Tensor<S>& t) { return t.template map<double>([](const S& x) { return num::to_double_rne(x); }); };
  kda::Outputs<double> out{down(r.o), std::nullopt, std::nullopt};
  if (r.final_state) out.final_state = down(*r.final_state);
  if (r.all_states) out.all_states = down(*r.all_states);
  return out;
}

int kda_command(const KdaArgs& a) {
  const io::SafetensorsFile file = io::read_safetensors(a.in);
  const kda::Inputs<double> in = kda::inputs_from_file(file, a.in);
  const auto start = std::chrono::steady_clock::now();
  kda::Outputs<double> out;
  if (a.precision == "double")
    out = run_kda<double>(in, a);
  else
    out = run_kda<num::golden_float>(in, a);
  io::SafetensorsFile result;
  kda::add_outputs(result, out);
  result.metadata = {{"k3ref.op", "kda.recurrent"}, {"k3ref.precision", a.precision}, {"k3ref.inputs", a.in}};
  io::write_safetensors_atomic(a.out, result);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("wrote %s (%s reference, %.2f s)\n", a.out.c_str(), a.precision.c_str(), seconds);
  return exit_ok;
}

// ---- compare -----------------------------------------------------------------------------

struct CompareArgs {
  std::string golden, candidate, policy = "floor:2";
  std::vector<std::string> tensors;
  std::int64_t window = 0;
};

std::optional<num::Format> format_of(DType d) {
  switch (d) {
    case DType::F64: return num::Format::fp64;
    case DType::F32: return num::Format::fp32;
    case DType::F16: return num::Format::fp16;
    case DType::BF16: return num::Format::bf16;
    case DType::F8_E4M3: return num::Format::fp8_e4m3;
    case DType::F8_E5M2: return num::Format::fp8_e5m2;
    default: return std::nullopt;
  }
}

int compare_command(const CompareArgs& a) {
  const check::Policy policy = check::parse_policy(a.policy);
  const io::SafetensorsFile ref = io::read_safetensors(a.golden);
  const io::SafetensorsFile cand = io::read_safetensors(a.candidate);
  std::vector<std::string> names = a.tensors;
  if (names.empty()) {
    // The golden's outputs (from its metadata), else every F64 tensor the candidate also has.
    auto it = ref.metadata.find("k3ref.outputs");
    if (it != ref.metadata.end()) {
      std::string list = it->second;
      for (std::size_t pos = 0; pos <= list.size();) {
        const std::size_t comma = std::min(list.find(',', pos), list.size());
        if (comma > pos && cand.find(list.substr(pos, comma - pos))) names.push_back(list.substr(pos, comma - pos));
        pos = comma + 1;
      }
    } else {
      for (const auto& [name, t] : ref.tensors)
        if (t.dtype == DType::F64 && cand.find(name)) names.push_back(name);
    }
    if (names.empty()) {
      std::fprintf(stderr, "k3ref compare: %s has none of the output tensors of %s\n", a.candidate.c_str(),
                   a.golden.c_str());
      return exit_unusable;
    }
  }
  bool all_pass = true;
  std::printf("%-14s %-6s %10s %10s %10s %10s %6s  %s\n", "tensor", "dtype", "rel_rms", "floor", "max_abs", "max_ulp",
              "nan", "verdict");
  for (const auto& name : names) {
    const io::RawTensor& r = ref.at(name, a.golden);
    const io::RawTensor& c = cand.at(name, a.candidate);
    if (r.shape != c.shape)
      throw FileError(a.candidate + ": tensor '" + name + "': shape " + shape_to_string(c.shape) + ", golden has " +
                      shape_to_string(r.shape));
    const auto format = format_of(c.dtype);
    if (!format || !is_floating(r.dtype))
      throw FileError(a.candidate + ": tensor '" + name + "': dtype " + std::string(dtype_name(c.dtype)) +
                      " is not a floating-point output");
    const Tensor<double> x = io::to_f64(c, a.candidate), y = io::to_f64(r, a.golden);
    const check::Metrics m = check::compare(x.values(), y.values(), *format);
    const check::Verdict v = check::judge(m, policy);
    all_pass = all_pass && v.pass;
    std::printf("%-14s %-6s %10.3e %10.3e %10.3e %10.3g %6lld  %s: %s\n", name.c_str(),
                std::string(dtype_name(c.dtype)).c_str(), m.rel_rms, m.floor_rel_rms, m.max_abs, m.max_ulp,
                static_cast<long long>(m.candidate_nan), v.pass ? "PASS" : "FAIL", v.reason.c_str());
    if (!v.pass && m.max_abs_index >= 0)
      std::printf("%-14s worst element %lld: candidate %.9g, golden %.17g\n", "",
                  static_cast<long long>(m.max_abs_index), x.data()[m.max_abs_index], y.data()[m.max_abs_index]);
    if (a.window > 0 && r.shape.size() >= 2) {
      const auto by_window = check::rel_rms_by_window(x.values(), y.values(), r.shape, 1, a.window);
      std::printf("%-14s rel RMS by token window of %lld:", "", static_cast<long long>(a.window));
      for (double e : by_window) std::printf(" %.2e", e);
      std::printf("\n");
    }
  }
  std::printf("%s under policy '%s'\n", all_pass ? "PASS" : "FAIL", policy.name.c_str());
  return all_pass ? exit_ok : exit_fail;
}

}  // namespace

namespace k3ref::cli {

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
  gen->add_option("--jobs,-j", golden_args.jobs, "Cases generated in parallel")->check(CLI::PositiveNumber);
  gen->add_flag("--quiet,-q", golden_args.quiet, "No progress lines");
  CLI::App* ver = golden_cmd->add_subcommand(
      "verify", "Check a committed suite: manifest, sha256 of each file, and byte equality with a fresh generation");
  ver->add_option("--dir", golden_args.dir, "Directory of the committed suite")->capture_default_str();
  ver->add_option("--generated", golden_args.generated,
                  "Compare with a suite already generated into this directory instead of regenerating");
  ver->add_option("--jobs,-j", golden_args.jobs, "Cases regenerated in parallel")->check(CLI::PositiveNumber);
  ver->add_flag("--quiet,-q", golden_args.quiet, "No progress lines");
  CLI::App* lst = golden_cmd->add_subcommand("list", "List the cases of a suite with their parameters");
  lst->add_option("--suite", golden_args.suite, "Suite name")->capture_default_str();

  KdaArgs kda_args;
  CLI::App* kda_cmd = app.add_subcommand(
      "kda", "Reference KDA outputs (o, final_state) for inputs q, k, v, g, beta [, initial_state, A_log, dt_bias, "
             "cu_seqlens] in a safetensors file");
  kda_cmd->add_option("--in", kda_args.in, "Input safetensors file")->required();
  kda_cmd->add_option("--out", kda_args.out, "Output safetensors file (F64 tensors)")->required();
  kda_cmd->add_option("--gate", kda_args.gate, "log_decay | decay_factor | softplus | lower_bound")
      ->check(CLI::IsMember({"log_decay", "decay_factor", "softplus", "lower_bound"}))->capture_default_str();
  kda_cmd->add_option("--gate-base", kda_args.gate_base, "e | 2 (FlashKDA's exp2 convention)")
      ->check(CLI::IsMember({"e", "2"}))->capture_default_str();
  kda_cmd->add_option("--lower-bound", kda_args.lower_bound, "Lower bound of the lower_bound gate (negative)");
  kda_cmd->add_option("--beta", kda_args.beta, "as_given | sigmoid | two_sigmoid")
      ->check(CLI::IsMember({"as_given", "sigmoid", "two_sigmoid"}))->capture_default_str();
  kda_cmd->add_flag("--l2norm", kda_args.l2norm, "L2-normalise q and k (eps 1e-6)");
  kda_cmd->add_option("--scale", kda_args.scale, "Query scale (default K^-1/2)");
  kda_cmd->add_option("--state-layout", kda_args.state_layout, "k_first [N,HV,K,V] | v_first [N,HV,V,K]")
      ->check(CLI::IsMember({"k_first", "v_first"}))->capture_default_str();
  kda_cmd->add_flag("--all-states", kda_args.all_states, "Also write the state after every token");
  kda_cmd->add_flag("--no-final-state", kda_args.no_final_state, "Do not write final_state");
  kda_cmd->add_option("--precision", kda_args.precision, "double | mp256 (256-bit, the golden precision)")
      ->check(CLI::IsMember({"double", "mp256"}))->capture_default_str();
  kda_cmd->add_option("--threads", kda_args.threads, "Threads over (sequence, head)")->check(CLI::PositiveNumber);

  CompareArgs cmp_args;
  CLI::App* cmp = app.add_subcommand(
      "compare", "Compare a kernel's output file with a golden; exit 0 pass, 1 fail, 2 unusable input");
  cmp->add_option("--golden", cmp_args.golden, "Golden safetensors file")->required();
  cmp->add_option("--candidate", cmp_args.candidate, "The kernel's outputs (same tensor names)")->required();
  cmp->add_option("--policy", cmp_args.policy, "Tolerance policy:\n" + check::policy_help())->capture_default_str();
  cmp->add_option("--tensors", cmp_args.tensors, "Tensors to compare (default: the golden's outputs)")->delimiter(',');
  cmp->add_option("--window", cmp_args.window, "Also print the error per window of this many tokens");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? exit_ok : exit_unusable;
  }
  if (!execute) return exit_ok;
  try {
    if (*gen) return golden_generate(golden_args);
    if (*ver) return golden_verify(golden_args);
    if (*lst) return golden_list(golden_args);
    if (*kda_cmd) return kda_command(kda_args);
    if (*cmp) return compare_command(cmp_args);
  } catch (const FileError& e) {
    std::fprintf(stderr, "k3ref: %s\n", e.what());
    return exit_unusable;
  } catch (const InvalidArgument& e) {
    std::fprintf(stderr, "k3ref: %s\n", e.what());
    return exit_unusable;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "k3ref: error: %s\n", e.what());
    return exit_unusable;
  }
  return exit_unusable;
}

}  // namespace k3ref::cli
