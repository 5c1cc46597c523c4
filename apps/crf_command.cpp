// trellis crf train|tag|eval|dump: option parsing and output formatting only; the work is in the library.
#include <ATen/ATen.h>

#include <boost/program_options.hpp>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>

#include "cli_util.h"
#include "crf_neural.h"
#include "commands.h"
#include "trellis/io/atomic_file.h"
#include "trellis/io/chunk_eval.h"
#include "trellis/distributed/distributed.h"
#include "trellis/io/conll.h"
#include "trellis/train/crf_train.h"
#include "trellis/error.h"

namespace po = boost::program_options;

namespace trellis::cli {
namespace {

constexpr const char* kCrfUsage = R"(usage: trellis crf <command> [options]

commands:
  train   train a tagger on CoNLL column files (L-BFGS, L2)
  tag     label sentences with a trained model
  eval    token accuracy and conlleval chunk precision/recall/F1
  dump    summarise a model: labels, strongest transitions and features

'trellis crf <command> --help' describes each command's options.
)";

int train(const std::vector<std::string>& args) {
  CrfTrainOptions o;
  std::string train_path, dev_path, model_path, template_path, input_columns;
  int label_column = -1;
  int64_t batch_size = 32;  // signed: Boost would read -1 into an unsigned option as its largest value
  std::string feature_pairs, c2_text, algorithm;
  po::options_description desc("options");
  desc.add_options()("help,h", "this message")("train", po::value(&train_path)->required(),
                                               "training data: CoNLL columns, a blank line between sentences (- for stdin)")(
      "dev", po::value(&dev_path), "development data, scored after every iteration (- for stdin)")(
      "model,m", po::value(&model_path)->required(), "where to write the model")(
      "label-column", po::value(&label_column)->default_value(-1), "label column (negative counts from the end)")(
      "input-columns", po::value(&input_columns),
      "the columns the features read, e.g. 0,1 (default: those before the label column; the others are ignored)")(
      "template,t", po::value(&template_path), "CRF++ feature template (default: the built-in feature set)")(
      "min-freq", po::value(&o.min_feature_count)->default_value(1), "drop features seen fewer times in training")(
      "feature-pairs", po::value(&feature_pairs)->default_value("all"),
      "which (feature, label) pairs get a weight: all, or seen (only those in the training data, as CRFsuite: "
      "far fewer weights and less memory)")(
      "c2", po::value(&c2_text)->default_value("1"),
      "L2 coefficient: objective = -log-likelihood + c2*|w|^2; auto: the best on --dev of 0.01, 0.1, 1 and 10, one "
      "training each (sparse data with many rare features, e.g. named entities, wants a small c2; small or noisy "
      "data a large one)")("c1", po::value(&o.c1)->default_value(0.0),
                           "L1 coefficient: adds c1*|w|_1 and trains with OWL-QN (lbfgs), giving a sparse model")(
      "algorithm", po::value(&algorithm)->default_value("lbfgs"),
      "lbfgs (full batch), or sgd, adagrad, adam (minibatches; an iteration is an epoch)")(
      "learning-rate", po::value(&o.learning_rate)->default_value(0.05, "0.05"),
      "learning rate of sgd, adagrad and adam")("batch-size", po::value(&batch_size)->default_value(32),
                                                "sentences per minibatch")(
      "max-iter", po::value(&o.max_iterations)->default_value(100), "maximum L-BFGS iterations or epochs")(
      "tolerance", po::value(&o.tolerance)->default_value(1e-5, "1e-5"),
      "stop when the objective improves by less than this fraction over 10 iterations")(
      "early-stopping", po::value(&o.early_stopping)->default_value(0),
      "stop after N iterations without a better dev score (0: off)")(
      "device", device_value(o.device), "cpu, cuda or cuda:N")("threads", threads_value(o.threads),
                                                               "CPU threads (0: all)")(
      "seed", seed_value(o.seed), "random seed")(
      "encoder", po::value<std::string>()->default_value("none"),
      "none: this feature CRF; bilstm or cnn: a neural tagger (trellis crf train --encoder bilstm --help)");
  po::variables_map vm;
  if (int rc =
          parse("crf", args, desc, vm, "usage: trellis crf train --train FILE [--dev FILE] --model FILE [options]");
      rc >= 0)
    return rc;

  if (batch_size < 1) throw Error("--batch-size must be at least 1, not " + std::to_string(batch_size));
  o.feature_pairs = parse_feature_pairs(feature_pairs);
  o.algorithm = parse_crf_algorithm(algorithm);
  const auto given = [&](const char* option) { return vm.count(option) && !vm[option].defaulted(); };
  if (o.algorithm == CrfAlgorithm::Lbfgs && (given("batch-size") || given("learning-rate")))
    throw Error("--batch-size and --learning-rate are for --algorithm sgd, adagrad or adam (lbfgs uses every sentence "
                "and finds its own step)");
  if (given("early-stopping") && dev_path.empty()) throw Error("--early-stopping stops on the dev score: it needs --dev");
  const bool c2_auto = c2_text == "auto";
  if (c2_auto && dev_path.empty()) throw Error("--c2 auto chooses c2 by the dev score: it needs --dev");
  if (!c2_auto) o.c2 = parse_number(c2_text, "--c2 (a number, or auto)");
  o.batch_size = static_cast<std::size_t>(batch_size);
  // Under torchrun every rank reads the data; one that cannot stops every rank with its message (docs/distributed.md).
  const DistributedContext dist = DistributedContext::from_environment(o.device);
  o.distributed = &dist;
  std::unique_ptr<FeatureExtractor> extractor;
  std::optional<ColumnLayout> resolved;
  std::optional<LabeledSentences> training, dv;
  dist.check_all(failure_of([&] {
    if (dist.rank() == 0) {  // before training, not after
      if (model_path == "-") throw Error("--model '-': a model is written to a file, not to standard output");
      check_writable_location(model_path);
      check_output_is_not_an_input("--model", model_path,
                                   {{"--train", train_path}, {"--dev", dev_path}, {"--template", template_path}});
    }
    check_standard_input_read_once({{"--train", train_path}, {"--dev", dev_path}});
    if (dist.distributed() && (train_path == "-" || dev_path == "-"))
      throw Error("under torchrun every rank reads the data: give --train and --dev as files, not '-'");
    extractor = template_path.empty() ? builtin_features() : load_crfpp_template(template_path);
    const ConllCorpus train_corpus = read_input(train_path);
    resolved = ColumnLayout::resolve(
        train_corpus.num_columns, label_column,
        input_columns.empty() ? std::vector<int>{} : parse_int_list(input_columns, "--input-columns"), train_path);
    extractor->validate(resolved->inputs.size(), train_path);  // here, where the template's file is known
    const auto labelled = [&](const ConllCorpus& c) {
      bool has_labels = false;
      ConllCorpus projected = resolved->project(c, &has_labels);
      if (!has_labels)
        throw Error("'" + c.source + "' has no label column (the model's columns: " + resolved->describe() + ")");
      return split_labels(projected, -1);
    };
    training = labelled(train_corpus);
    if (!dev_path.empty()) dv = labelled(read_input(dev_path));
  }));
  const ColumnLayout& layout = *resolved;
  const LabeledSentences& tr = *training;
  if (dist.distributed()) {
    std::ostringstream line;  // written at once: the ranks share the terminal
    line << dist.describe() << " (" << dist.backend() << "): ";
    if (o.algorithm == CrfAlgorithm::Lbfgs) {
      const TrainingShare share = training_share(tr, &dist);
      line << "sentences "
           << (share.count ? std::to_string(share.first) + "-" + std::to_string(share.first + share.count - 1) : "none")
           << " (" << share.count << " of " << tr.inputs.size() << "), " << share.tokens << " of " << tr.num_tokens()
           << " tokens (" << fixed(100.0 * share.tokens / std::max<std::size_t>(tr.num_tokens(), 1), 1) << "%)\n";
    } else {
      line << "part " << dist.rank() + 1 << " of each minibatch of " << o.batch_size << " sentences (about 1/"
           << dist.world_size() << " of " << tr.num_tokens() << " tokens)\n";
    }
    std::cerr << line.str();
  }
  std::ostream no_output(nullptr);
  std::ostream& report = dist.rank() == 0 ? std::cerr : no_output;  // every rank holds the same numbers
  report << "columns: " << layout.describe();
  if (!layout.ignored().empty() && input_columns.empty())
    report << " (columns after the label are not inputs unless --input-columns names them)";
  report << "\ntrain: " << tr.inputs.size() << " sentences, " << tr.num_tokens() << " tokens";
  if (dv) report << "; dev: " << dv->inputs.size() << " sentences, " << dv->num_tokens() << " tokens";
  report << "\n";
  const auto progress = [&](const CrfIteration& it) {
    report << "iter " << it.iteration << "  objective " << fixed(it.objective, 3) << "  |g| "
           << fixed(it.gradient_norm, 3);
    if (it.dev_accuracy) report << "  dev acc " << fixed(*it.dev_accuracy, 2) << "%";
    if (it.dev_f1) report << "  dev F1 " << fixed(*it.dev_f1, 2);
    report << "  " << fixed(it.seconds, 2) << " s\n";
  };
  // --c2 auto: a decade apart around the default of 1, the range where the taggers of docs/benchmarks.md found their
  // best dev scores; the model kept is the best dev score's (chunk F1 for chunk labels, accuracy otherwise).
  const std::vector<double> c2_values = c2_auto ? std::vector<double>{0.01, 0.1, 1, 10} : std::vector<double>{o.c2};
  std::optional<CrfTagger> best;
  CrfTrainSummary sum;
  double best_score = 0, best_c2 = o.c2;
  for (const double c2 : c2_values) {
    o.c2 = c2;
    if (c2_auto) report << "c2 " << c2 << ":\n";
    CrfTrainSummary this_sum;
    CrfTagger trained =
        train_crf(tr, dv ? &*dv : nullptr, FeatureExtractor::from_spec(extractor->spec()), o, progress, &this_sum);
    const double score = this_sum.best_dev_f1 ? *this_sum.best_dev_f1 : this_sum.best_dev_accuracy.value_or(0);
    if (c2_auto)
      report << "c2 " << c2 << ": best dev " << (this_sum.best_dev_f1 ? "F1 " : "acc ") << fixed(score, 2) << "\n";
    if (!best || score > best_score) {
      best.emplace(std::move(trained));
      sum = this_sum;
      best_score = score;
      best_c2 = c2;
    }
  }
  CrfTagger& model = *best;
  model.set_layout(layout);
  if (c2_auto) report << "c2 auto: " << best_c2 << " has the best dev score\n";
  dist.check_all(failure_of([&] {
    if (dist.rank() == 0) model.save(model_path);
  }));
  report << "done: " << sum.iterations << " iterations"
         << (sum.converged ? " (converged)"
                           : " (did not converge: stopped at --max-iter " + std::to_string(o.max_iterations) + ")")
         << ", " << model.labels().size() << " labels, " << sum.features << " features, " << sum.parameters
         << " parameters (" << sum.nonzero_parameters << " non-zero), " << fixed(sum.seconds, 1) << " s (set-up "
         << fixed(sum.setup_seconds, 2) << " s)";
  if (sum.best_dev_accuracy) {
    report << "; best dev (iteration " << sum.best_iteration << "): acc " << fixed(*sum.best_dev_accuracy, 2) << "%";
    if (sum.best_dev_f1) report << " F1 " << fixed(*sum.best_dev_f1, 2);
  }
  report << "\nmodel written to " << model_path << "\n";
  return 0;
}

int tag(const std::vector<std::string>& args) {
  TagArguments a;
  if (int rc = parse_tag_arguments(args, tag_options(a), a); rc >= 0) return rc;
  const auto t0 = std::chrono::steady_clock::now();
  const auto seconds = [](auto from) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count();
  };
  CrfTagger model = CrfTagger::load(a.model_path);
  model.to(at::Device(a.device));
  const double load_seconds = seconds(t0);
  const ConllCorpus corpus = read_input(a.input);
  const std::vector<TokenRows> rows = model_inputs(model.layout().project(corpus), model.input_columns());
  const auto t1 = std::chrono::steady_clock::now();
  const auto report = [&] {
    if (!a.timing) return;
    int64_t tokens = 0;
    for (const auto& r : rows) tokens += static_cast<int64_t>(r.size());
    const double s = seconds(t1);
    std::cerr << "model loaded in " << fixed(load_seconds, 3) << " s; tagged " << rows.size() << " sentences, "
              << tokens << " tokens in " << fixed(s, 3) << " s (" << fixed(tokens / std::max(s, 1e-9), 0)
              << " tokens/s, features, decoding and output)\n";
  };
  tag_and_write(model, a, corpus, rows);
  report();
  return 0;
}

int eval(const std::vector<std::string>& args) {
  std::string model_path, gold_path, tagged_path;
  po::options_description desc("options");
  desc.add_options()("help,h", "this message")("model,m", po::value(&model_path), "model to tag --gold with")(
      "gold", po::value(&gold_path),
      "gold CoNLL file in the model's training layout (see crf dump), tagged with --model")(
      "tagged", po::value(&tagged_path), "already tagged file: ... gold predicted (conlleval's layout)");
  po::variables_map vm;
  const std::string usage = "usage: trellis crf eval (--model FILE --gold FILE | --tagged FILE)";
  if (int rc = parse("crf", args, desc, vm, usage); rc >= 0) return rc;
  if (tagged_path.empty() == (model_path.empty() || gold_path.empty())) {
    std::cerr << "trellis crf eval: give either --model and --gold, or --tagged\n" << usage << "\n";
    return 2;
  }
  ChunkEvaluation ev;
  if (!tagged_path.empty()) {
    const ConllCorpus c = read_input(tagged_path);
    if (c.num_columns < 2) throw Error("'" + c.source + "': needs gold and predicted label columns");
    for (const auto& s : c.sentences) {
      std::vector<std::string> gold, guess;
      for (const auto& row : s.rows) gold.push_back(row[c.num_columns - 2]), guess.push_back(row[c.num_columns - 1]);
      ev.add_sentence(gold, guess);
    }
  } else {
    const CrfTagger model = CrfTagger::load(model_path);
    const LabeledSentences gold = gold_sentences(model.layout(), gold_path);
    ev = score_tagged(gold, model.tag(pointers(gold.inputs)),
                      [&](const std::string& label) { return model.label_id(label) >= 0; });
  }
  print_evaluation(ev);
  return 0;
}

int dump(const std::vector<std::string>& args) {
  std::string model_path;
  int top = 20;
  if (int rc = parse_dump_arguments(args, "how many transitions and features to list",
                                    "usage: trellis crf dump [--model] FILE [--top N]", model_path, top);
      rc >= 0)
    return rc;
  const CrfTagger m = CrfTagger::load(model_path);
  const auto& L = m.labels();
  const int64_t K = L.size();
  std::cout << "model: " << model_path << "\nfeature set: " << m.extractor().spec()
            << "\ncolumns: " << m.layout().describe() << "\nlabels (" << K << "):";
  for (const auto& l : L) std::cout << ' ' << l;
  std::cout << "\nfeatures: " << m.features().size() << " (feature pairs: " << feature_pairs_name(m.feature_pairs())
            << ")\nparameters: " << m.weights.numel() + K * K + 2 * K << "\n";
  const auto list = [&](const at::Tensor& w, const std::function<std::string(int64_t)>& name) {
    const at::Tensor flat = w.flatten();
    const int64_t n = std::min<int64_t>(top, flat.numel());
    const at::Tensor idx = std::get<1>(flat.abs().topk(n));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = idx[i].item<int64_t>();
      std::cout << "  " << fixed(flat[j].item<float>(), 4) << "  " << name(j) << "\n";
    }
  };
  std::cout << "strongest transitions:\n";
  list(m.transitions, [&](int64_t j) { return L[j / K] + " -> " + L[j % K]; });
  std::cout << "strongest features:\n";
  list(m.weights, [&](int64_t j) {
    const auto [feature, label] = m.weight_pair(j);
    return m.features()[feature] + " => " + L[label];
  });
  return 0;
}

}  // namespace

int crf_main(const std::vector<std::string>& args) {
  static const std::map<std::string, std::function<int(const std::vector<std::string>&)>> commands{
      {"train", train}, {"tag", tag}, {"eval", eval}, {"dump", dump}};
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    (args.empty() ? std::cerr : std::cout) << kCrfUsage;  // without a command: a usage error
    return args.empty() ? 2 : 0;
  }
  if (const auto neural = neural_crf_main(args)) return *neural;  // train --encoder bilstm|cnn, neural model files
  const auto it = commands.find(args[0]);
  if (it == commands.end()) {
    std::cerr << "trellis crf: unknown command '" << args[0] << "'\n" << kCrfUsage;
    return 2;
  }
  return it->second({args.begin() + 1, args.end()});
}

}  // namespace trellis::cli
