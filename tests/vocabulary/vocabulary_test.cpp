// The options vocabulary (k3ref/vocabulary.h): every table's names and values are each
// other's inverse, the registry is the tables with the option structs' defaults, and an
// unknown name gives one line naming the option and every allowed name.
#include "test_support.h"

#include <set>
#include <string>

#include "k3ref/error.h"
#include "k3ref/kcp/context_parallel.h"
#include "k3ref/kda/chunkwise.h"
#include "k3ref/kda/kernel_contracts.h"
#include "k3ref/kda/options.h"
#include "k3ref/num/tier.h"
#include "k3ref/vocabulary.h"

namespace k3ref {
namespace {

// name(value) and find(name) are inverse over the table; names and values are distinct;
// parse of a name not in the table throws the one-line message.
template <class E, std::size_t N>
void expect_round_trip(const Choices<E, N>& c) {
  std::set<std::string_view> names;
  std::set<E> values;
  for (const auto& x : c.values) {
    EXPECT_EQ(c.name(x.value), x.name) << c.option;
    EXPECT_EQ(c.find(x.name), x.value) << c.option << " " << x.name;
    EXPECT_EQ(c.parse(x.name), x.value) << c.option << " " << x.name;
    EXPECT_FALSE(x.name.empty()) << c.option;
    names.insert(x.name);
    values.insert(x.value);
  }
  EXPECT_EQ(names.size(), N) << c.option << ": a name twice";
  EXPECT_EQ(values.size(), N) << c.option << ": a value twice";
  std::string listed;
  for (const auto& x : c.values) (listed += listed.empty() ? "" : ", ") += x.name;
  for (std::string_view bad : {"", "nope", "Log_decay"}) {
    if (c.find(bad)) continue;
    try {
      c.parse(bad);
      ADD_FAILURE() << c.option << ": '" << bad << "' parsed";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()),
                "option '" + std::string(c.option) + "' must be one of " + listed + ", not '" + std::string(bad) + "'");
    }
  }
}

TEST(Vocabulary, EveryTableRoundTrips) {
  expect_round_trip(kda::gate_forms);
  expect_round_trip(kda::gate_bases);
  expect_round_trip(kda::beta_forms);
  expect_round_trip(kda::state_layouts);
  expect_round_trip(kda::backward_methods);
  expect_round_trip(kda::chunk_forms);
  expect_round_trip(kda::contract::kernels);
  expect_round_trip(kda::contract::precisions);
  expect_round_trip(kcp::merges);
  expect_round_trip(num::tiers);
  expect_round_trip(num::precision_tiers);
}

TEST(Vocabulary, ToStringIsTheTablesName) {
  for (const auto& x : kda::gate_forms.values) EXPECT_EQ(kda::to_string(x.value), x.name);
  for (const auto& x : kda::gate_bases.values) EXPECT_EQ(kda::to_string(x.value), x.name);
  for (const auto& x : kda::beta_forms.values) EXPECT_EQ(kda::to_string(x.value), x.name);
  for (const auto& x : kda::state_layouts.values) EXPECT_EQ(kda::to_string(x.value), x.name);
  for (const auto& x : kda::chunk_forms.values) EXPECT_EQ(kda::to_string(x.value), x.name);
  for (const auto& x : kda::contract::kernels.values) EXPECT_EQ(kda::contract::to_string(x.value), x.name);
  for (const auto& x : kda::contract::precisions.values) EXPECT_EQ(kda::contract::to_string(x.value), x.name);
  for (const auto& x : num::tiers.values) EXPECT_EQ(num::to_string(x.value), x.name);
}

TEST(Vocabulary, TierNamesAndTheGoldensDescription) {
  // The precision option offers double and mp256, each entry the tier table's own.
  ASSERT_EQ(num::precision_tiers.values.size(), 2u);
  for (const auto& x : num::precision_tiers.values) {
    EXPECT_EQ(num::tiers.name(x.value), x.name);
    EXPECT_EQ(num::description(x.value), x.about);
  }
  EXPECT_EQ(num::to_string(num::Tier::mp256), "mp256");
  // The reference precision the KDA, AttnRes, kcp and serving goldens record (goldens/MANIFEST.json).
  EXPECT_EQ(num::description(num::Tier::mp256), std::to_string(num::golden_bits) + "-bit binary float");
  EXPECT_EQ(num::description(num::Tier::rational), "exact rational");
}

TEST(Vocabulary, RegistryIsTheTablesWithTheOptionStructsDefaults) {
  std::vector<std::string_view> options;
  for (const OptionVocabulary& v : option_vocabulary()) options.push_back(v.option);
  EXPECT_EQ(options, (std::vector<std::string_view>{"gate", "gate_base", "beta", "state_layout", "precision",
                                                    "chunk_form", "method", "merge", "contract"}));
  auto expect_same = [](const OptionVocabulary& v, const auto& table) {
    ASSERT_EQ(v.values.size(), table.values.size()) << v.option;
    for (std::size_t i = 0; i < v.values.size(); ++i) {
      EXPECT_EQ(v.values[i].name, table.values[i].name) << v.option;
      EXPECT_EQ(v.values[i].about, table.values[i].about) << v.option;
      EXPECT_TRUE(v.contains(table.values[i].name)) << v.option;
    }
    EXPECT_FALSE(v.contains("nope"));
  };
  expect_same(option_vocabulary("gate"), kda::gate_forms);
  expect_same(option_vocabulary("gate_base"), kda::gate_bases);
  expect_same(option_vocabulary("beta"), kda::beta_forms);
  expect_same(option_vocabulary("state_layout"), kda::state_layouts);
  expect_same(option_vocabulary("precision"), num::precision_tiers);
  expect_same(option_vocabulary("chunk_form"), kda::chunk_forms);
  expect_same(option_vocabulary("method"), kda::backward_methods);
  expect_same(option_vocabulary("merge"), kcp::merges);
  expect_same(option_vocabulary("contract"), kda::contract::kernels);
  const kda::Options<double> o;
  EXPECT_EQ(option_vocabulary("gate").default_name, kda::to_string(o.gate));
  EXPECT_EQ(option_vocabulary("gate_base").default_name, kda::to_string(o.gate_base));
  EXPECT_EQ(option_vocabulary("beta").default_name, kda::to_string(o.beta));
  EXPECT_EQ(option_vocabulary("state_layout").default_name, kda::to_string(o.state_layout));
  EXPECT_EQ(option_vocabulary("chunk_form").default_name, kda::to_string(kda::ChunkwiseOptions{}.form));
  EXPECT_EQ(option_vocabulary("precision").default_name, "double");
  EXPECT_EQ(option_vocabulary("contract").default_name, "");  // required, no default
  EXPECT_EQ(option_vocabulary("gate_base").help(), "e | 2 (FlashKDA's exp2 convention)");
  try {
    option_vocabulary("gates");
    ADD_FAILURE() << "unknown option found";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()),
              "option_vocabulary: argument 'option' must be one of gate, gate_base, beta, state_layout, precision, "
              "chunk_form, method, merge, contract, not 'gates'");
  }
}

}  // namespace
}  // namespace k3ref
