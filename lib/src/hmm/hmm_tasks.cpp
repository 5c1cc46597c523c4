#include "trellis/hmm/hmm_tasks.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>

#include <unistd.h>

#include "cuda/kernels_built.h"
#include "lib/src/hmm/hmm_infer.h"
#include "trellis/io/atomic_file.h"
#include "trellis/io/conll.h"
#include "trellis/error.h"

namespace trellis {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

at::TensorOptions run_options(const HMMRunOptions& o) {
  if (!o.device.is_cpu() && !o.device.is_cuda()) throw Error("--device must be cpu or cuda, not " + o.device.str());
  if (o.device.is_cuda() && !at::hasCUDA()) throw Error("--device " + o.device.str() + ": no CUDA device is available");
  if (o.dtype != at::kFloat && o.dtype != at::kDouble) throw Error("HMM computations run in float32 or float64");
  if (o.threads < 0) throw Error("--threads must be >= 0 (0: LibTorch's default), not " + std::to_string(o.threads));
  if (o.memory_budget < 1) throw Error("--memory-budget must be at least 1 byte");
  if (o.threads > 0) at::set_num_threads(o.threads);
  return at::TensorOptions().dtype(o.dtype).device(o.device);
}

int64_t states_of(const HMMModelFile& m) {
  return std::visit([](const auto& hmm) { return hmm.num_states(); }, m.model);
}

// The model must fit the data: emission kind, vocabulary size or feature count.
void check_fits(const HMMModelFile& file, HMMDataset& data) {
  std::visit(
      [&](const auto& m) {
        if constexpr (std::is_same_v<std::decay_t<decltype(m)>, CategoricalHMM>) {
          if (!data.categorical())
            throw Error(data.path() + ": holds feature vectors (F = " + std::to_string(data.num_features()) +
                        "), but the model has categorical emissions");
          data.expect_symbols(m.num_symbols());
          // Ids mean words only through a vocabulary: data converted with another one would be scored as nonsense.
          if (!file.vocabulary.empty()) {
            const std::vector<std::string> words = data.vocabulary();
            const auto differ = std::mismatch(words.begin(), words.end(), file.vocabulary.begin(), file.vocabulary.end());
            if (!words.empty() && (differ.first != words.end() || differ.second != file.vocabulary.end())) {
              const std::size_t i = differ.first - words.begin();
              const auto word = [&](const std::vector<std::string>& v) {
                return i < v.size() ? "'" + v[i] + "'" : std::string("none");
              };
              throw Error(data.path() + ": its '/vocabulary' is not the model's (id " + std::to_string(i) + ": " +
                          word(words) + " here, " + word(file.vocabulary) +
                          " in the model); convert the data with `trellis hmm convert --vocabulary-from MODEL`");
            }
          }
        } else {
          if (data.categorical())
            throw Error(data.path() + ": holds categorical ids, but the model has Gaussian emissions");
          if (data.num_features() != m.num_features())
            throw Error(data.path() + ": observations have F = " + std::to_string(data.num_features()) +
                        " features, the model has " + std::to_string(m.num_features()));
        }
      },
      file.model);
}

// The model in the computation's type and on its device. A Gaussian variance too small for that type (1/variance or
// mean²/variance overflows, which would make every score NaN) is an error naming it with its stored value.
template <class HMM>
HMM for_computation(const HMM& m, const at::TensorOptions& opt) {
  if constexpr (std::is_same_v<HMM, GaussianHMM>) {
    const at::Tensor var = m.variances.detach().cpu().to(opt.dtype()), mean = m.means.detach().cpu().to(opt.dtype());
    const at::Tensor bad = ~at::isfinite(var.reciprocal()) | ~at::isfinite(mean * mean / var);
    if (bad.any().item<bool>()) {
      const at::Tensor i = bad.nonzero()[0];
      const int64_t k = i[0].item<int64_t>(), f = i[1].item<int64_t>();
      throw Error("the model's covars[" + std::to_string(k) + "][" + std::to_string(f) +
                  "] = " + c10::str(m.variances[k][f].template item<double>()) + " (mean " +
                  c10::str(m.means[k][f].template item<double>()) + ") is too small for " +
                  (opt.dtype() == at::kFloat ? "float32 computation (1/variance or mean²/variance overflows): use "
                                               "--precision float64"
                                             : "float64 computation (1/variance or mean²/variance overflows)"));
    }
  }
  return m.to(opt);
}

// Copies of the model's parameters that training holds at once (model, statistics, gradients, per-thread sums).
constexpr double kTrainingCopies = 8;

void check_fit_options(const HMMFitOptions& f) {
  if (f.states < 0) throw Error("--states must be >= 1, not " + std::to_string(f.states));
  if (f.symbols < 0) throw Error("--symbols must be >= 1, not " + std::to_string(f.symbols));
  if (f.order != 1 && (f.order != 2 || !f.supervised))
    throw Error("--order must be 1, or 2 with --supervised (second-order models are estimated from labels)");
  if (f.restarts < 1) throw Error("--restarts must be >= 1, not " + std::to_string(f.restarts));
  if (f.initial && f.supervised)
    throw Error("--init and --supervised cannot be combined (a supervised fit counts the labels; it has no start)");
  if (f.initial && f.restarts > 1)
    throw Error("--init and --restarts cannot be combined (EM from a given model has one start)");
  if (f.em.max_iterations < 1) throw Error("--max-iterations must be >= 1, not " + std::to_string(f.em.max_iterations));
  if (!std::isfinite(f.em.tolerance) || f.em.tolerance < 0)
    throw Error("--tolerance must be a finite number >= 0, not " + c10::str(f.em.tolerance));
  if (!std::isfinite(f.em.m_step.smoothing) || f.em.m_step.smoothing < 0)
    throw Error("--smoothing must be a finite number >= 0, not " + c10::str(f.em.m_step.smoothing));
  if (!std::isfinite(f.em.m_step.covars_prior) || f.em.m_step.covars_prior <= 0)
    throw Error("--covars-prior must be a finite number > 0, not " + c10::str(f.em.m_step.covars_prior));
}

template <class Stats>
Stats to_double(Stats s) {
  for (at::Tensor* t : {&s.start, &s.transitions}) *t = t->to(at::kDouble);
  if constexpr (std::is_same_v<Stats, CategoricalHMM::Statistics>) {
    s.emissions = s.emissions.to(at::kDouble);
  } else {
    for (at::Tensor* t : {&s.weight, &s.first, &s.second}) *t = t->to(at::kDouble);
  }
  return s;
}

// The statistics' tensors, for summing over ranks.
template <class Stats>
std::vector<at::Tensor> tensors_of(const Stats& s) {
  if constexpr (std::is_same_v<Stats, CategoricalHMM::Statistics>) return {s.start, s.transitions, s.emissions};
  else if constexpr (std::is_same_v<Stats, GaussianHMM::Statistics>)
    return {s.start, s.transitions, s.weight, s.first, s.second};
  else return {s.unigrams, s.bigrams, s.trigrams, s.emissions};  // TrigramCounts
}

// Zero statistics for a model of this shape, in float64 on `device`: the sum a rank starts from (a rank whose share
// is empty still takes part in the sums).
template <class HMM>
typename HMM::Statistics zero_statistics(const HMM& shape, const at::Device& device) {
  const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble).device(device);
  const int64_t K = shape.num_states();
  typename HMM::Statistics s;
  s.start = at::zeros({K}, f64);
  s.transitions = at::zeros({K, K}, f64);
  if constexpr (std::is_same_v<HMM, CategoricalHMM>) {
    s.emissions = at::zeros({K, shape.num_symbols()}, f64);
  } else {
    s.weight = at::zeros({K}, f64);
    s.first = at::zeros({K, shape.num_features()}, f64);
    s.second = at::zeros({K, shape.num_features()}, f64);
  }
  return s;
}

// The process group, or null for a single process (then collectives are skipped and errors keep their type).
const DistributedContext* group_of(const HMMRunOptions& o) {
  return o.distributed && o.distributed->distributed() ? o.distributed : nullptr;
}

// Runs `work` on this rank; with a process group, a failure on any rank becomes the same Error on every rank.
template <class Work>
void on_every_rank(const DistributedContext* group, Work&& work) {
  if (!group) {
    work();
    return;
  }
  group->check_all(failure_of(std::forward<Work>(work)));
}

// The same for a rank's share of the work: a rank done early waits for the others as long as they make progress
// (DistributedContext::wait_for_all), not only for the timeout.
template <class Work>
void on_every_rank_after_all(const DistributedContext* group, Work&& work) {
  if (!group) {
    work();
    return;
  }
  const std::optional<std::string> failure = failure_of(std::forward<Work>(work));
  group->wait_for_all();
  group->check_all(failure);
}

// The results a rank keeps for rank 0, batch after batch: in memory up to `memory_budget` bytes, the rest in an
// unlinked temporary file under TMPDIR (or /tmp), so that a share whose results exceed memory still streams through.
class KeptResults {
 public:
  explicit KeptResults(int64_t memory_budget) : budget_(memory_budget) {}
  ~KeptResults() {
    if (file_) std::fclose(file_);
  }
  KeptResults(const KeptResults&) = delete;
  KeptResults& operator=(const KeptResults&) = delete;

  void push(std::vector<at::Tensor> tensors) {
    int64_t bytes = 0;
    for (auto& t : tensors) {
      t = t.contiguous();
      bytes += static_cast<int64_t>(t.nbytes());
    }
    if (!file_ && held_ + bytes <= budget_) {
      held_ += bytes;
      memory_.push_back(std::move(tensors));
      return;
    }
    if (!file_) open();
    std::vector<std::pair<std::vector<int64_t>, at::ScalarType>> shapes;
    for (const auto& t : tensors) {
      if (std::fwrite(t.data_ptr(), 1, t.nbytes(), file_) != t.nbytes())
        throw Error("cannot write this rank's results to a temporary file under " + directory() + ": " +
                    std::strerror(errno));
      shapes.emplace_back(t.sizes().vec(), t.scalar_type());
    }
    spilled_.push_back(std::move(shapes));
  }
  // Calls `use` with each batch's tensors, in the order pushed.
  void for_each(const std::function<void(const std::vector<at::Tensor>&)>& use) {
    for (const auto& tensors : memory_) use(tensors);
    if (!file_) return;
    std::rewind(file_);
    for (const auto& shapes : spilled_) {
      std::vector<at::Tensor> tensors;
      for (const auto& [sizes, type] : shapes) {
        at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(type));
        if (std::fread(t.data_ptr(), 1, t.nbytes(), file_) != t.nbytes())
          throw Error("cannot read this rank's results back from its temporary file under " + directory());
        tensors.push_back(std::move(t));
      }
      use(tensors);
    }
  }

 private:
  static std::string directory() {
    const char* d = std::getenv("TMPDIR");
    return d && *d ? d : "/tmp";
  }
  void open() {
    std::string path = directory() + "/trellis-results-XXXXXX";
    const int fd = ::mkstemp(path.data());
    if (fd < 0) throw Error("cannot create a temporary file under " + directory() + ": " + std::strerror(errno));
    ::unlink(path.c_str());  // gone with the process, however it ends
    file_ = ::fdopen(fd, "w+b");
    if (!file_) {
      ::close(fd);
      throw Error("cannot open a temporary file under " + directory() + ": " + std::strerror(errno));
    }
  }

  int64_t budget_, held_ = 0;
  std::vector<std::vector<at::Tensor>> memory_;
  std::vector<std::vector<std::pair<std::vector<int64_t>, at::ScalarType>>> spilled_;
  std::FILE* file_ = nullptr;
};

// Consecutive ranges of the sequences [first, first + count), as HMMDataset::batches cuts the whole dataset: at most
// max_tokens positions (sequences × longest length) each, a longer sequence alone.
std::vector<std::pair<int64_t, int64_t>> share_batches(const HMMDataset& data, const DatasetShare& share,
                                                       int64_t max_tokens) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const auto& o = data.offsets();
  const int64_t end = share.first + share.count;
  int64_t first = share.first, T = 0;
  for (int64_t i = share.first; i < end; ++i) {
    const int64_t len = o[i + 1] - o[i];
    if (i > first && std::max(T, len) * (i - first + 1) > max_tokens) {
      out.emplace_back(first, i - first);
      first = i;
      T = 0;
    }
    T = std::max(T, len);
  }
  if (end > first) out.emplace_back(first, end - first);
  return out;
}

DatasetShare share_of_rank(const HMMDataset& data, int rank, int world) {
  const auto& o = data.offsets();
  std::vector<int64_t> lengths(o.size() - 1);
  for (std::size_t i = 0; i + 1 < o.size(); ++i) lengths[i] = o[i + 1] - o[i];
  const std::vector<int64_t> bounds = balanced_shares(lengths, world);
  return {bounds[rank], bounds[rank + 1] - bounds[rank], o[bounds[rank + 1]] - o[bounds[rank]]};
}

// Largest id in /observations (categorical) or /labels, by one streaming pass over each rank's share.
int64_t largest_id(HMMDataset& data, bool labels, int64_t max_tokens, const DistributedContext* group) {
  int64_t top = -1;
  on_every_rank_after_all(group, [&] {
    const DatasetShare share = share_of_rank(data, group ? group->rank() : 0, group ? group->world_size() : 1);
    for (const auto& [first, count] : share_batches(data, share, max_tokens)) {
      const SequenceBatch b = data.read(first, count, labels);
      top = std::max(top, (labels ? b.labels : b.observations).max().item<int64_t>());
      if (group) group->mark_progress();
    }
  });
  return group ? group->all_reduce_max(top) : top;
}

// A random EM start. Gaussian means are observation rows picked at random, variances the data's, so that every
// state starts on the data (hmmlearn uses k-means for this).
template <class HMM>
HMM random_start(const HMM& shape, HMMDataset& data, uint64_t seed, double covars_prior) {
  if constexpr (std::is_same_v<HMM, CategoricalHMM>) {
    return CategoricalHMM::random(shape.num_states(), shape.num_symbols(), seed);
  } else {
    GaussianHMM m = GaussianHMM::random(shape.num_states(), shape.num_features(), seed);
    const SequenceBatch b = data.read(0, std::min<int64_t>(data.num_sequences(), 1000));
    const at::Tensor x = b.observations.to(at::kDouble)
                             .reshape({-1, shape.num_features()})
                             .index_select(0, (at::arange(b.observations.size(1)).unsqueeze(0) < b.lengths.unsqueeze(1))
                                                  .flatten()
                                                  .nonzero()
                                                  .squeeze(1));
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    m.means = x.index_select(0, at::randint(0, x.size(0), {shape.num_states()}, gen, at::kLong));
    m.variances = (x.var(0, /*unbiased=*/false) + covars_prior).unsqueeze(0).expand_as(m.means).contiguous();
    return m;
  }
}

}  // namespace

DatasetShare dataset_share(const HMMDataset& data, const DistributedContext* distributed) {
  if (!distributed) return {0, data.num_sequences(), data.num_tokens()};
  return share_of_rank(data, distributed->rank(), distributed->world_size());
}

int64_t batch_tokens(const HMMModelFile& model, int64_t num_features, bool with_posteriors, const HMMRunOptions& o,
                     bool written_out) {
  const int64_t K = states_of(model), elt = at::elementSize(o.dtype);
  // Per position, K values of each of:
  // - the streamed route (many states on CUDA, no autograd): the emission scores (two while a Gaussian's are formed),
  //   then beside them either the forward's longest-first copy or the Viterbi's messages of every step, and one to
  //   spare; with posteriors (or an E-step) the scores, their longest-first and reversed copies, the forward and
  //   backward messages of every step, the posteriors and the E-step's pair factors u and v, at most eight at once;
  // - the chain routes: the emission scores and their temporaries, the Viterbi messages (an int32 back-pointer or
  //   less) and path; with posteriors (or an E-step) the saved forward messages, gradients and the float32 copy
  //   written out;
  // - posteriors written out from a GPU: the float32 posteriors of the batch before, kept on the device until written.
  // Then the observations as read, padded and converted.
  const int64_t per_state = (streamed_route_takes(o.device, K) ? (with_posteriors ? 8 * elt : 3 * elt)
                                                               : (5 * elt + 4) + (with_posteriors ? 6 * elt + 4 : 0)) +
                            (with_posteriors && written_out && o.device.is_cuda() ? 4 : 0);
  const int64_t bytes = per_state * K + 4 * elt * num_features + 64;
  const int64_t tokens = o.memory_budget / bytes;
  if (tokens < 1) throw Error("the memory budget is too small for even one position of the model");
  return tokens;
}

InferSummary infer_dataset(const HMMModelFile& model, HMMDataset& data, const std::string& output, bool with_posteriors,
                           const HMMRunOptions& o, const BatchProgress& progress) {
  const DistributedContext* group = group_of(o);
  const int rank = group ? group->rank() : 0, world = group ? group->world_size() : 1;
  at::TensorOptions opt;
  int64_t max_tokens = 0;
  on_every_rank(group, [&] {
    if (rank == 0) check_writable_location(output, /*regular_only=*/true);
    opt = run_options(o);
    check_fits(model, data);
    max_tokens = batch_tokens(model, data.num_features(), with_posteriors, o);
  });
  const auto start = Clock::now();
  InferSummary sum;
  std::visit(
      [&](const auto& stored) {
        std::optional<std::decay_t<decltype(stored)>> m;
        std::unique_ptr<HMMInferenceWriter> out;
        on_every_rank(group, [&] {
          m = for_computation(stored, opt);
          if (rank == 0)
            out = std::make_unique<HMMInferenceWriter>(output, data.offsets(), m->num_states(), with_posteriors,
                                                       model.state_labels, o.posteriors_compression);
        });
        sum.setup_seconds = since(start);
        // One batch's results as written: log-likelihoods and Viterbi scores [2,B] (float64), paths [B,T] (int32),
        // posteriors [B,T,K] (float32). Rank 0 writes its own as they come; the others keep theirs for rank 0.
        struct Results {
          at::Tensor scores, paths, posteriors;
        };
        KeptResults kept(o.memory_budget);
        double log_likelihood = 0;
        cuda::reset_peak_device_memory(opt.device());
        const int64_t held = cuda::device_memory(opt.device()).current;
        on_every_rank_after_all(group, [&] {
          const auto batches = share_batches(data, share_of_rank(data, rank, world), max_tokens);
          for (std::size_t i = 0; i < batches.size(); ++i) {
            const auto [first, count] = batches[i];
            auto phase = Clock::now();
            const SequenceBatch b = data.read(first, count);
            // On a GPU the next batch is read while this one is computed and written (on the CPU the computation
            // has the cores, as many as --threads says).
            if (opt.device().is_cuda() && i + 1 < batches.size())
              data.prefetch(batches[i + 1].first, batches[i + 1].second);
            const at::Tensor lengths = b.lengths.to(opt.device());
            sum.read_seconds += since(phase);
            phase = Clock::now();
            const ChainPotentials p = m->potentials(b.observations.to(opt.device()), lengths);
            at::Tensor ll, nodes;
            if (with_posteriors) {
              const Marginals mg = chain_posteriors(p);
              ll = mg.log_partition.detach();
              nodes = mg.nodes;
              log_likelihood += ll.sum().item<double>();  // waits for the posteriors' kernels
              sum.posteriors_seconds += since(phase);
            }
            c10::NoGradGuard no_grad;
            std::optional<detail::LikelihoodAndPath> both;
            if (!with_posteriors) both = detail::likelihood_and_path(p);
            if (both) ll = both->log_likelihood;
            else if (!with_posteriors) ll = chain_log_likelihood(p);
            const ViterbiResult v = both ? both->viterbi : viterbi(p);
            // Waits for the batch's kernels: the compute time ends here.
            if (with_posteriors) v.score.sum().item<double>();
            else log_likelihood += ll.sum().item<double>();
            if (std::isinf(log_likelihood) && log_likelihood < 0) sum.impossible += ll.isneginf().sum().item<int64_t>();
            sum.compute_seconds += since(phase);
            phase = Clock::now();
            if (rank == 0) out->append(ll, v.score, v.path, b.lengths, nodes);
            else
              kept.push(with_posteriors
                            ? std::vector<at::Tensor>{at::stack({ll, v.score}).cpu().to(at::kDouble),
                                                      v.path.cpu().to(at::kInt), nodes.detach().cpu().to(at::kFloat)}
                            : std::vector<at::Tensor>{at::stack({ll, v.score}).cpu().to(at::kDouble),
                                                      v.path.cpu().to(at::kInt)});
            sum.write_seconds += since(phase);
            sum.sequences += count;
            sum.tokens += b.lengths.sum().item<int64_t>();
            if (progress) progress(sum.sequences, sum.tokens);
            if (group) group->mark_progress();
          }
        });
        sum.batch_peak_bytes = std::max<int64_t>(0, cuda::device_memory(opt.device()).peak - held);
        // Rank 0 receives the other ranks' results in dataset order. A write that fails on rank 0 still receives
        // the rest, so that no rank waits on a send rank 0 never matches.
        std::optional<std::string> write_failure;
        const auto assembly = Clock::now();
        if (rank == 0) {
          const auto& offsets = data.offsets();
          for (int r = 1; r < world; ++r) {
            group->signal("infer/" + std::to_string(r));
            for (const auto& [first, count] : share_batches(data, share_of_rank(data, r, world), max_tokens)) {
              int64_t T = 0;
              for (int64_t i = first; i < first + count; ++i) T = std::max(T, offsets[i + 1] - offsets[i]);
              std::vector<int64_t> lengths(count);
              for (int64_t i = 0; i < count; ++i) lengths[i] = offsets[first + i + 1] - offsets[first + i];
              Results got{at::empty({2, count}, at::kDouble), at::empty({count, T}, at::kInt), at::Tensor()};
              group->receive(got.scores, r);
              group->receive(got.paths, r);
              if (with_posteriors) {
                got.posteriors = at::empty({count, T, m->num_states()}, at::kFloat);
                group->receive(got.posteriors, r);
              }
              if (!write_failure)
                write_failure = failure_of([&] {
                  out->append(got.scores[0], got.scores[1], got.paths.to(at::kLong), at::tensor(lengths, at::kLong),
                              got.posteriors);
                });
              group->mark_progress();
            }
          }
          if (!group) out->commit();
          else if (!write_failure) write_failure = failure_of([&] { out->commit(); });
          sum.assembly_seconds = since(assembly);
        } else {
          group->await("infer/" + std::to_string(rank), 0);  // rank 0 has written the ranks before this one
          kept.for_each([&](const std::vector<at::Tensor>& results) {
            for (const at::Tensor& t : results) group->send(t, 0);
          });
        }
        if (group) {
          out.reset();            // without commit() its temporary file is removed
          group->wait_for_all();  // the ranks done sending wait for rank 0 to write the rest
          group->check_all(write_failure);
          at::Tensor totals = at::tensor({static_cast<double>(sum.sequences), static_cast<double>(sum.tokens),
                                          log_likelihood, static_cast<double>(sum.impossible)},
                                         at::kDouble);
          group->all_reduce_sum({totals});
          sum.sequences = static_cast<int64_t>(totals[0].item<double>());
          sum.tokens = static_cast<int64_t>(totals[1].item<double>());
          log_likelihood = totals[2].item<double>();
          sum.impossible = static_cast<int64_t>(totals[3].item<double>());
        }
        sum.log_likelihood = log_likelihood;
      },
      model.model);
  sum.seconds = since(start);
  return sum;
}

HMMModelFile fit_dataset(HMMDataset& data, const HMMFitOptions& fit, const HMMRunOptions& o,
                         const std::function<void(const EMIteration&)>& on_iteration) {
  check_fit_options(fit);
  const at::TensorOptions opt = run_options(o);
  const at::TensorOptions f64 = opt.dtype(at::kDouble);
  const DistributedContext* group = group_of(o);
  if (data.num_sequences() == 0) throw Error(data.path() + ": has no sequences to fit a model to");
  HMMModelFile out;
  out.state_names = data.label_names();
  out.vocabulary = data.vocabulary();
  const int64_t scan_tokens = std::max<int64_t>(1, o.memory_budget / 64);

  // The model's shape: K states, and V symbols or F features.
  int64_t K = fit.states, V = fit.symbols;
  if (fit.initial) {
    check_fits(*fit.initial, data);
    if (K && K != states_of(*fit.initial))
      throw Error("--states " + std::to_string(K) + " differs from the initial model's " +
                  std::to_string(states_of(*fit.initial)) + " states");
    K = states_of(*fit.initial);
    if (const auto* c = std::get_if<CategoricalHMM>(&fit.initial->model)) {
      if (V && V != c->num_symbols())
        throw Error("--symbols " + std::to_string(V) + " differs from the initial model's " +
                    std::to_string(c->num_symbols()) + " symbols");
      V = c->num_symbols();
    }
    if (out.state_names.empty()) out.state_names = fit.initial->state_names;
  }
  // Where a size is the data's largest id plus one, an absurd id (a corrupt or foreign dataset) is named as the cause
  // of an oversized model.
  std::string sizes_from_ids;
  const auto from_largest_id = [&](bool labels) {
    const int64_t top = largest_id(data, labels, scan_tokens, group);
    sizes_from_ids += (sizes_from_ids.empty() ? "" : "; ") + data.path() + "'s largest " +
                      (labels ? "label" : "observation") + " id is " + std::to_string(top);
    return top + 1;
  };
  if (fit.supervised) {
    if (!data.has_labels()) throw Error(data.path() + ": supervised training needs a '/labels' dataset");
    if (!K) K = out.state_names.empty() ? from_largest_id(true) : int64_t(out.state_names.size());
    data.expect_labels(K);
  }
  if (!K) throw Error("the number of states is needed: give --states or an initial model");
  if (!data.categorical() && V)
    throw Error("--symbols is for categorical data: " + data.path() + " holds feature vectors");
  if (data.categorical() && !V) V = out.vocabulary.empty() ? from_largest_id(false) : int64_t(out.vocabulary.size());
  // Second-order models have a state per label pair.
  const int64_t model_states = fit.order == 2 ? (K + 1) * K : K;
  try {
    check_model_shape(model_states, data.categorical() ? V : data.num_features(),
                      data.categorical() ? "symbols" : "features", kTrainingCopies);
  } catch (const Error& e) {
    if (sizes_from_ids.empty()) throw;
    throw Error(std::string(e.what()) + " (" + sizes_from_ids + ")");
  }
  if (data.categorical()) data.expect_symbols(V);
  if (int64_t(out.state_names.size()) != K) out.state_names.clear();
  if (int64_t(out.vocabulary.size()) != V) out.vocabulary.clear();
  const int64_t F = data.num_features();
  // Uniform rows: what a supervised fit keeps for a state that its labels give no counts (a label never followed by
  // another, such as sentence-final punctuation, or one that never occurs) and no smoothing gives mass.
  const auto uniform = [&](int64_t rows, int64_t cols) {
    return at::full({rows, cols}, -std::log(static_cast<double>(cols)), f64);
  };
  HMMModelFile shape_file;
  if (data.categorical())
    shape_file.model = CategoricalHMM{uniform(1, K).squeeze(0), uniform(K, K), uniform(K, V)};
  else
    shape_file.model =
        GaussianHMM{uniform(1, K).squeeze(0), uniform(K, K), at::zeros({K, F}, f64), at::ones({K, F}, f64)};
  const auto ranges = share_batches(data, dataset_share(data, group),
                                    batch_tokens(shape_file, F, /*with_posteriors=*/true, o, /*written_out=*/false));
  // Sums this rank's statistics over the ranks (a no-op for one process), extra numbers alongside.
  const auto sum_over_ranks = [&](std::vector<at::Tensor> tensors, const std::optional<std::string>& failure,
                                  std::vector<double*> extra = {}) {
    if (!group) return;
    at::Tensor numbers = at::empty({static_cast<int64_t>(extra.size())}, at::kDouble);
    for (std::size_t i = 0; i < extra.size(); ++i) numbers[i] = *extra[i];
    tensors.push_back(numbers);
    group->wait_for_all();
    group->all_reduce_sum(tensors, failure);
    for (std::size_t i = 0; i < extra.size(); ++i) *extra[i] = numbers[i].item<double>();
  };
  // Runs this rank's part of a sum: errors stay as they are for one process, and go to every rank otherwise.
  const auto local_part = [&](const auto& work) -> std::optional<std::string> {
    if (!group) {
      work();
      return std::nullopt;
    }
    return failure_of(work);
  };

  std::visit(
      [&](const auto& shape) {
        using HMM = std::decay_t<decltype(shape)>;
        using Stats = typename HMM::Statistics;
        if (fit.supervised && fit.order == 2) {
          if constexpr (std::is_same_v<HMM, CategoricalHMM>) {
            TrigramCounts total{at::zeros({K}, at::kDouble), at::zeros({K + 1, K}, at::kDouble),
                                at::zeros({K + 1, K, K}, at::kDouble), at::zeros({K, V}, at::kDouble)};
            const auto failure = local_part([&] {
              for (const auto& [first, count] : ranges) {
                const SequenceBatch b = data.read(first, count, true);
                total += trigram_counts(b.observations, b.labels, b.lengths, K, V);
                if (group) group->mark_progress();
              }
            });
            sum_over_ranks(tensors_of(total), failure);
            CategoricalHMM m = second_order_hmm(total, fit.em.m_step.smoothing);
            if (!out.vocabulary.empty())
              m.log_emissions =
                  tagger_log_emissions(total.emissions, out.vocabulary, fit.em.m_step.smoothing).repeat({K + 1, 1});
            out.model = m;
            std::vector<std::string> names;
            for (int64_t s = 0; s < (K + 1) * K; ++s) {
              const int64_t a = s / K, b = pair_label(s, K);
              out.state_labels.push_back(b);
              if (!out.state_names.empty())
                names.push_back((a == K ? std::string("<s>") : out.state_names[a]) + " " + out.state_names[b]);
            }
            out.state_names = names;
          } else {
            throw Error("second-order models need categorical observations");
          }
          return;
        }
        if (fit.supervised) {
          Stats total = zero_statistics(shape, opt.device());
          const auto failure = local_part([&] {
            for (const auto& [first, count] : ranges) {
              const SequenceBatch b = data.read(first, count, true);
              total += to_double(labelled_statistics(shape.to(opt), b.observations.to(opt.device()),
                                                     b.labels.to(opt.device()), b.lengths.to(opt.device())));
              if (group) group->mark_progress();
            }
          });
          sum_over_ranks(tensors_of(total), failure);
          HMM m = shape.maximise(total, fit.em.m_step).to(at::TensorOptions().dtype(at::kDouble));
          if constexpr (std::is_same_v<HMM, CategoricalHMM>)
            if (!out.vocabulary.empty())
              m.log_emissions = tagger_log_emissions(total.emissions.cpu(), out.vocabulary, fit.em.m_step.smoothing);
          out.model = m;
          return;
        }
        double best = -std::numeric_limits<double>::infinity();
        for (int r = 0; r < fit.restarts; ++r) {
          HMM m = fit.initial ? std::get<HMM>(fit.initial->model).to(f64)
                              : random_start(shape, data, fit.seed + r, fit.em.m_step.covars_prior).to(f64);
          std::vector<double> history;
          for (int it = 0; it < fit.em.max_iterations; ++it) {
            const auto t0 = Clock::now();
            const HMM work = for_computation(m, opt);
            Stats total = zero_statistics(shape, opt.device());
            double tokens = 0;  // exact below 2^53
            const auto failure = local_part([&] {
              for (std::size_t i = 0; i < ranges.size(); ++i) {
                const auto [first, count] = ranges[i];
                const SequenceBatch b = data.read(first, count);
                // On a GPU the next batch (the first again for the next iteration) is read while this one is
                // computed.
                if (opt.device().is_cuda() && ranges.size() > 1) {
                  const auto& next = ranges[(i + 1) % ranges.size()];
                  data.prefetch(next.first, next.second);
                }
                total +=
                    to_double(expected_statistics(work, b.observations.to(opt.device()), b.lengths.to(opt.device())));
                tokens += static_cast<double>(b.lengths.sum().item<int64_t>());
                if (group) group->mark_progress();
              }
            });
            sum_over_ranks(tensors_of(total), failure, {&total.log_likelihood, &tokens});
            if (on_iteration) on_iteration({r, it, total.log_likelihood, static_cast<int64_t>(tokens), since(t0)});
            // A sequence of probability 0 gives no expected counts (0/0): the next model would be undefined.
            if (std::isnan(total.log_likelihood) || total.log_likelihood == -std::numeric_limits<double>::infinity())
              throw Error(data.path() + ": some sequences have probability 0 under the " +
                          (it == 0 && fit.initial ? std::string("--init model") :
                                                    "model of EM iteration " + std::to_string(it)) +
                          " (an observation no state emits, or no allowed state path): EM cannot go on");
            const bool converged =
                !history.empty() && total.log_likelihood - history.back() < fit.em.tolerance * tokens;
            history.push_back(total.log_likelihood);
            if (converged && fit.em.tolerance > 0) break;
            m = m.maximise(total, fit.em.m_step);
          }
          if (history.back() > best) {
            best = history.back();
            out.model = m.to(at::TensorOptions().dtype(at::kDouble).device(at::kCPU));
            out.log_likelihood_history = history;
          }
        }
      },
      shape_file.model);
  return out;
}

void sample_dataset(const HMMModelFile& model, const std::string& output, int64_t num_sequences, int64_t min_length,
                    int64_t max_length, uint64_t seed, const BatchProgress& progress) {
  if (num_sequences < 1 || min_length < 1 || max_length < min_length)
    throw Error("sample: need --sequences >= 1 and 1 <= --min-length <= --length");
  if (static_cast<double>(num_sequences) * static_cast<double>(max_length) >= 0x1p62)
    throw Error("sample: " + std::to_string(num_sequences) + " sequences of up to " + std::to_string(max_length) +
                " positions are more than a dataset can hold (2^62 positions)");
  check_fits_in_memory(8.0 * static_cast<double>(num_sequences),
                       "the offsets of " + std::to_string(num_sequences) + " sequences");
  std::visit(
      [&](const auto& m) {
        int64_t F = 0;
        if constexpr (std::is_same_v<std::decay_t<decltype(m)>, GaussianHMM>) F = m.num_features();
        HMMDatasetWriter out(output, F, true);
        if (!model.vocabulary.empty()) out.write_strings("vocabulary", model.vocabulary);
        if (!model.state_names.empty()) out.write_strings("label_names", model.state_names);
        // About a million positions per batch; each batch has its own seed, so the output does not depend on memory.
        const int64_t per_batch = std::max<int64_t>(1, (int64_t(1) << 20) / max_length);
        int64_t done = 0, tokens = 0;
        for (int64_t batch = 0; done < num_sequences; ++batch) {
          const int64_t n = std::min(per_batch, num_sequences - done);
          const HMMSample s = sample(m, n, min_length, max_length, seed * 1000003 + batch);
          out.append(s.observations, s.lengths, s.states);
          done += n;
          tokens += s.lengths.sum().item<int64_t>();
          if (progress) progress(done, tokens);
        }
        out.commit();
      },
      model.model);
}

namespace {

// Rows of probabilities as log-probabilities, a row with no mass (a tag with no tokens, no smoothing) uniform.
at::Tensor log_rows_or_uniform(const at::Tensor& probs) {
  return at::where(probs.sum(1, true) > 0, probs, 1.0 / static_cast<double>(probs.size(1))).log();
}

}  // namespace

at::Tensor tagger_log_emissions(const at::Tensor& counts, const std::vector<std::string>& symbols, double smoothing) {
  const int64_t K = counts.size(0), V = counts.size(1);
  if (int64_t(symbols.size()) != V)
    throw Error("tagger emissions: " + std::to_string(symbols.size()) + " symbols for " + std::to_string(V) +
                " columns");
  const at::Tensor C = counts.to(at::kDouble).contiguous();
  if (Vocabulary::from_symbols(symbols).unknown() != Vocabulary::Unknown::signatures) {
    const at::Tensor e = C + smoothing;
    return log_rows_or_uniform(e / e.sum(1, true).clamp_min(1e-300));
  }
  std::vector<uint8_t> is_class(V);
  for (int64_t v = 0; v < V; ++v) is_class[v] = Vocabulary::is_unknown_class(symbols[v]);
  const auto Ca = C.accessor<double, 2>();
  const at::Tensor symbol_total = C.sum(0), tag_total = C.sum(1);
  const auto n_sym = symbol_total.accessor<double, 1>();

  // The rare words (and rare tokens already stored as their class) under each class: tag counts, how many symbols.
  struct Rare {
    std::vector<double> tags;
    int64_t symbols = 0;
    double novel_tokens = 0;  // tokens of the rare symbols that a novel word like them would map to this class
  };
  std::unordered_map<std::string, Rare> rare;
  std::vector<std::pair<int64_t, std::vector<std::string>>> rare_symbols;
  std::vector<double> hapax(K);  // tokens of words seen once (and of class tokens): Good-Turing's novel-word mass
  for (int64_t v = 0; v < V; ++v) {
    if (n_sym[v] <= 0 || (!is_class[v] && n_sym[v] > Vocabulary::kRareCount)) continue;
    rare_symbols.emplace_back(v, is_class[v] ? class_chain(symbols[v]) : signature_classes(symbols[v]));
    for (const auto& c : rare_symbols.back().second) {
      Rare& r = rare[c];
      r.tags.resize(K);
      r.symbols += 1;
      for (int64_t k = 0; k < K; ++k) r.tags[k] += Ca[k][v];
    }
    if (is_class[v] || n_sym[v] == 1)
      for (int64_t k = 0; k < K; ++k) hapax[k] += Ca[k][v];
  }
  // Where novel words land: each rare symbol left out of training would map to the most specific class of its chain
  // that another rare symbol reached.
  for (const auto& [v, chain] : rare_symbols) {
    std::size_t i = chain.size() - 1;
    while (i > 0 && rare.at(chain[i]).symbols < 2) --i;
    rare.at(chain[i]).novel_tokens += n_sym[v];
  }

  const at::Tensor prior_t = tag_total / tag_total.sum().clamp_min(1e-300);
  const double theta = K > 1 ? prior_t.std().item<double>() : 0.0;  // TnT's interpolation weight
  const auto prior = prior_t.accessor<double, 1>();
  // P(class | tag, novel) ∝ P(tag | class) P(class | novel): the tag distribution of the class, TnT's successive
  // abstraction from the shape down the suffixes; P(class | novel) where the left-out rare symbols landed (add-one).
  at::Tensor novel = at::zeros({K, V}, at::kDouble);
  auto N = novel.accessor<double, 2>();
  std::vector<double> p(K);
  for (int64_t v = 0; v < V; ++v) {
    if (!is_class[v]) continue;
    for (int64_t k = 0; k < K; ++k) p[k] = prior[k];  // a class no rare word reached: the priors
    double landed = 0;
    bool first = true;
    for (const auto& c : class_chain(symbols[v])) {
      const auto it = rare.find(c);
      if (it == rare.end()) break;
      const std::vector<double>& n = it->second.tags;
      double total = 0;
      for (double x : n) total += x;
      for (int64_t k = 0; k < K; ++k)
        p[k] = first ? (n[k] + smoothing) / std::max(total + K * smoothing, 1e-300)
                     : (n[k] / std::max(total, 1e-300) + theta * p[k]) / (1 + theta);
      first = false;
      landed = it->second.novel_tokens;
    }
    for (int64_t k = 0; k < K; ++k) N[k][v] = p[k] * (landed + 1);
  }
  // Each tag's row: the words with probability 1 - u and the classes with u, u = its share of words seen once.
  const at::Tensor u = (at::tensor(hapax, at::kDouble) / tag_total.clamp_min(1)).clamp(1e-6, 0.5).unsqueeze(1);
  const at::Tensor word_mask = at::from_blob(is_class.data(), {V}, at::kByte).logical_not();
  const at::Tensor words = at::where(word_mask, C + smoothing, at::zeros_like(C));
  const at::Tensor e =
      (1 - u) * words / words.sum(1, true).clamp_min(1e-300) + u * novel / novel.sum(1, true).clamp_min(1e-300);
  return log_rows_or_uniform(e);
}

namespace {

// Resolved column indices of a CoNLL file, and the label of a row built from them.
struct ConllColumns {
  int word = 0;
  std::vector<int> label;

  ConllColumns(const std::string& path, std::size_t num_columns, int word_column,
               const std::vector<int>& label_columns) {
    const int ncol = static_cast<int>(num_columns);
    const auto resolve = [&](int c, const char* what) {
      const int i = c < 0 ? ncol + c : c;
      if (i < 0 || i >= ncol)
        throw Error(path + ": has " + std::to_string(ncol) + " columns; there is no " + what + " column " +
                    std::to_string(c));
      return i;
    };
    word = resolve(word_column, "word");
    for (int c : label_columns) {
      const int i = resolve(c, "label");
      if (i == word)
        throw Error(path + ": column " + std::to_string(i) + " would be both the word and a label (" +
                    std::to_string(ncol) + " columns; --no-labels for a file without labels)");
      if (std::find(label.begin(), label.end(), i) != label.end())
        throw Error(path + ": label column " + std::to_string(i) + " is named twice");
      label.push_back(i);
    }
  }
  std::string label_of(const std::vector<std::string>& row) const {
    std::string l;
    for (std::size_t i = 0; i < label.size(); ++i) l += (i ? "|" : "") + row[label[i]];
    return l;
  }
};

}  // namespace

ConllVocabulary conll_words_and_labels(const std::string& conll_path, int word_column,
                                       const std::vector<int>& label_columns, const std::string& comment_prefix) {
  ConllReadOptions ro;
  ro.comment_prefix = comment_prefix;
  const ConllCorpus corpus = read_conll(conll_path, ro);
  const ConllColumns cols(conll_path, corpus.num_columns, word_column, label_columns);
  ConllVocabulary v;
  std::unordered_set<std::string> seen;
  for (const auto& s : corpus.sentences)
    for (const auto& row : s.rows) {
      v.words.push_back(row[cols.word]);
      if (cols.label.empty()) continue;
      std::string label = cols.label_of(row);
      if (seen.insert(label).second) v.labels.push_back(std::move(label));
    }
  return v;
}

ConversionSummary convert_conll(const std::string& conll_path, const std::string& output, const Vocabulary& words,
                                int word_column, const std::vector<std::string>* labels,
                                const std::vector<int>& label_columns, const std::string& comment_prefix) {
  check_writable_location(output, /*regular_only=*/true);
  ConllReadOptions ro;
  ro.comment_prefix = comment_prefix;
  const ConllCorpus corpus = read_conll(conll_path, ro);
  const ConllColumns cols(conll_path, corpus.num_columns, word_column, labels ? label_columns : std::vector<int>{});
  if (labels && label_columns.empty()) throw Error("convert_conll: labels given without a label column");
  std::unordered_map<std::string, int64_t> label_id;
  if (labels)
    for (std::size_t i = 0; i < labels->size(); ++i) label_id[(*labels)[i]] = i;

  HMMDatasetWriter out(output, 0, labels != nullptr);
  out.write_strings("vocabulary", words.symbols());
  if (labels) out.write_strings("label_names", *labels);
  ConversionSummary sum;
  constexpr std::size_t kBatch = 4096;  // sentences per write
  for (std::size_t s0 = 0; s0 < corpus.sentences.size(); s0 += kBatch) {
    const std::size_t s1 = std::min(corpus.sentences.size(), s0 + kBatch);
    std::size_t T = 0;
    for (std::size_t s = s0; s < s1; ++s) T = std::max(T, corpus.sentences[s].rows.size());
    const int64_t B = s1 - s0;
    at::Tensor ids = at::zeros({B, int64_t(T)}, at::kLong), tags = at::zeros({B, int64_t(T)}, at::kLong),
               lengths = at::empty({B}, at::kLong);
    auto I = ids.accessor<int64_t, 2>();
    auto L = tags.accessor<int64_t, 2>();
    for (std::size_t s = s0; s < s1; ++s) {
      const ConllSentence& sent = corpus.sentences[s];
      lengths[s - s0] = int64_t(sent.rows.size());
      for (std::size_t t = 0; t < sent.rows.size(); ++t) {
        const std::string& w = sent.rows[t][cols.word];
        const int64_t id = words.id(w);
        if (id < 0)
          throw ParseError(conll_path, sent.first_line + t,
                           "word '" + w + "' is not in the vocabulary (which has no unknown-word classes)");
        sum.unknown_tokens += !words.known(w);
        I[s - s0][t] = id;
        if (labels) {
          const std::string label = cols.label_of(sent.rows[t]);
          const auto it = label_id.find(label);
          if (it == label_id.end())
            throw ParseError(
                conll_path, sent.first_line + t,
                "label '" + label + "' is not one of the " + std::to_string(labels->size()) + " known labels");
          L[s - s0][t] = it->second;
        }
      }
    }
    out.append(ids, lengths, labels ? tags : at::Tensor());
    sum.sentences += B;
    sum.tokens += lengths.sum().item<int64_t>();
  }
  out.commit();
  return sum;
}

}  // namespace trellis
