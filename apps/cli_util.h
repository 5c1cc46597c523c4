// Pieces every subcommand shares: option parsing with usage errors, number formatting, progress lines.
#pragma once
#include <boost/program_options.hpp>
#include <chrono>
#include <string>
#include <vector>

namespace trellis::cli {

// Parses args into vm. Returns -1 to go on, 0 after printing help, 2 on a usage error (message names `command`).
int parse(const std::string& command, const std::vector<std::string>& args,
          const boost::program_options::options_description& desc, boost::program_options::variables_map& vm,
          const std::string& usage, const boost::program_options::positional_options_description* positional = nullptr);

std::string fixed(double v, int digits);

// "512M", "2G", "100k" or a plain byte count.
int64_t parse_bytes(const std::string& text);

// "1,2" or "-1": a comma-separated list of integers; `option` names the option in the error.
std::vector<int> parse_int_list(const std::string& text, const std::string& option);

// A floating-point number, the whole of `text` (nan and inf too: the option's own check rejects them by name);
// `option` names the option in the error.
double parse_number(const std::string& text, const std::string& option);

// Prints "label: done/total unit, rate/s" to stderr at most once per interval, and once at the end.
class Progress {
 public:
  Progress(std::string label, int64_t total, std::string unit, double interval_seconds = 2.0);
  void update(int64_t done);  // the total done so far
  void finish();
  double seconds() const;

 private:
  void print();
  std::string label_, unit_;
  int64_t total_, done_ = 0;
  double interval_;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace trellis::cli
