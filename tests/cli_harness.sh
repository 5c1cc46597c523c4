# Shared by the command-line test scripts (sourced): pass/fail counting and the bad-input check.
passed=0 failed=0
ok() { passed=$((passed + 1)); }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }

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
