# Shared by the command-line test scripts (sourced): pass/fail counting and the bad-input check.
passed=0 failed=0
ok() { passed=$((passed + 1)); }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }

# prints PATTERN COMMAND...: COMMAND succeeds and a line of its standard output matches PATTERN (grep's basic regular
# expression). The whole output is taken before matching: under pipefail `COMMAND | grep -q` fails whenever grep, done
# at the first match, makes COMMAND's next write fail (SIGPIPE, or the error exit of a command that reports failed
# writes) — a test failing by timing.
prints() {
  local pattern=$1 out
  shift
  out=$("$@") && grep -q -- "$pattern" <<<"$out"
}

# expect_error NAME NEEDLE OUTPUT_FILE COMMAND...: non-zero exit, NEEDLE in stderr, neither OUTPUT_FILE nor a
# temporary file beside it left behind.
expect_error() {
  local name=$1 needle=$2 output=$3
  shift 3
  if "$@" >stdout.txt 2>stderr.txt; then fail "$name: exit code 0"; return; fi
  if ! grep -qF -- "$needle" stderr.txt; then fail "$name: stderr lacks '$needle': $(cat stderr.txt)"; return; fi
  if [ -e "$output" ]; then fail "$name: $output was written"; return; fi
  if ls "$output".tmp.* >/dev/null 2>&1; then fail "$name: a temporary file was left"; return; fi
  ok
}
