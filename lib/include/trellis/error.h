// Errors thrown by the Trellis library. The library never exits the process: every failure is an
// exception derived from trellis::Error, whose message names the file, line or index at fault.
#pragma once
#include <stdexcept>
#include <string>

namespace trellis {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A problem in an input file: the message is prefixed with "file:line: ".
struct ParseError : Error {
  // The error `what` at line `line` (1-based) of `source` (a file name).
  ParseError(const std::string& source, std::size_t line, const std::string& what)
      : Error(source + ":" + std::to_string(line) + ": " + what), source(source), line(line) {}
  std::string source;  // the file
  std::size_t line;    // the line, from 1
};

}  // namespace trellis
