// trellis crf train --encoder bilstm|cnn, and tag/eval/dump of neural models: option parsing and output formatting
// only; the work is in the library (trellis/train/neural_tagger.h).
#include "crf_neural.h"

#include <boost/program_options.hpp>
#include <chrono>
#include <functional>
#include <future>
#include <iostream>
#include <map>

#include "cli_util.h"
#include "trellis/io/atomic_file.h"
#include "trellis/io/chunk_eval.h"
#include "trellis/io/conll.h"
#include "trellis/error.h"
#include "trellis/train/neural_tagger.h"

namespace po = boost::program_options;

namespace trellis::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point from) { return std::chrono::duration<double>(Clock::now() - from).count(); }

// The value of an option in raw arguments: "--name V", "--name=V", a prefix of --name at least `min_prefix`
// characters long (Boost accepts unambiguous prefixes), or "-s V" / "-sV" for a short name. nullopt when absent.
std::optional<std::string> raw_option(const std::vector<std::string>& args, const std::string& name,
                                      std::size_t min_prefix, char short_name = 0) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (short_name && a.size() >= 2 && a[0] == '-' && a[1] == short_name) {
      if (a.size() > 2) return a.substr(2);
      if (i + 1 < args.size()) return args[i + 1];
      return std::nullopt;
    }
    if (a.rfind("--", 0) != 0) continue;
    const std::size_t eq = a.find('=');
    const std::string key = a.substr(0, eq);
    if (key.size() < min_prefix || name.rfind(key, 0) != 0) continue;
    if (eq != std::string::npos) return a.substr(eq + 1);
    if (i + 1 < args.size()) return args[i + 1];
    return std::nullopt;
  }
  return std::nullopt;
}

int train(const std::vector<std::string>& args) {
  NeuralTaggerOptions o;
  std::string train_path, dev_path, model_path, template_path, input_columns;
  int label_column = -1;
  bool hybrid = false;
  int64_t batch_size =
      static_cast<int64_t>(o.batch_size);  // signed: Boost would read -1 into an unsigned option as its largest value
  po::options_description desc("options");
  desc.add_options()("help,h", "this message")("train", po::value(&train_path)->required(),
                                               "training data: CoNLL columns, a blank line between sentences (- for stdin)")(
      "dev", po::value(&dev_path),
      "development data, scored after every epoch (early stopping, best model kept; - for stdin)")(
      "model,m", po::value(&model_path)->required(), "where to write the model")(
      "encoder", parsed_value(o.encoder, parse_sentence_encoder)->required(),
      "bilstm, cnn (stacked dilated convolutions), or none (the feature CRF)")(
      "label-column", po::value(&label_column)->default_value(-1), "label column (negative counts from the end)")(
      "input-columns", po::value(&input_columns),
      "the input columns, e.g. 0,1: the first is the word, each other one (POS, ...) is embedded "
      "(default: those before the label column)")("epochs", po::value(&o.epochs)->default_value(o.epochs),
                                                  "maximum epochs")(
      "batch-size", po::value(&batch_size)->default_value(batch_size), "sentences per minibatch (bucketed by length)")(
      "lr", po::value(&o.learning_rate)->default_value(o.learning_rate, "0.004"), "Adam learning rate")(
      "lr-decay", po::value(&o.lr_decay)->default_value(o.lr_decay, "0.95"), "learning rate factor per epoch")(
      "beta2", po::value(&o.beta2)->default_value(o.beta2, "0.999"), "Adam's decay of the squared-gradient average")(
      "average", po::value(&o.average)->default_value(o.average, "0.999"),
      "decay per step of a moving average of the weights, which the dev set scores and the model keeps (0: off, "
      "the last weights)")("clip", po::value(&o.clip)->default_value(o.clip, "5"), "gradient norm clipping (0: off)")(
      "dropout", po::value(&o.dropout)->default_value(o.dropout, "0.5"),
      "dropout on inputs, between layers and before the emissions")(
      "variational-dropout",
      po::value(&o.variational_dropout)->default_value(o.variational_dropout)->implicit_value(true),
      "one dropout mask per sentence, the same at every position (--variational-dropout=false: one per token)")(
      "word-dropout", po::value(&o.word_dropout)->default_value(o.word_dropout, "0.5"),
      "a: a training word seen c times is replaced by the unknown word with probability a/(a+c)")(
      "embedding-dim", po::value(&o.word_dim)->default_value(0),
      "word embedding size (0: 100, or the --embeddings file's)")(
      "char-dim", po::value(&o.char_dim)->default_value(o.char_dim),
      "character embedding size (0: no character representation)")(
      "char-filters", po::value(&o.char_filters)->default_value(o.char_filters),
      "character CNN filters, or BiLSTM units per direction")(
      "char-encoder",
      parsed_value(o.char_encoder, parse_char_encoder)->default_value(char_encoder_name(o.char_encoder)),
      "cnn or bilstm: the characters' representation")(
      "feature-dim", po::value(&o.feature_dim)->default_value(o.feature_dim),
      "embedding size of the word shape and of each extra input column")(
      "hidden", po::value(&o.hidden)->default_value(o.hidden),
      "BiLSTM units per direction (convolution channels: twice this)")(
      "layers", po::value(&o.layers)->default_value(o.layers), "BiLSTM layers, or dilated convolution blocks")(
      "patience", po::value(&o.patience)->default_value(o.patience),
      "with --dev: stop after N epochs without a better dev score (0: never)")(
      "embeddings", po::value(&o.pretrained_embeddings),
      "pretrained word vectors to start from (word2vec/GloVe text format)")(
      "hybrid", po::value(&hybrid)->default_value(true)->implicit_value(true),
      "add the built-in sparse CRF features to the emissions (--hybrid=false: the network alone)")(
      "template,t", po::value(&template_path),
      "add the sparse features of this CRF++ template to the emissions (implies --hybrid)")(
      "min-freq", po::value(&o.min_feature_count)->default_value(1),
      "hybrid: drop sparse features seen fewer times in training")(
      "c2", po::value(&o.c2)->default_value(1.0),
      "hybrid: L2 coefficient of the sparse weights (c2*|w|^2 over the training set)")("device", device_value(o.device),
                                                                                       "cpu, cuda or cuda:N")(
      "precision", parsed_value(o.precision, parse_encoder_precision)->default_value("auto"),
      "auto (bf16 encoder on CUDA, fp32 on the CPU), bf16 or fp32; the CRF is fp32")(
      "threads", threads_value(o.threads), "CPU threads (0: all)")(
      "seed", seed_value(o.seed), "random seed (the same seed on the CPU gives the same model)");
  po::variables_map vm;
  if (int rc = parse("crf", args, desc, vm,
                     "usage: trellis crf train --encoder bilstm|cnn --train FILE [--dev FILE] --model FILE [options]");
      rc >= 0)
    return rc;

  if (batch_size < 1) throw Error("--batch-size must be at least 1, not " + std::to_string(batch_size));
  o.batch_size = static_cast<std::size_t>(batch_size);
  const auto given = [&](const char* option) { return vm.count(option) && !vm[option].defaulted(); };
  if (!template_path.empty() && given("hybrid") && !hybrid)
    throw Error("--template adds its sparse features to the emissions: it cannot be combined with --hybrid=false");
  if (template_path.empty() && !hybrid && (given("c2") || given("min-freq")))
    throw Error("--c2 and --min-freq concern the sparse features: with --hybrid=false there are none");
  if (given("patience") && dev_path.empty()) throw Error("--patience stops on the dev score: it needs --dev");
  if (model_path == "-") throw Error("--model '-': a model is written to a file, not to standard output");
  check_writable_location(model_path);  // before training, not after
  check_output_is_not_an_input("--model", model_path,
                               {{"--train", train_path},
                                {"--dev", dev_path},
                                {"--template", template_path},
                                {"--embeddings", o.pretrained_embeddings}});
  std::unique_ptr<FeatureExtractor> sparse;
  if (!template_path.empty()) sparse = load_crfpp_template(template_path);
  else if (hybrid) sparse = builtin_features();
  check_standard_input_read_once({{"--train", train_path}, {"--dev", dev_path}});
  const ConllCorpus train_corpus = read_input(train_path);
  const ColumnLayout layout = ColumnLayout::resolve(
      train_corpus.num_columns, label_column,
      input_columns.empty() ? std::vector<int>{} : parse_int_list(input_columns, "--input-columns"), train_path);
  const auto labelled = [&](const ConllCorpus& c) {
    bool has_labels = false;
    ConllCorpus projected = layout.project(c, &has_labels);
    if (!has_labels)
      throw Error("'" + c.source + "' has no label column (the model's columns: " + layout.describe() + ")");
    return split_labels(projected, -1);
  };
  const LabeledSentences tr = labelled(train_corpus);
  std::optional<LabeledSentences> dv;
  if (!dev_path.empty()) dv = labelled(read_input(dev_path));
  std::cerr << "columns: " << layout.describe();
  if (!layout.ignored().empty() && input_columns.empty())
    std::cerr << " (columns after the label are not inputs unless --input-columns names them)";
  std::cerr << "\ntrain: " << tr.inputs.size() << " sentences, " << tr.num_tokens() << " tokens";
  if (dv) std::cerr << "; dev: " << dv->inputs.size() << " sentences, " << dv->num_tokens() << " tokens";
  std::cerr << "\n";
  NeuralTrainSummary sum;
  NeuralTagger model = train_neural_tagger(
      tr, dv ? &*dv : nullptr, std::move(sparse), o,
      [](const NeuralEpoch& e) {
        std::cerr << "epoch " << e.epoch << "  loss " << fixed(e.loss, 4) << "/token  lr " << fixed(e.learning_rate, 6)
                  << "  " << fixed(e.tokens_per_second, 0) << " tokens/s";
        if (e.dev_accuracy) std::cerr << "  dev acc " << fixed(*e.dev_accuracy, 2) << "%";
        if (e.dev_f1) std::cerr << "  dev F1 " << fixed(*e.dev_f1, 2);
        std::cerr << "  " << fixed(e.seconds, 1) << " s\n";
      },
      &sum);
  model.set_layout(layout);
  model.save(model_path);
  std::cerr << "done: " << sum.epochs << " epochs"
            << (sum.stopped_early
                    ? " (stopped: no better dev score for --patience " + std::to_string(o.patience) + " epochs)"
                    : "")
            << ", " << model.labels().size() << " labels, " << sum.words << " words, " << sum.characters
            << " characters, ";
  if (model.hybrid()) std::cerr << sum.features << " sparse features, ";
  std::cerr << sum.parameters << " parameters, " << fixed(sum.seconds, 1) << " s (set-up "
            << fixed(sum.setup_seconds, 2) << " s)";
  if (sum.best_dev_accuracy) {
    std::cerr << "; best dev (epoch " << sum.best_epoch << ", " << fixed(sum.seconds_to_best, 1) << " s): acc "
              << fixed(*sum.best_dev_accuracy, 2) << "%";
    if (sum.best_dev_f1) std::cerr << " F1 " << fixed(*sum.best_dev_f1, 2);
  }
  std::cerr << "\nmodel written to " << model_path << "\n";
  return 0;
}

int tag(const std::vector<std::string>& args) {
  TagArguments a;
  EncoderPrecision precision = EncoderPrecision::Auto;
  po::options_description desc = tag_options(a);
  desc.add_options()("precision", parsed_value(precision, parse_encoder_precision)->default_value("auto"),
                     "neural models: auto (bf16 encoder on CUDA), bf16 or fp32");
  if (int rc = parse_tag_arguments(args, desc, a); rc >= 0) return rc;
  const auto t0 = Clock::now();
  // The device's libraries start on another thread while the model and the input are read.
  std::future<void> device_started = std::async(std::launch::async, [&] { NeuralTagger::start_device(a.device); });
  NeuralTagger model = NeuralTagger::load(a.model_path);
  const ConllCorpus corpus = read_input(a.input);
  const std::vector<TokenRows> rows = model_inputs(model.layout().project(corpus), model.input_columns());
  device_started.get();
  model.to(a.device, precision);
  const double load_seconds = seconds_since(t0);
  // The first batch on a GPU starts its libraries (cuDNN, cuBLAS): with --timing that start is timed apart.
  double warmup_seconds = 0;
  if (a.timing && !rows.empty()) {
    const auto w0 = Clock::now();
    model.tag({&rows.front()});
    warmup_seconds = seconds_since(w0);
  }
  const auto t1 = Clock::now();
  const auto report = [&] {
    if (!a.timing) return;
    int64_t tokens = 0;
    for (const auto& r : rows) tokens += static_cast<int64_t>(r.size());
    const double s = seconds_since(t1);
    std::cerr << "model and input read, device started in " << fixed(load_seconds, 3) << " s, warm-up "
              << fixed(warmup_seconds, 3) << " s; tagged " << rows.size() << " sentences, " << tokens << " tokens in "
              << fixed(s, 3) << " s (" << fixed(tokens / std::max(s, 1e-9), 0)
              << " tokens/s, encoding, decoding and output)\n";
  };
  tag_and_write(model, a, corpus, rows);
  report();
  return 0;
}

int eval(const std::vector<std::string>& args) {
  std::string model_path, gold_path;
  c10::Device device = c10::kCPU;
  EncoderPrecision precision = EncoderPrecision::Auto;
  po::options_description desc("options");
  desc.add_options()("help,h", "this message")("model,m", po::value(&model_path)->required(),
                                               "neural model to tag --gold with")(
      "gold", po::value(&gold_path)->required(), "gold CoNLL file in the model's training layout (see crf dump)")(
      "device", device_value(device), "cpu, cuda or cuda:N")(
      "precision", parsed_value(precision, parse_encoder_precision)->default_value("auto"),
      "auto (bf16 encoder on CUDA), bf16 or fp32");
  po::variables_map vm;
  if (int rc = parse("crf", args, desc, vm, "usage: trellis crf eval --model FILE --gold FILE", nullptr); rc >= 0)
    return rc;
  NeuralTagger model = NeuralTagger::load(model_path);
  model.to(device, precision);
  const LabeledSentences gold = gold_sentences(model.layout(), gold_path);
  print_evaluation(score_tagged(gold, model.tag(pointers(gold.inputs)),
                                [&](const std::string& label) { return model.label_id(label) >= 0; }));
  return 0;
}

int dump(const std::vector<std::string>& args) {
  std::string model_path;
  int top = 20;
  if (int rc = parse_dump_arguments(args, "(feature models only)", "usage: trellis crf dump [--model] FILE", model_path,
                                    top);
      rc >= 0)
    return rc;
  const NeuralTagger m = NeuralTagger::load(model_path);
  std::cout << "model: " << model_path << "\nkind: neural CRF\n"
            << m.describe() << "columns: " << m.layout().describe() << "\nlabels (" << m.labels().size() << "):";
  for (const auto& l : m.labels()) std::cout << ' ' << l;
  std::cout << "\n";
  return 0;
}

// The model file named in raw arguments of tag, eval or dump: --model/-m, or dump's positional FILE.
std::optional<std::string> model_argument(const std::string& command, const std::vector<std::string>& args) {
  if (auto m = raw_option(args, "--model", 4, 'm')) return m;
  if (command != "dump") return std::nullopt;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i].rfind("--t", 0) == 0 && args[i].find('=') == std::string::npos) {
      ++i;  // --top's value
      continue;
    }
    if (!args[i].empty() && args[i][0] != '-') return args[i];
  }
  return std::nullopt;
}

}  // namespace

std::optional<int> neural_crf_main(const std::vector<std::string>& args) {
  if (args.empty()) return std::nullopt;
  const std::string& command = args[0];
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (command == "train") {
    const auto encoder = raw_option(rest, "--encoder", 4);
    if (!encoder || *encoder == "none") return std::nullopt;
    return train(rest);
  }
  static const std::map<std::string, std::function<int(const std::vector<std::string>&)>> model_commands{
      {"tag", tag}, {"eval", eval}, {"dump", dump}};
  const auto it = model_commands.find(command);
  if (it == model_commands.end()) return std::nullopt;
  const auto model = model_argument(command, rest);
  if (!model || !NeuralTagger::is_model_file(*model)) return std::nullopt;
  return it->second(rest);
}

}  // namespace trellis::cli
