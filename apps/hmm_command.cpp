// trellis hmm init|sample|fit|infer|convert|eval: option parsing and reporting only; the work is in the library.
#include <ATen/ATen.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <iostream>
#include <optional>
#include <sstream>

#include "cli_util.h"
#include "commands.h"
#include "trellis/io/atomic_file.h"
#include "trellis/io/conll.h"
#include "trellis/distributed/distributed.h"
#include "trellis/error.h"
#include "trellis/hmm/hmm_tasks.h"

namespace po = boost::program_options;

namespace trellis::cli {
namespace {

constexpr const char* kHmmUsage = R"(usage: trellis hmm <command> [options]

commands:
  fit       Baum-Welch EM (random restarts or a given start), or supervised maximum likelihood from labels
  infer     per-sequence log-likelihood, Viterbi paths and optional state posteriors, streamed in batches
  sample    generate a dataset from a model (hidden states stored as labels)
  init      write a random model
  convert   CoNLL column file to the HDF5 dataset layout, with a vocabulary and unknown-word classes
  eval      token accuracy of inferred states against a dataset's labels

Files are HDF5 (layout: docs/hmm-format.md). 'trellis hmm <command> --help' describes each command's options.
)";

// Options every command that computes shares.
struct RunFlags {
  HMMRunOptions run;
  std::string precision, budget;
  void add(po::options_description& desc) {
    desc.add_options()("device", device_value(run.device), "cpu, cuda or cuda:N")(
        "threads", threads_value(run.threads), "CPU threads (0: all)")(
        "precision", po::value(&precision)->default_value("float64"), "float64 or float32")(
        "memory-budget", po::value(&budget)->default_value("1G"),
        "working memory for one batch (e.g. 512M, 4G); larger datasets stream through in batches");
  }
  HMMRunOptions resolve() {
    if (precision != "float64" && precision != "float32")
      throw Error("--precision must be float64 or float32, not '" + precision + "'");
    run.dtype = precision == "float32" ? at::kFloat : at::kDouble;
    run.memory_budget = parse_bytes(budget);
    return run;
  }
};

std::string describe(const HMMModelFile& m) {
  return std::visit(
      [](const auto& h) {
        if constexpr (std::is_same_v<std::decay_t<decltype(h)>, CategoricalHMM>)
          return std::to_string(h.num_states()) + " states, categorical emissions over " +
                 std::to_string(h.num_symbols()) + " symbols";
        else
          return std::to_string(h.num_states()) + " states, diagonal-Gaussian emissions of " +
                 std::to_string(h.num_features()) + " features";
      },
      m.model);
}

// Under torchrun: this rank's share of the data, e.g. "rank 1 of 3: sequences 400-799 (400 of 1200), 5012 of 15000
// tokens (33.4%)".
void print_share(const DistributedContext& dist, const HMMDataset& data, const DatasetShare& share) {
  if (!dist.distributed()) return;
  std::ostringstream line;  // written at once: the ranks share the terminal
  line << dist.describe() << " (" << dist.backend() << "): sequences "
       << (share.count ? std::to_string(share.first) + "-" + std::to_string(share.first + share.count - 1) : "none")
       << " (" << share.count << " of " << data.num_sequences() << "), " << share.tokens << " of " << data.num_tokens()
       << " tokens (" << fixed(100.0 * share.tokens / std::max<int64_t>(data.num_tokens(), 1), 1) << "%)\n";
  std::cerr << line.str();
}

int init(const std::vector<std::string>& args) {
  int64_t K = 0, V = 0, F = 0;
  uint64_t seed = 0;
  std::string output;
  po::options_description desc("options");
  desc.add_options()("help,h", "this message")("states,k", po::value(&K)->required(), "number of hidden states")(
      "symbols,v", po::value(&V), "categorical emissions over this many symbols")(
      "features,f", po::value(&F), "diagonal-Gaussian emissions of this many features")(
      "seed", seed_value(seed), "random seed")("output,o", po::value(&output)->required(),
                                                                 "model file to write");
  po::variables_map vm;
  const std::string usage = "usage: trellis hmm init --states K (--symbols V | --features F) --output MODEL.h5";
  if (int rc = parse("hmm init", args, desc, vm, usage); rc >= 0) return rc;
  if (vm.count("symbols") == vm.count("features")) throw Error("init: give exactly one of --symbols, --features");
  HMMModelFile m;
  if (vm.count("symbols")) m.model = CategoricalHMM::random(K, V, seed);
  else m.model = GaussianHMM::random(K, F, seed);
  save_hmm(output, m);
  std::cerr << "wrote " << output << ": " << describe(m) << "\n";
  return 0;
}

int sample_cmd(const std::vector<std::string>& args) {
  std::string model_path, output;
  int64_t n = 0, length = 0, min_length = 0;
  uint64_t seed = 0;
  po::options_description desc("options");
  desc.add_options()("help,h", "this message")("model,m", po::value(&model_path)->required(), "model file")(
      "output,o", po::value(&output)->required(), "dataset to write")(
      "sequences,n", po::value(&n)->required(), "number of sequences")("length,l", po::value(&length)->required(),
                                                                       "longest sequence length")(
      "min-length", po::value(&min_length)->default_value(0),
      "shortest length (default: --length); lengths are uniform in between")("seed", seed_value(seed),
                                                                             "random seed");
  po::variables_map vm;
  if (int rc = parse("hmm sample", args, desc, vm,
                     "usage: trellis hmm sample --model MODEL.h5 --output DATA.h5 --sequences N --length L");
      rc >= 0)
    return rc;
  check_output_is_not_an_input("--output", output, {{"--model", model_path}});
  const HMMModelFile m = load_hmm(model_path);
  Progress progress("sample", n, "sequences");
  sample_dataset(m, output, n, min_length ? min_length : length, length, seed,
                 [&](int64_t done, int64_t) { progress.update(done); });
  progress.finish();
  std::cerr << "wrote " << output << "\n";
  return 0;
}

int infer(const std::vector<std::string>& args) {
  std::string model_path, data_path, output;
  bool with_posteriors = false;
  int compression = 1;
  RunFlags flags;
  po::options_description desc("options");
  desc.add_options()("help,h", "this message")("model,m", po::value(&model_path)->required(), "model file")(
      "data,d", po::value(&data_path)->required(), "dataset")(
      "output,o", po::value(&output)->required(), "results file (written to a temporary file, then renamed)")(
      "posteriors", po::bool_switch(&with_posteriors), "also write state posteriors [total_T, K] (float32)")(
      "compression", po::value(&compression)->default_value(1),
      "gzip level of the posteriors, 0 (none: fastest, 4·K bytes per token) to 9");
  flags.add(desc);
  po::variables_map vm;
  if (int rc = parse("hmm infer", args, desc, vm,
                     "usage: trellis hmm infer --model MODEL.h5 --data DATA.h5 --output OUT.h5 [options]");
      rc >= 0)
    return rc;
  HMMRunOptions run = flags.resolve();
  if (compression < 0 || compression > 9)
    throw Error("--compression must be a gzip level from 0 (none) to 9, not " + std::to_string(compression));
  run.posteriors_compression = compression;
  check_output_is_not_an_input("--output", output, {{"--model", model_path}, {"--data", data_path}});
  const DistributedContext dist = DistributedContext::from_environment(run.device);
  run.distributed = &dist;
  // Every rank opens the files; one that cannot stops every rank with its message.
  std::optional<HMMModelFile> model;
  std::optional<HMMDataset> opened;
  dist.check_all(failure_of([&] {
    model = load_hmm(model_path);
    opened.emplace(data_path);
  }));
  const HMMModelFile& m = *model;
  HMMDataset& data = *opened;
  const DatasetShare share = dataset_share(data, &dist);
  const int64_t batch = batch_tokens(m, data.num_features(), with_posteriors, run);
  if (dist.rank() == 0)
    std::cerr << "model: " << describe(m) << "; data: " << data.num_sequences() << " sequences, " << data.num_tokens()
              << " tokens; batches of up to " << batch << " positions on " << run.device << "\n";
  print_share(dist, data, share);
  Progress progress(dist.distributed() ? "infer, " + dist.describe() : "infer", share.tokens, "tokens");
  const InferSummary s =
      infer_dataset(m, data, output, with_posteriors, run, [&](int64_t, int64_t tokens) { progress.update(tokens); });
  if (dist.rank() != 0) return 0;  // rank 0 reports the whole dataset
  std::cout << "sequences " << s.sequences << "  tokens " << s.tokens << "  log-likelihood "
            << fixed(s.log_likelihood, 4) << " (" << fixed(s.tokens ? s.log_likelihood / s.tokens : 0.0, 6)
            << " per token)  "
            << fixed(s.seconds, 3) << " s  " << fixed(s.tokens / s.seconds, 0) << " tokens/s  (set-up "
            << fixed(s.setup_seconds, 3) << ", reading " << fixed(s.read_seconds, 3) << ", computing "
            << fixed(s.compute_seconds, 3);
  if (with_posteriors) std::cout << ", of which posteriors " << fixed(s.posteriors_seconds, 3);
  std::cout << ", writing " << fixed(s.write_seconds, 3);
  // One process: the rest of the seconds is finishing the file (the writes still under way, the flush to the disk).
  if (dist.world_size() == 1) std::cout << ", finishing " << fixed(s.assembly_seconds, 3);
  std::cout << ")";
  if (dist.world_size() > 1)
    std::cout << " (of which " << fixed(s.assembly_seconds, 3) << " s receiving and writing the other ranks' results)";
  if (s.batch_peak_bytes > 0)
    std::cout << "  batches' device memory at most " << fixed(s.batch_peak_bytes / 1e9, 2) << " GB (budget "
              << fixed(run.memory_budget / 1e9, 2) << " GB)";
  std::cout << "\n";
  if (s.impossible > 0)
    std::cerr << "warning: " << s.impossible << " of " << s.sequences << " sequences have probability 0 under the model "
              << "(log-likelihood -inf: an observation no state emits, or no allowed state path); their states are "
              << "written as -1 and their posteriors as 0\n";
  std::cerr << "wrote " << output << "\n";
  return 0;
}

int fit(const std::vector<std::string>& args) {
  std::string data_path, output, init_path;
  HMMFitOptions f;
  RunFlags flags;
  po::options_description desc("options");
  desc.add_options()("help,h", "this message")("data,d", po::value(&data_path)->required(), "training dataset")(
      "output,o", po::value(&output)->required(), "model file to write")(
      "states,k", po::value(&f.states)->default_value(0),
      "number of states (EM without --init; supervised: default from the labels)")(
      "symbols,v", po::value(&f.symbols)->default_value(0),
      "vocabulary size V (default: the data's vocabulary, or largest id + 1)")(
      "supervised", po::bool_switch(&f.supervised), "maximum likelihood from the dataset's /labels instead of EM")(
      "order", po::value(&f.order)->default_value(1),
      "supervised: 1 (bigram) or 2 (trigram: states are label pairs, transitions interpolated as in TnT)")(
      "init", po::value(&init_path), "EM from this model instead of random starts")(
      "restarts", po::value(&f.restarts)->default_value(1), "random starts; the highest final log-likelihood wins")(
      "seed", seed_value(f.seed), "random seed of the starts")(
      "max-iterations", po::value(&f.em.max_iterations)->default_value(100), "EM iterations at most")(
      "tolerance", po::value(&f.em.tolerance)->default_value(1e-4),
      "stop when the log-likelihood per token gains less than this (0: run every iteration)")(
      "smoothing", po::value(&f.em.m_step.smoothing)->default_value(0.0),
      "added to every start, transition and emission count (supervised: Laplace smoothing)")(
      "covars-prior", po::value(&f.em.m_step.covars_prior)->default_value(1e-2),
      "Gaussian: variance = (prior + sum g (x-mu)^2) / sum g, as hmmlearn");
  flags.add(desc);
  po::variables_map vm;
  if (int rc = parse(
          "hmm fit", args, desc, vm,
          "usage: trellis hmm fit --data DATA.h5 --output MODEL.h5 (--states K | --init MODEL.h5 | --supervised) [options]");
      rc >= 0)
    return rc;
  HMMRunOptions run = flags.resolve();
  const DistributedContext dist = DistributedContext::from_environment(run.device);
  run.distributed = &dist;
  std::optional<HMMDataset> opened;
  dist.check_all(failure_of([&] {
    if (dist.rank() == 0) {
      check_writable_location(output, /*regular_only=*/true);
      check_output_is_not_an_input("--output", output, {{"--data", data_path}, {"--init", init_path}});
    }
    if (!init_path.empty()) f.initial = load_hmm(init_path);
    opened.emplace(data_path);
  }));
  HMMDataset& data = *opened;
  if (dist.rank() == 0)
    std::cerr << "data: " << data.num_sequences() << " sequences, " << data.num_tokens() << " tokens\n";
  print_share(dist, data, dataset_share(data, &dist));
  const HMMModelFile m = fit_dataset(data, f, run, [&](const EMIteration& it) {
    if (dist.rank() != 0) return;  // every rank holds the same numbers
    std::cerr << (f.restarts > 1 ? "restart " + std::to_string(it.restart) + "  " : "") << "iter " << it.iteration
              << "  log-likelihood " << fixed(it.log_likelihood, 4) << "  per token "
              << fixed(it.log_likelihood / it.tokens, 6) << "  " << fixed(it.seconds, 2) << " s\n";
  });
  dist.check_all(failure_of([&] {
    if (dist.rank() == 0) save_hmm(output, m);
  }));
  if (dist.rank() != 0) return 0;
  std::cerr << "wrote " << output << ": " << describe(m);
  if (!m.log_likelihood_history.empty())
    std::cerr << "; " << m.log_likelihood_history.size() << " EM iterations, final log-likelihood "
              << fixed(m.log_likelihood_history.back(), 4);
  std::cerr << "\n";
  return 0;
}

int convert(const std::vector<std::string>& args) {
  std::string input, output, from, unknown, comments, label_column;
  int word_column = 0;
  int64_t min_count = 1;
  bool no_labels = false, add_labels = false;
  po::options_description desc("options");
  desc.add_options()("help,h", "this message")("input,i", po::value(&input)->required(), "CoNLL column file")(
      "output,o", po::value(&output)->required(), "dataset to write")(
      "word-column", po::value(&word_column)->default_value(0), "column of the observed word (negative: from the end)")(
      "label-column", po::value(&label_column)->default_value("-1"),
      "column of the label (negative: from the end), or several joined by '|' into fine labels, e.g. 1,2 for UPOS|XPOS")(
      "no-labels", po::bool_switch(&no_labels), "the file has no label column to store")(
      "vocabulary-from", po::value(&from),
      "reuse the vocabulary and label names of this HDF5 file (the training set's dataset or model)")(
      "add-labels", po::bool_switch(&add_labels),
      "with --vocabulary-from: append labels the file has not (evaluation data; no model predicts them) instead of "
      "stopping at the first")("min-count", po::value(&min_count)->default_value(2),
                               "words seen fewer times become unknown-word classes (new vocabularies only)")(
      "unknown", po::value(&unknown)->default_value("signatures"),
      "unknown words: signatures (classes by shape and suffix), single (one <unk>) or error")(
      "comment-prefix", po::value(&comments)->default_value(""),
      "skip lines starting with this (e.g. '#' for CoNLL-U)");
  po::variables_map vm;
  if (int rc =
          parse("hmm convert", args, desc, vm, "usage: trellis hmm convert --input FILE --output DATA.h5 [options]");
      rc >= 0)
    return rc;
  if (min_count < 1) throw Error("--min-count must be >= 1, not " + std::to_string(min_count));
  if (no_labels && !vm["label-column"].defaulted()) throw Error("--no-labels and --label-column cannot be combined");
  if (add_labels && from.empty()) throw Error("--add-labels extends the labels of --vocabulary-from: give that file");
  std::vector<int> label_columns;
  if (!no_labels) label_columns = parse_int_list(label_column, "--label-column");
  check_writable_location(output, /*regular_only=*/true);
  check_output_is_not_an_input("--output", output, {{"--input", input}, {"--vocabulary-from", from}});
  Vocabulary words;
  std::vector<std::string> labels;
  if (!from.empty()) {
    words = Vocabulary::from_symbols(read_string_dataset(from, "vocabulary"));
    if (words.size() == 0) throw Error(from + ": has no '/vocabulary' dataset to reuse");
    labels = read_string_dataset(from, "label_names");
    if (labels.empty()) labels = read_string_dataset(from, "state_names");
    if (labels.empty() && !no_labels) throw Error(from + ": has no '/label_names' (or '/state_names') to reuse");
    if (add_labels && !no_labels) {
      const std::size_t reused = labels.size();
      for (const auto& l : conll_words_and_labels(input, word_column, label_columns, comments).labels)
        if (std::find(labels.begin(), labels.end(), l) == labels.end()) labels.push_back(l);
      if (labels.size() > reused)
        std::cerr << "added " << labels.size() - reused << " labels not in " << from << " (never predicted)\n";
    }
  } else {
    const Vocabulary::Unknown scheme = unknown == "signatures" ? Vocabulary::Unknown::signatures
                                       : unknown == "single"   ? Vocabulary::Unknown::single
                                       : unknown == "error"
                                           ? Vocabulary::Unknown::error
                                           : throw Error("--unknown must be signatures, single or error");
    ConllVocabulary v = conll_words_and_labels(input, word_column, label_columns, comments);
    words = Vocabulary::build(v.words, min_count, scheme);
    labels = std::move(v.labels);
  }
  const ConversionSummary s =
      convert_conll(input, output, words, word_column, no_labels ? nullptr : &labels, label_columns, comments);
  std::cerr << "wrote " << output << ": " << s.sentences << " sequences, " << s.tokens << " tokens ("
            << s.unknown_tokens
            << " not in the vocabulary: " << fixed(100.0 * s.unknown_tokens / std::max<int64_t>(s.tokens, 1), 2)
            << "%), vocabulary " << words.size() << " symbols";
  if (!no_labels) std::cerr << ", " << labels.size() << " labels";
  std::cerr << "\n";
  return 0;
}

int eval(const std::vector<std::string>& args) {
  std::string data_path, predictions;
  bool coarse = false;
  po::options_description desc("options");
  desc.add_options()("help,h", "this message")("data,d", po::value(&data_path)->required(), "dataset with /labels")(
      "predictions,p", po::value(&predictions)->required(), "output of trellis hmm infer on that dataset")(
      "coarse", po::bool_switch(&coarse),
      "score fine labels (several columns joined by '|', e.g. UPOS|XPOS) on their first part only");
  po::variables_map vm;
  if (int rc = parse("hmm eval", args, desc, vm, "usage: trellis hmm eval --data DATA.h5 --predictions OUT.h5");
      rc >= 0)
    return rc;
  HMMDataset data(data_path);
  const LabelAccuracy a = score_predictions(data, predictions, coarse);
  std::cout << "tokens " << a.tokens << "  correct " << a.correct << "  accuracy " << fixed(a.accuracy(), 2) << "%\n";
  return 0;
}

}  // namespace

int hmm_main(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    (args.empty() ? std::cerr : std::cout) << kHmmUsage;  // without a command: a usage error
    return args.empty() ? 2 : 0;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "fit") return fit(rest);
  if (args[0] == "infer") return infer(rest);
  if (args[0] == "sample") return sample_cmd(rest);
  if (args[0] == "init") return init(rest);
  if (args[0] == "convert") return convert(rest);
  if (args[0] == "eval") return eval(rest);
  std::cerr << "trellis hmm: unknown command '" << args[0] << "'\n" << kHmmUsage;
  return 2;
}

}  // namespace trellis::cli
