// Speculative decoding with KDA: rolling the state back after verification.
//
// A verification pass runs the L draft tokens through the layer from the pre-draft state;
// the verifier accepts a prefix of a tokens (0 <= a <= L) and emits a bonus token. The
// live state has then gone past the accepted tokens and must be rolled back, both the
// KDA state and the short-convolution state.
//   replay:   cache the projected (pre-convolution) inputs of the draft tokens; rebuild by
//             running the a accepted tokens again from the pre-draft state (then the bonus
//             token, in the same loop).
//   snapshot: keep one copy of the state after every draft position; pick copy a.
// Both equal the recurrence over the accepted tokens (proofs/kcp_replay.md); what they
// cost in bytes is in src/report/comm.h (the report calculators, outside the library).
#pragma once

#include <optional>
#include <vector>

#include "k3ref/kcp/short_conv.h"
#include "k3ref/kda/recurrent.h"

namespace k3ref::kcp {

// The constants of one KDA layer's decode path after the projections.
template <class S>
struct DecodeLayer {
  std::int64_t H = 1, HV = 1, K = 1, V = 1;
  Tensor<S> conv_q, conv_k;  // [H * K, W]
  Tensor<S> conv_v;          // [HV * V, W]
  ConvActivation activation = ConvActivation::silu;
  kda::Options<S> options;   // gate form, beta form, l2 norm, scale (state layout must be k_first)
  std::optional<Tensor<S>> A_log, dt_bias;
};

// Everything carried from one decode step to the next.
template <class S>
struct DecodeState {
  Tensor<S> kda;                     // [HV, K, V] K-first
  Tensor<S> conv_q, conv_k, conv_v;  // [D, W - 1], oldest first
  friend bool operator==(const DecodeState& a, const DecodeState& b) {
    return a.kda == b.kda && a.conv_q == b.conv_q && a.conv_k == b.conv_k && a.conv_v == b.conv_v;
  }
};

// The projected inputs of a run of tokens: what the replay cache holds per token.
template <class S>
struct ProjectedTokens {
  Tensor<S> q, k;  // [L, H * K] before the short convolution
  Tensor<S> v;     // [L, HV * V] before the short convolution
  Tensor<S> g;     // [L, HV, K] the gate input, as the layer's gate form reads it
  Tensor<S> beta;  // [L, HV] before activation
  std::int64_t size() const { return q.dim(0); }
  // Tokens [from, to).
  ProjectedTokens slice(std::int64_t from, std::int64_t to) const {
    auto rows = [&](const Tensor<S>& t) {
      Shape shape = t.shape();
      shape[0] = to - from;
      const std::int64_t row = t.dim(0) == 0 ? 0 : t.numel() / t.dim(0);
      return Tensor<S>(shape, std::vector<S>(t.data() + from * row, t.data() + to * row));
    };
    return ProjectedTokens{rows(q), rows(k), rows(v), rows(g), rows(beta)};
  }
  // This run followed by `more`.
  ProjectedTokens append(const ProjectedTokens& more) const {
    auto cat = [](const Tensor<S>& a, const Tensor<S>& b) {
      Shape shape = a.shape();
      shape[0] += b.dim(0);
      std::vector<S> data = a.values();
      data.insert(data.end(), b.values().begin(), b.values().end());
      return Tensor<S>(shape, std::move(data));
    };
    return ProjectedTokens{cat(q, more.q), cat(k, more.k), cat(v, more.v), cat(g, more.g), cat(beta, more.beta)};
  }
};

template <class S>
DecodeState<S> zero_decode_state(const DecodeLayer<S>& layer) {
  const std::int64_t W = layer.conv_q.dim(1);
  return DecodeState<S>{Tensor<S>({layer.HV, layer.K, layer.V}), Tensor<S>({layer.H * layer.K, W - 1}),
                        Tensor<S>({layer.H * layer.K, W - 1}), Tensor<S>({layer.HV * layer.V, W - 1})};
}

template <class S>
struct DecodeRun {
  Tensor<S> o;  // [L, HV, V]
  DecodeState<S> state;
};

// Runs tokens from `state` through the layer: short convolutions (with their states),
// then the KDA recurrence (kda::recurrent_forward) from the state.
template <class S>
DecodeRun<S> decode_run(const DecodeLayer<S>& layer, const DecodeState<S>& state, const ProjectedTokens<S>& tokens) {
  if (layer.options.state_layout != kda::StateLayout::k_first)
    throw InvalidArgument("kcp::decode_run: argument 'layer': options.state_layout must be k_first");
  const std::int64_t L = tokens.size();
  auto conv = [&](const Tensor<S>& x, const Tensor<S>& weight, const Tensor<S>& conv_state) {
    ShortConvInputs<S> in;
    in.x = Tensor<S>({1, L, x.dim(1)}, x.values());
    in.weight = weight;
    in.initial_state = Tensor<S>({1, conv_state.dim(0), conv_state.dim(1)}, conv_state.values());
    auto out = short_conv_forward(in, layer.activation);
    return std::pair{out.y, Tensor<S>({conv_state.dim(0), conv_state.dim(1)}, out.final_state.values())};
  };
  auto [q, conv_q] = conv(tokens.q, layer.conv_q, state.conv_q);
  auto [k, conv_k] = conv(tokens.k, layer.conv_k, state.conv_k);
  auto [v, conv_v] = conv(tokens.v, layer.conv_v, state.conv_v);
  kda::Inputs<S> in;
  in.q = Tensor<S>({1, L, layer.H, layer.K}, q.values());
  in.k = Tensor<S>({1, L, layer.H, layer.K}, k.values());
  in.v = Tensor<S>({1, L, layer.HV, layer.V}, v.values());
  in.g = Tensor<S>({1, L, layer.HV, layer.K}, tokens.g.values());
  in.beta = Tensor<S>({1, L, layer.HV}, tokens.beta.values());
  in.initial_state = Tensor<S>({1, layer.HV, layer.K, layer.V}, state.kda.values());
  in.A_log = layer.A_log;
  in.dt_bias = layer.dt_bias;
  kda::Options<S> opt = layer.options;
  opt.output_final_state = true;
  opt.output_all_states = false;
  const auto out = kda::recurrent_forward(in, opt);
  return DecodeRun<S>{Tensor<S>({L, layer.HV, layer.V}, out.o.values()),
                      DecodeState<S>{Tensor<S>({layer.HV, layer.K, layer.V}, out.final_state->values()),
                                     std::move(conv_q), std::move(conv_k), std::move(conv_v)}};
}

// Replay: the state after the first `accepted` draft tokens, rebuilt from the pre-draft
// state and the cached projected inputs, followed by the bonus token when given (one run).
template <class S>
DecodeRun<S> replay_accepted(const DecodeLayer<S>& layer, const DecodeState<S>& pre_draft,
                             const ProjectedTokens<S>& draft_cache, std::int64_t accepted,
                             const std::optional<ProjectedTokens<S>>& bonus = std::nullopt) {
  if (accepted < 0 || accepted > draft_cache.size())
    throw InvalidArgument("kcp::replay_accepted: argument 'accepted': must be in [0, draft length]");
  ProjectedTokens<S> run = draft_cache.slice(0, accepted);
  if (bonus) run = run.append(*bonus);
  return decode_run(layer, pre_draft, run);
}

// Snapshot baseline: the draft tokens one at a time, keeping the state after each.
// Entry i is the state after i draft tokens (entry 0 the pre-draft state).
template <class S>
std::vector<DecodeState<S>> snapshot_states(const DecodeLayer<S>& layer, const DecodeState<S>& pre_draft,
                                            const ProjectedTokens<S>& draft) {
  std::vector<DecodeState<S>> snaps{pre_draft};
  for (std::int64_t i = 0; i < draft.size(); ++i) snaps.push_back(decode_run(layer, snaps.back(), draft.slice(i, i + 1)).state);
  return snaps;
}

}  // namespace k3ref::kcp
