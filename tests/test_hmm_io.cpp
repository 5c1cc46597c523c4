#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>

#include "test_util.h"
#include "trellis/hmm/hmm_tasks.h"

using namespace trellis;
using namespace trellis::testing;

namespace {

std::string scratch(const std::string& name) { return "/tmp/trellis_test_" + std::to_string(::getpid()) + "_" + name; }

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// While it lives, this process's writes beyond `bytes` of a file fail with EFBIG: a full disk, as writers see it.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit limit = saved_;
    limit.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &limit);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    std::signal(SIGXFSZ, handler_);
  }

 private:
  rlimit saved_{};
  void (*handler_)(int);
};

void expect_error_containing(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(HMMFiles, ModelsRoundTripThroughHdf5) {
  const std::string path = scratch("model.h5");
  HMMModelFile c{CategoricalHMM::random(3, 7, 1), {"a", "b", "c"}, {}, {-3.5, -2.25}};
  save_hmm(path, c);
  const HMMModelFile c2 = load_hmm(path);
  const auto& m = std::get<CategoricalHMM>(c2.model);
  const auto& m0 = std::get<CategoricalHMM>(c.model);
  expect_close(m.log_emissions, m0.log_emissions);
  expect_close(m.log_transitions, m0.log_transitions);
  EXPECT_EQ(c2.state_names, c.state_names);
  EXPECT_EQ(c2.log_likelihood_history, c.log_likelihood_history);
  save_hmm(path, {GaussianHMM::random(2, 4, 2)});
  const auto g = std::get<GaussianHMM>(load_hmm(path).model);
  expect_close(g.variances, GaussianHMM::random(2, 4, 2).variances);
  std::remove(path.c_str());
}

TEST(HMMFiles, DatasetsRoundTripAndBatchesRespectTheBudget) {
  const std::string path = scratch("data.h5");
  const HMMSample s = sample(CategoricalHMM::random(3, 9, 3), 40, 1, 25, 4);
  {
    HMMDatasetWriter w(path, 0, true);
    w.append(s.observations.slice(0, 0, 15), s.lengths.slice(0, 0, 15), s.states.slice(0, 0, 15));
    w.append(s.observations.slice(0, 15), s.lengths.slice(0, 15), s.states.slice(0, 15));
    w.write_strings("vocabulary", {"a", "b", "c", "d", "e", "f", "g", "h", "ü"});
    w.commit();
  }
  HMMDataset d(path);
  EXPECT_TRUE(d.categorical());
  EXPECT_EQ(d.num_sequences(), 40);
  EXPECT_EQ(d.num_tokens(), s.lengths.sum().item<int64_t>());
  EXPECT_EQ(d.vocabulary().back(), "ü");
  int64_t next = 0;
  for (const auto& [first, count] : d.batches(60)) {
    EXPECT_EQ(first, next);
    next += count;
    const SequenceBatch b = d.read(first, count, true);
    EXPECT_TRUE(count == 1 || b.observations.numel() <= 60);
    EXPECT_TRUE(at::equal(b.lengths, s.lengths.slice(0, first, first + count)));
    for (int64_t i = 0; i < count; ++i) {
      const int64_t L = b.lengths[i].item<int64_t>();
      EXPECT_TRUE(at::equal(b.observations[i].slice(0, 0, L), s.observations[first + i].slice(0, 0, L)));
      EXPECT_TRUE(at::equal(b.labels[i].slice(0, 0, L), s.states[first + i].slice(0, 0, L)));
    }
  }
  EXPECT_EQ(next, 40);
  std::remove(path.c_str());
}

TEST(HMMFiles, BatchesReadAheadEqualPlainReads) {
  // HMMDataset::prefetch reads a range on a thread of its own: read() of that range returns it, a read() of another
  // range drops it and reads its own, and a bad value in the range read ahead is the same Error at its read().
  const std::string path = scratch("ahead.h5");
  const HMMSample s = sample(CategoricalHMM::random(3, 9, 5), 40, 1, 25, 6);
  {
    HMMDatasetWriter w(path, 0, true);
    w.append(s.observations, s.lengths, s.states);
    w.commit();
  }
  HMMDataset ahead(path), plain(path);
  const auto same = [](const SequenceBatch& a, const SequenceBatch& b) {
    return a.first == b.first && at::equal(a.lengths, b.lengths) && at::equal(a.observations, b.observations) &&
           (a.labels.defined() == b.labels.defined()) && (!a.labels.defined() || at::equal(a.labels, b.labels));
  };
  const auto batches = plain.batches(60);
  ASSERT_GT(batches.size(), 2u);
  for (std::size_t i = 0; i < batches.size(); ++i) {
    const auto [first, count] = batches[i];
    const SequenceBatch b = ahead.read(first, count, i % 2 == 1);
    if (i + 1 < batches.size()) ahead.prefetch(batches[i + 1].first, batches[i + 1].second, i % 2 == 0);
    EXPECT_TRUE(same(b, plain.read(first, count, i % 2 == 1))) << "batch " << i;
  }
  ahead.prefetch(0, 5);
  EXPECT_TRUE(same(ahead.read(5, 7), plain.read(5, 7)));
  EXPECT_TRUE(same(ahead.read(0, 5), plain.read(0, 5)));
  ahead.prefetch(0, 5, true);
  EXPECT_TRUE(same(ahead.read(0, 5), plain.read(0, 5)));  // the same range without labels
  ahead.expect_symbols(2);
  plain.expect_symbols(2);
  std::string expected;
  try {
    plain.read(0, 40);
  } catch (const Error& e) {
    expected = e.what();
  }
  ASSERT_NE(expected.find("observations"), std::string::npos) << expected;
  ahead.prefetch(0, 40);
  try {
    ahead.read(0, 40);
    ADD_FAILURE() << "no error from the range read ahead";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), expected);
  }
  std::remove(path.c_str());
}

TEST(HMMFiles, PosteriorsWrittenInBatchesReadBackInDatasetOrder) {
  // infer --posteriors over several batches: every row of the file, read from an offset inside a batch, is the
  // posterior of that sequence and position as posteriors() gives it for the whole dataset at once.
  const std::string data = scratch("post_data.h5"), out = scratch("post_out.h5");
  const CategoricalHMM m = CategoricalHMM::random(5, 12, 60);
  sample_dataset(HMMModelFile{m}, data, 30, 1, 20, 61);
  HMMDataset d(data);
  HMMRunOptions o;
  o.memory_budget = 20000;  // several batches
  ASSERT_LT(batch_tokens(HMMModelFile{m}, 0, true, o), d.num_tokens() / 2);
  infer_dataset(HMMModelFile{m}, d, out, /*with_posteriors=*/true, o);
  const SequenceBatch all = d.read(0, d.num_sequences());
  const at::Tensor expected = posteriors(m, all.observations, all.lengths);
  const auto& offsets = d.offsets();
  const int64_t first = offsets[7] + 2, last = offsets[23] + 1;
  const at::Tensor rows = read_posteriors(out, first, last - first);
  ASSERT_EQ(rows.size(0), last - first);
  for (int64_t b = 7; b <= 23; ++b)
    for (int64_t t = 0; t < offsets[b + 1] - offsets[b]; ++t) {
      const int64_t r = offsets[b] + t - first;
      if (r < 0 || r >= rows.size(0)) continue;
      expect_close(rows[r].to(at::kDouble), expected[b][t], 1e-6, 1e-7);
    }
  expect_error_containing([&] { read_posteriors(out, offsets.back() - 1, 2); }, "rows");
  expect_error_containing([&] { read_posteriors(out, 1, std::numeric_limits<int64_t>::max()); }, "rows");
  for (const auto& p : {data, out}) std::remove(p.c_str());
}

TEST(HMMFiles, PosteriorsReadBackAsWrittenAtEveryCompressionLevel) {
  // Compressed posteriors are packed in whole chunks of the file's (873 rows of 300 states here): batches whose rows
  // end inside a chunk, fill one up, span several, and a last chunk that only commit() writes.
  const int64_t K = 300;
  const std::vector<int64_t> lengths = {1, 500, 373, 2000, 37, 1, 1746, 400};
  std::vector<int64_t> offsets = {0};
  for (int64_t n : lengths) offsets.push_back(offsets.back() + n);
  std::vector<at::Tensor> batches;  // one sequence per batch, posteriors [1, T, K] of random values
  for (int64_t n : lengths) batches.push_back(at::rand({1, n, K}, at::kFloat));
  const at::Tensor rows = at::cat(batches, 1).squeeze(0);
  for (int level : {0, 1, 9}) {
    SCOPED_TRACE("compression " + std::to_string(level));
    const std::string path = scratch("post_levels.h5");
    HMMInferenceWriter w(path, offsets, K, /*with_posteriors=*/true, {}, level);
    for (std::size_t b = 0; b < lengths.size(); ++b)
      w.append(at::zeros({1}, at::kDouble), at::zeros({1}, at::kDouble), at::zeros({1, lengths[b]}, at::kLong),
               at::tensor({lengths[b]}, at::kLong), batches[b]);
    w.commit();
    EXPECT_TRUE(at::equal(read_posteriors(path, 0, offsets.back()), rows));
    EXPECT_TRUE(at::equal(read_posteriors(path, 872, 3), rows.narrow(0, 872, 3)));  // across a chunk's end
    std::remove(path.c_str());
  }
}

TEST(HMMFiles, AnUncommittedWriterLeavesNothing) {
  const std::string path = scratch("never.h5");
  { HMMDatasetWriter w(path, 2, false); }
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
}

TEST(HMMFiles, AFullDiskIsAnErrorNamingTheFileAndTheOldFileStays) {
  // HDF5 reports some failed writes only when the file is flushed or closed: limits below, within and near the end
  // of what each writer writes.
  const std::string path = scratch("full.h5"), temporary = path + ".tmp." + std::to_string(::getpid());
  save_hmm(path, {CategoricalHMM::random(2, 3, 1)});
  const std::string before = contents(path);
  const HMMModelFile big{CategoricalHMM::random(60, 600, 2)};
  for (rlim_t limit : {1 << 10, 1 << 13, 1 << 16, 1 << 18}) {
    FileSizeLimit full(limit);
    expect_error_containing([&] { save_hmm(path, big); }, "cannot write '" + path + "': File too large");
  }
  EXPECT_EQ(contents(path), before);
  EXPECT_FALSE(exists(temporary));

  const HMMSample s = sample(CategoricalHMM::random(3, 9, 3), 2000, 50, 50, 4);
  for (rlim_t limit : {1 << 12, 1 << 20}) {
    FileSizeLimit full(limit);
    expect_error_containing(
        [&] {
          HMMDatasetWriter w(path, 0, true);
          w.append(s.observations, s.lengths, s.states);
          w.commit();
        },
        "File too large");
    expect_error_containing(
        [&] {
          HMMInferenceWriter w(path, std::vector<int64_t>(2001, 0), 3, true);
          const ViterbiResult v = viterbi(CategoricalHMM::random(3, 9, 3), s.observations, s.lengths);
          w.append(v.score, v.score, v.path, s.lengths, at::rand({2000, 50, 3}, at::kDouble));
          w.commit();
        },
        "File too large");
  }
  {  // left uncommitted on a full disk: the destructor closes the file quietly and removes it
    auto w = std::make_unique<HMMDatasetWriter>(path, 0, false);
    FileSizeLimit full(1 << 12);
    try {
      w->append(s.observations, s.lengths);  // HDF5 may keep this in its cache: no write fails yet
    } catch (const Error&) {
    }
    w.reset();
  }
  EXPECT_EQ(contents(path), before);
  EXPECT_FALSE(exists(temporary));
  std::remove(path.c_str());
}

TEST(HMMFiles, FitOptionsOutOfRangeAreErrorsBeforeAnyWork) {
  const std::string path = scratch("fit_data.h5");
  const HMMSample s = sample(CategoricalHMM::random(3, 5, 1), 20, 5, 10, 2);
  {
    HMMDatasetWriter w(path, 0, true);
    w.append(s.observations, s.lengths, s.states);
    w.commit();
  }
  HMMDataset data(path);
  const auto fit_with = [&](const std::function<void(HMMFitOptions&)>& change, const std::string& needle) {
    HMMFitOptions f;
    f.states = 3;
    change(f);
    expect_error_containing([&] { fit_dataset(data, f, {}); }, needle);
  };
  fit_with([](HMMFitOptions& f) { f.em.max_iterations = 0; }, "--max-iterations must be >= 1, not 0");
  fit_with([](HMMFitOptions& f) { f.em.max_iterations = -1; }, "--max-iterations must be >= 1, not -1");
  fit_with([](HMMFitOptions& f) { f.restarts = 0; }, "--restarts must be >= 1");
  fit_with([](HMMFitOptions& f) { f.em.tolerance = -1; }, "--tolerance must be a finite number >= 0");
  fit_with([](HMMFitOptions& f) { f.em.m_step.covars_prior = std::nan(""); },
           "--covars-prior must be a finite number > 0");
  fit_with([](HMMFitOptions& f) { f.states = -1; }, "--states must be >= 1, not -1");
  fit_with([](HMMFitOptions& f) { f.states = int64_t(1) << 40; }, "more than this machine's");
  fit_with(
      [](HMMFitOptions& f) {
        f.supervised = true;
        f.em.m_step.smoothing = -1;
      },
      "--smoothing must be a finite number >= 0, not -1");
  HMMRunOptions negative_threads;
  negative_threads.threads = -1;
  HMMFitOptions f;
  f.states = 3;
  expect_error_containing([&] { fit_dataset(data, f, negative_threads); }, "--threads must be >= 0");
  std::remove(path.c_str());
}

TEST(Vocabulary, RareWordsTrainSuffixClassesThatUnknownWordsBackOffTo) {
  using Strings = std::vector<std::string>;
  EXPECT_EQ(signature_classes("Running"), (Strings{"<unk-Cap>", "<unk-Cap-~g>", "<unk-Cap-~ng>", "<unk-Cap-~ing>",
                                                   "<unk-Cap-~ning>", "<unk-Cap-~nning>", "<unk-Cap-~unning>"}));
  EXPECT_EQ(signature_classes("1,000"), Strings{"<unk-num>"});
  EXPECT_EQ(signature_classes("e-mails")[2], "<unk-lc-dash-~ls>");
  EXPECT_EQ(signature_classes("abcdefghijklmnop").size(), 11u);  // shape + suffixes of at most 10 letters
  EXPECT_EQ(class_chain("<unk-lc-~ng>"), (Strings{"<unk-lc>", "<unk-lc-~g>", "<unk-lc-~ng>"}));
  EXPECT_EQ(class_chain("<unk-num>"), Strings{"<unk-num>"});

  const Vocabulary v =
      Vocabulary::build({"the", "the", "Running", "cats", "cats", "42"}, 2, Vocabulary::Unknown::signatures);
  const auto symbol = [&](const std::string& w) { return v.symbols().at(v.id(w)); };
  EXPECT_TRUE(v.known("the"));
  EXPECT_TRUE(v.known("cats"));  // seen twice: its own id, and rare enough to teach its classes
  EXPECT_FALSE(v.known("Running"));
  EXPECT_EQ(symbol("Running"), "<unk-Cap-~unning>");
  EXPECT_EQ(symbol("Jumping"), "<unk-Cap-~ing>");  // the most specific class training saw
  EXPECT_EQ(symbol("Walked"), "<unk-Cap>");
  EXPECT_EQ(symbol("dogs"), "<unk-lc-~s>");
  EXPECT_EQ(v.id("7"), v.id("42"));
  EXPECT_EQ(symbol("zig-zag"), "<unk-lc>");  // a shape never seen: the first class (rare "the" taught it)
  const Vocabulary again = Vocabulary::from_symbols(v.symbols());
  EXPECT_EQ(again.unknown(), Vocabulary::Unknown::signatures);
  EXPECT_EQ(again.id("Jumping"), v.id("Jumping"));
  const Vocabulary strict = Vocabulary::build({"a", "b"}, 1, Vocabulary::Unknown::error);
  EXPECT_EQ(strict.id("c"), -1);
  EXPECT_EQ(Vocabulary::build({"a"}, 2, Vocabulary::Unknown::single).id("zzz"), 0);
}

TEST(Vocabulary, TaggerEmissionsGiveUnknownWordsTheTagsOfRareWordsLikeThem) {
  // Tags 0 (verb) and 1 (noun). Rare words: -ing verbs, -ion nouns; "the" and "runs" are frequent.
  std::vector<std::string> tokens, tags;
  const auto add = [&](const std::string& w, int n, const std::string& t) {
    for (int i = 0; i < n; ++i) tokens.push_back(w), tags.push_back(t);
  };
  add("the", 40, "N"), add("runs", 30, "V"), add("walking", 1, "V"), add("talking", 2, "V"), add("singing", 1, "V");
  add("nation", 1, "N"), add("motion", 3, "N"), add("king", 1, "N");
  const Vocabulary v = Vocabulary::build(tokens, 2, Vocabulary::Unknown::signatures);
  at::Tensor counts = at::zeros({2, v.size()}, at::kDouble);
  for (std::size_t i = 0; i < tokens.size(); ++i) counts[tags[i] == "V" ? 0 : 1][v.id(tokens[i])] += 1;
  const at::Tensor e = tagger_log_emissions(counts, v.symbols(), 0.01);
  expect_close(e.exp().sum(1), at::ones({2}, at::kDouble), 1e-12, 1e-12);  // rows are distributions
  EXPECT_FALSE(at::isnan(e).any().item<bool>());
  const auto score = [&](const std::string& w) { return e.select(1, v.id(w)); };
  EXPECT_GT(score("jumping")[0].item<double>(), score("jumping")[1].item<double>());  // like walking, singing
  EXPECT_GT(score("station")[1].item<double>(), score("station")[0].item<double>());  // like nation, motion
  EXPECT_GT(score("talking")[0].item<double>(), score("talking")[1].item<double>());  // seen twice: a word
  // Without classes: plain additive smoothing.
  const std::vector<std::string> plain{"a", "b"};
  const at::Tensor c = at::tensor({3.0, 1.0, 0.0, 2.0}, at::kDouble).view({2, 2});
  expect_close(tagger_log_emissions(c, plain, 1.0).exp(),
               at::tensor({4.0 / 6, 2.0 / 6, 0.25, 0.75}, at::kDouble).view({2, 2}), 1e-12, 1e-12);
}

TEST(HMMCuda, GaussianAndLargeKMatchCpu) {
  TRELLIS_REQUIRE_CUDA();
  const at::Device cuda(at::kCUDA);
  const GaussianHMM g = GaussianHMM::random(6, 5, 30);
  const HMMSample s = sample(g, 16, 1, 40, 31);
  const auto gc = g.to(at::TensorOptions().device(cuda));
  expect_close(log_likelihood(gc, s.observations.to(cuda), s.lengths).cpu(),
               log_likelihood(g, s.observations, s.lengths), 1e-9, 1e-9);
  expect_close(posteriors(gc, s.observations.to(cuda), s.lengths).cpu(), posteriors(g, s.observations, s.lengths), 1e-9,
               1e-9);
  for (int64_t K : {64, 300}) {
    const CategoricalHMM m = CategoricalHMM::random(K, 50, 32);
    const HMMSample c = sample(m, 8, 1, 30, 33);
    for (const auto dtype : {at::kDouble, at::kFloat}) {
      const auto mc = m.to(at::TensorOptions().device(cuda).dtype(dtype));
      const double tol = dtype == at::kDouble ? 1e-9 : 1e-3;
      expect_close(log_likelihood(mc, c.observations.to(cuda), c.lengths).cpu().to(at::kDouble),
                   log_likelihood(m, c.observations, c.lengths), tol, tol);
      const ViterbiResult a = viterbi(mc, c.observations.to(cuda), c.lengths),
                          b = viterbi(m, c.observations, c.lengths);
      expect_close(a.score.cpu().to(at::kDouble), b.score, tol, tol);
      if (dtype == at::kDouble) EXPECT_TRUE(at::equal(a.path.cpu(), b.path));
    }
  }
}

TEST(HMMCuda, BatchesStayWithinTheMemoryBudget) {
  TRELLIS_REQUIRE_CUDA();
  // The streamed route's batches (256 states) hold at most memory_budget bytes of device tensors beyond the model's
  // (the transitions' per-batch copies aside: a few K² values), and use a fair share of it: categorical and Gaussian
  // models, with and without posteriors, float32 and float64.
  const int64_t K = 256;
  const std::string data = scratch("budget.h5"), out = scratch("budget_out.h5");
  for (const bool gaussian : {false, true}) {
    const HMMModelFile model =
        gaussian ? HMMModelFile{GaussianHMM::random(K, 4, 50)} : HMMModelFile{CategoricalHMM::random(K, 100, 50)};
    sample_dataset(model, data, 400, 20, 120, 51);
    HMMDataset d(data);
    for (const bool posteriors : {false, true})
      for (const auto dtype : {at::kFloat, at::kDouble}) {
        SCOPED_TRACE(c10::str(gaussian ? "Gaussian " : "categorical ", posteriors ? "posteriors " : "", dtype));
        HMMRunOptions o;
        o.device = c10::kCUDA;
        o.dtype = dtype;
        o.memory_budget = int64_t(24) << 20;
        const InferSummary s = infer_dataset(model, d, out, posteriors, o);
        const int64_t transition_copies = 4 * K * K * int64_t(at::elementSize(dtype));
        EXPECT_LE(s.batch_peak_bytes, o.memory_budget + transition_copies);
        EXPECT_GE(s.batch_peak_bytes, o.memory_budget / 4);
      }
  }
  for (const auto& p : {data, out}) std::remove(p.c_str());
}

TEST(HMMCuda, StreamedInferenceAndEmMatchCpu) {
  TRELLIS_REQUIRE_CUDA();
  const std::string data = scratch("cuda_data.h5"), a = scratch("cpu_out.h5"), b = scratch("cuda_out.h5");
  const HMMModelFile model{CategoricalHMM::random(8, 20, 40)};
  sample_dataset(model, data, 300, 1, 50, 41);
  HMMDataset d(data);
  HMMRunOptions cpu, gpu;
  cpu.memory_budget = gpu.memory_budget = 200000;  // several batches
  gpu.device = c10::kCUDA;
  const InferSummary x = infer_dataset(model, d, a, true, cpu), y = infer_dataset(model, d, b, true, gpu);
  EXPECT_NEAR(x.log_likelihood, y.log_likelihood, 1e-8 * std::abs(x.log_likelihood));
  const LabelAccuracy p = score_predictions(d, a), q = score_predictions(d, b);
  EXPECT_EQ(p.correct, q.correct);
  HMMFitOptions fit;
  fit.initial = HMMModelFile{CategoricalHMM::random(8, 20, 42)};
  fit.em.max_iterations = 5;
  fit.em.tolerance = 0;
  const HMMModelFile e = fit_dataset(d, fit, cpu), f = fit_dataset(d, fit, gpu);
  ASSERT_EQ(e.log_likelihood_history.size(), 5u);
  for (std::size_t i = 0; i < 5; ++i)
    EXPECT_NEAR(e.log_likelihood_history[i], f.log_likelihood_history[i], 1e-8 * std::abs(e.log_likelihood_history[i]));
  for (const auto& p : {data, a, b}) std::remove(p.c_str());
}

TEST(HMMCuda, PosteriorsOnTheDeviceAreWrittenSliceBySliceAsFromTheHost) {
  TRELLIS_REQUIRE_CUDA();
  // Posteriors computed on a GPU cross to the host in slices of 64 MB through two pinned buffers, the next slice's
  // copy beside this one's write: two batches of 2048 states, the first of three slices, give the file a host tensor
  // gives.
  const int64_t K = 2048;
  const std::vector<int64_t> first_lengths{7000, 6500, 5000}, second_lengths{3000, 100};
  std::vector<int64_t> offsets{0};
  for (const auto* ls : {&first_lengths, &second_lengths})
    for (int64_t l : *ls) offsets.push_back(offsets.back() + l);
  const std::string out = scratch("device_posteriors.h5");
  HMMInferenceWriter w(out, offsets, K, /*with_posteriors=*/true);
  at::Tensor expected = at::empty({offsets.back(), K}, at::kFloat);
  int64_t row = 0;
  for (const auto* ls : {&first_lengths, &second_lengths}) {
    const int64_t B = static_cast<int64_t>(ls->size()), T = (*ls)[0];
    const at::Tensor lengths = at::tensor(*ls, at::kLong);
    const at::Tensor nodes = at::rand({B, T, K}, at::TensorOptions().device(at::kCUDA)) +
                             at::arange(B * T, at::TensorOptions().device(at::kCUDA)).view({B, T, 1});
    const at::Tensor host = nodes.cpu();
    for (int64_t b = 0; b < B; ++b) {
      expected.narrow(0, row, (*ls)[b]).copy_(host[b].narrow(0, 0, (*ls)[b]));
      row += (*ls)[b];
    }
    w.append(at::zeros({B}, at::kDouble), at::zeros({B}, at::kDouble), at::zeros({B, T}, at::kLong), lengths, nodes);
  }
  w.commit();
  EXPECT_TRUE(at::equal(read_posteriors(out, 0, offsets.back()), expected));
  std::remove(out.c_str());
}
