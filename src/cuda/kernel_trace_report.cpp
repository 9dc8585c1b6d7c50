#include "cuda/kernel_trace_report.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>

#include "core/error.h"

namespace vavilov::cuda::kernel_trace {

namespace {

bool fits(const Entry& e, const LaunchRecord& l) {
  return e.blocks == l.blocks && e.threads == l.threads && e.pass_end == l.pass_end;
}

std::vector<Entry> first_per_grid(const std::vector<Entry>& entries) {
  std::vector<Entry> kept;
  std::set<uint64_t> seen;  // in this pass
  for (const Entry& e : entries) {
    if (!seen.insert(e.grid_id).second) continue;
    kept.push_back(e);
    if (e.pass_end) seen.clear();
  }
  return kept;
}

double us(uint64_t later_ns, uint64_t earlier_ns) { return double(int64_t(later_ns - earlier_ns)) * 1e-3; }
double rounded(double x) { return std::round(x * 100) / 100; }

// Spans of one pass's kernels from their releases; `end_ns`: the end marker's release.
Pass close_pass(const std::vector<MatchedKernel>& kernels, const LaunchRecord& marker, uint64_t end_ns) {
  Pass pass;
  pass.kind = marker.pass_kind;
  pass.rows = marker.pass_rows;
  const auto first = std::find_if(kernels.begin(), kernels.end(), [](const MatchedKernel& k) { return k.recorded; });
  check(first != kernels.end(), "kernel trace: a {} pass of {} rows has no recorded kernel", pass_kind_name(pass.kind),
        pass.rows);
  const uint64_t start_ns = first->entry.released_ns;
  pass.total_us = us(end_ns, start_ns);
  for (size_t i = 0; i < kernels.size(); ++i) {
    const MatchedKernel& k = kernels[i];
    KernelSpan span;
    span.name = k.launch.name;
    span.scope = k.launch.scope;
    span.layer = k.launch.layer;
    span.recorded = k.recorded;
    span.listed = k.listed;
    span.blocks = k.listed ? k.launch.blocks : k.entry.blocks;
    if (k.recorded) {
      uint64_t next_ns = end_ns;
      for (size_t j = i + 1; j < kernels.size(); ++j)
        if (kernels[j].recorded) {
          next_ns = kernels[j].entry.released_ns;
          break;
        }
      span.start_us = us(k.entry.released_ns, start_ns);
      span.span_us = us(next_ns, k.entry.released_ns);
      span.waited_us = us(k.entry.released_ns, k.entry.arrived_ns);
    }
    pass.kernels.push_back(span);
  }
  return pass;
}

struct Averaged {
  std::vector<KernelSpan> kernels;  // position by position
  double total_us = 0;
  int count = 0;
};

void add_pass(Averaged& a, const Pass& p) {
  if (a.count == 0) {
    a.kernels = p.kernels;
    a.total_us = p.total_us;
    a.count = 1;
    return;
  }
  check(a.kernels.size() == p.kernels.size(), "kernel trace: two {} passes of {} rows have {} and {} kernels",
        pass_kind_name(p.kind), p.rows, a.kernels.size(), p.kernels.size());
  for (size_t i = 0; i < p.kernels.size(); ++i) {
    KernelSpan& sum = a.kernels[i];
    const KernelSpan& k = p.kernels[i];
    check(sum.name == k.name, "kernel trace: {} passes of {} rows differ at kernel {}: {} and {}",
          pass_kind_name(p.kind), p.rows, i, sum.name, k.name);
    sum.start_us += k.start_us;
    sum.span_us += k.span_us;
    sum.waited_us += k.waited_us;
  }
  a.total_us += p.total_us;
  ++a.count;
}

nlohmann::json kernel_list(const std::vector<KernelSpan>& kernels) {
  nlohmann::json list = nlohmann::json::array();
  for (const KernelSpan& k : kernels) {
    nlohmann::json j = {{"name", k.name}, {"blocks", k.blocks}};
    if (!k.scope.empty()) j["layer"] = {{"type", k.scope}, {"index", k.layer}};
    if (!k.listed) j["listed"] = false;
    if (!k.recorded) {
      j["recorded"] = false;
    } else {
      j["start_us"] = rounded(k.start_us);
      j["span_us"] = rounded(k.span_us);
      j["waited_us"] = rounded(k.waited_us);
    }
    list.push_back(j);
  }
  return list;
}

nlohmann::json by_kernel(const std::vector<KernelSpan>& kernels, double total_us) {
  std::map<std::string, std::pair<int, double>> kinds;
  for (const KernelSpan& k : kernels) {
    auto& [launches, span] = kinds[kernel_kind(k.name)];
    ++launches;
    span += k.span_us;
  }
  std::vector<std::pair<std::string, std::pair<int, double>>> sorted(kinds.begin(), kinds.end());
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  nlohmann::json list = nlohmann::json::array();
  for (const auto& [kind, value] : sorted)
    list.push_back({{"kernel", kind},
                    {"launches", value.first},
                    {"span_us", rounded(value.second)},
                    {"share", rounded(100 * value.second / total_us) / 100}});
  return list;
}

// Per layer type: the layers' total and, over the layers whose kernels are the type's most common sequence, each
// position's mean span (one layer's profile).
nlohmann::json by_layer_type(const std::vector<KernelSpan>& kernels, double total_us) {
  std::map<std::string, std::map<int, std::vector<const KernelSpan*>>> layers;
  double outside = 0;
  for (const KernelSpan& k : kernels)
    if (k.scope.empty())
      outside += k.span_us;
    else
      layers[k.scope][k.layer].push_back(&k);
  nlohmann::json out;
  for (const auto& [type, members] : layers) {
    double span = 0;
    std::map<std::vector<std::string>, std::vector<const std::vector<const KernelSpan*>*>> shapes;
    for (const auto& [index, list] : members) {
      std::vector<std::string> names;
      for (const KernelSpan* k : list) {
        span += k->span_us;
        names.push_back(k->name);
      }
      shapes[names].push_back(&list);
    }
    const auto common = std::max_element(
        shapes.begin(), shapes.end(), [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
    nlohmann::json profile = nlohmann::json::array();
    for (size_t i = 0; i < common->first.size(); ++i) {
      double sum = 0;
      for (const auto* list : common->second) sum += (*list)[i]->span_us;
      profile.push_back({{"name", common->first[i]}, {"span_us", rounded(sum / double(common->second.size()))}});
    }
    const double n = double(members.size());
    out[type] = {{"layers", members.size()},
                 {"span_us", rounded(span)},
                 {"per_layer_us", rounded(span / n)},
                 {"share", rounded(100 * span / total_us) / 100},
                 {"profile_layers", common->second.size()},
                 {"profile", profile}};
  }
  out["outside_layers"] = {{"span_us", rounded(outside)}, {"share", rounded(100 * outside / total_us) / 100}};
  return out;
}

}  // namespace

std::vector<MatchedKernel> match(const std::vector<Entry>& raw_entries, const std::vector<LaunchRecord>& launches) {
  const std::vector<Entry> entries = first_per_grid(raw_entries);
  std::vector<MatchedKernel> out;
  size_t i = 0, j = 0;
  while (j < launches.size()) {
    MatchedKernel k;
    if (i < entries.size() && fits(entries[i], launches[j])) {
      k.launch = launches[j++];
      k.entry = entries[i++];
      k.recorded = true;
    } else if (i >= entries.size() || (j + 1 < launches.size() && fits(entries[i], launches[j + 1]))) {
      k.launch = launches[j++];
    } else {
      k.entry = entries[i++];
      k.launch.name = "(unlisted)";
      k.recorded = true;
      k.listed = false;
    }
    out.push_back(k);
  }
  for (; i < entries.size(); ++i) {
    MatchedKernel k;
    k.entry = entries[i];
    k.launch.name = "(unlisted)";
    k.recorded = true;
    k.listed = false;
    out.push_back(k);
  }
  return out;
}

std::vector<Pass> passes(const std::vector<MatchedKernel>& kernels) {
  std::vector<Pass> out;
  std::vector<MatchedKernel> current;
  for (const MatchedKernel& k : kernels) {
    if (!k.launch.pass_end) {
      current.push_back(k);
      continue;
    }
    check(k.recorded, "kernel trace: the end marker of a {} pass of {} rows has no entry",
          pass_kind_name(k.launch.pass_kind), k.launch.pass_rows);
    out.push_back(close_pass(current, k.launch, k.entry.released_ns));
    current.clear();
  }
  check(!out.empty(), "kernel trace: no pass was traced");
  return out;
}

nlohmann::json summarise(const std::vector<Pass>& traced, int steps) {
  std::vector<std::pair<std::pair<int, int>, Averaged>> shapes;  // in order of first appearance
  int unrecorded = 0, unlisted = 0;
  for (const Pass& p : traced) {
    const std::pair<int, int> key{p.kind, p.rows};
    auto it = std::find_if(shapes.begin(), shapes.end(), [&](const auto& s) { return s.first == key; });
    if (it == shapes.end()) it = shapes.insert(shapes.end(), {key, Averaged{}});
    add_pass(it->second, p);
    for (const KernelSpan& k : p.kernels) {
      unrecorded += !k.recorded;
      unlisted += !k.listed;
    }
  }
  nlohmann::json list = nlohmann::json::array();
  double per_step_us = 0;
  for (auto& [key, a] : shapes) {
    for (KernelSpan& k : a.kernels) {
      k.start_us /= a.count;
      k.span_us /= a.count;
      k.waited_us /= a.count;
    }
    const double total = a.total_us / a.count, per_step = double(a.count) / steps;
    per_step_us += total * per_step;
    list.push_back({{"pass", pass_kind_name(key.first)},
                    {"rows", key.second},
                    {"passes_per_step", per_step},
                    {"traced_passes", a.count},
                    {"critical_path_us", rounded(total)},
                    {"kernel_count", a.kernels.size()},
                    {"by_layer_type", by_layer_type(a.kernels, total)},
                    {"by_kernel", by_kernel(a.kernels, total)},
                    {"kernels", kernel_list(a.kernels)}});
  }
  return {{"steps", steps},
          {"critical_path_us_per_step", rounded(per_step_us)},
          {"unrecorded_launches", unrecorded},
          {"unlisted_entries", unlisted},
          {"passes", list}};
}

uint64_t clock_granularity_ns(const std::vector<Entry>& entries) {
  uint64_t granularity = 0;
  for (size_t i = 1; i < entries.size(); ++i) {
    const uint64_t a = entries[i].released_ns, b = entries[i - 1].released_ns;
    granularity = std::gcd(granularity, a > b ? a - b : b - a);
  }
  return granularity;
}

const char* pass_kind_name(int kind) {
  switch (kind) {
    case 0:
      return "trunk";
    case 1:
      return "head";
    case 2:
      return "head_logits";
    case 3:
      return "greedy_step";
    case 4:
      return "greedy_step_drafts";
    default:
      return "other";
  }
}

std::string short_kernel_name(const std::string& demangled) {
  std::string name = demangled;
  if (name.rfind("void ", 0) == 0) name.erase(0, 5);
  // The parameter list: the last top-level '(' (template arguments may hold parentheses too).
  int depth = 0;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (c == '<') ++depth;
    if (c == '>') --depth;
    if (c == '(' && depth == 0 && name.compare(i, 21, "(anonymous namespace)") != 0) {
      name.resize(i);
      break;
    }
    if (c == '(' && depth == 0) i += 20;
  }
  for (const std::string prefix : {"vavilov::cuda::", "vavilov::", "(anonymous namespace)::"}) {
    for (size_t at = name.find(prefix); at != std::string::npos; at = name.find(prefix)) name.erase(at, prefix.size());
  }
  return name;
}

std::string kernel_kind(const std::string& name) { return name.substr(0, name.find('<')); }

}  // namespace vavilov::cuda::kernel_trace
