#!/usr/bin/env bash
# Runs a flotilla-loadtest command many times in a row, each run with a deadline, and reports
# how many passed, failed and hung. The logs and reports of every run that did not pass are kept;
# those of passing runs are deleted.
#
#   scripts/soak.sh [-n RUNS] [-t SECONDS] [-o DIR] [-- LOADTEST-ARGS...]
#
#   -n RUNS      runs (default 10)
#   -t SECONDS   deadline of one run; a run still going then is a hang, killed (default 180)
#   -o DIR       where runs and the summary go (default ./soak-<time>)
#   LOADTEST-ARGS  what to run (default: demo --agents 1000); each run gets its own --out
#
# Example: the soak of docs/reliability.md
#   scripts/soak.sh -n 50 -- demo --agents 1000
#   scripts/soak.sh -n 20 -t 300 -- demo --agents 2000
#
# Builds the release flotilla-loadtest first if needed (CARGO_TARGET_DIR as scripts/test.sh
# sets it). Exits non-zero if any run failed or hung.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

runs=10
deadline=180
out=""
while getopts "n:t:o:h" opt; do
  case $opt in
    n) runs=$OPTARG ;;
    t) deadline=$OPTARG ;;
    o) out=$OPTARG ;;
    h) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(demo --agents 1000)

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/flotilla/target}
cargo build --release --locked -q -p flotilla-loadtest
exe=$CARGO_TARGET_DIR/release/flotilla-loadtest

out=${out:-soak-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary=$out/summary.txt
echo "soak: ${runs} runs of: flotilla-loadtest ${args[*]} (deadline ${deadline}s each)" | tee "$summary"

pass=0 fail=0 hang=0
for i in $(seq 1 "$runs"); do
  dir=$out/run-$i
  mkdir -p "$dir"
  start=$(date +%s.%N)
  # Its own session, so that a hung run is killed with everything it started (hub, workers).
  set +e
  setsid --wait timeout --kill-after=10 "$deadline" "$exe" "${args[@]}" --quiet --out "$dir/report" \
    >"$dir/output.log" 2>&1 &
  pid=$!
  wait $pid
  code=$?
  set -e
  # Whatever the run left behind (a hub that would not stop) goes with its session.
  pkill -KILL -s "$pid" 2>/dev/null || true
  pkill -KILL -f "$dir/" 2>/dev/null || true
  took=$(awk "BEGIN { print $(date +%s.%N) - $start }")
  case $code in
    0) verdict=pass; pass=$((pass + 1)) ;;
    124|137) verdict=HANG; hang=$((hang + 1)) ;;
    *) verdict=FAIL; fail=$((fail + 1)) ;;
  esac
  printf 'run %3d  %-4s  %6.1fs  exit %d\n' "$i" "$verdict" "$took" "$code" | tee -a "$summary"
  if [ "$verdict" = pass ]; then
    rm -rf "$dir"
  else
    echo "  kept: $dir" | tee -a "$summary"
  fi
done
echo "passed $pass, failed $fail, hung $hang of $runs" | tee -a "$summary"
[ $((fail + hang)) -eq 0 ]
