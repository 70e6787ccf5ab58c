#!/usr/bin/env bash
# A bounded fuzz run: every target for SECONDS (default 10), starting from seeds
# cut out of the golden captures. Stable Rust: no sanitizer (`-s none`); the
# wire layer has no unsafe code, so what this finds is panics, overflows
# (debug assertions are on) and broken round-trip properties.
#   fuzz/run-bounded.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-10}
shift || true
python3 make-seeds.py >/dev/null
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  mapfile -t targets < <(cargo fuzz list)
fi
cargo fuzz build -s none "${targets[@]:0:0}" >/dev/null
fail=0
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  if cargo fuzz run -s none "$t" "corpus/$t" "seeds/$t" -- -max_total_time="$secs" -rss_limit_mb=1024 >"/tmp/fuzz-$t.log" 2>&1; then
    echo "fuzz $t: ok ($(grep -o 'Done [0-9]* runs' "/tmp/fuzz-$t.log" | tail -1))"
  else
    echo "fuzz $t: FAILED (log: /tmp/fuzz-$t.log)"; tail -30 "/tmp/fuzz-$t.log"; fail=1
  fi
done
exit $fail
