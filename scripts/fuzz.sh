#!/usr/bin/env bash
# Runs one of flotilla's fuzz targets (fuzz/, cargo-fuzz with libFuzzer) for a while and says what
# it did: executions, coverage, CPU time, and any input that failed.
#
#   scripts/fuzz.sh TARGET SECONDS [LIBFUZZER-FLAGS...]
#   scripts/fuzz.sh --list
#
# The repository's corpus (fuzz/corpus/TARGET) seeds the run, with the target's dictionary of
# tokens (fuzz/dict/TARGET.dict) when it has one; what the run learns goes to a
# working corpus outside the clone ($HOME/.cache/flotilla/fuzz/TARGET), kept between runs. An
# input that fails is written to $HOME/.cache/flotilla/fuzz/artifacts/TARGET/ and named at the
# end; minimise it with
#   cargo +nightly fuzz tmin --fuzz-dir fuzz TARGET FILE
# then add it to fuzz/corpus/TARGET with the fix, so the crate's tests/fuzz_corpus.rs replays it.
#
# One fuzzer process at lowest priority (nice 19); run two at most side by side on a shared
# machine. Installs what it needs when missing: the nightly toolchain and cargo-fuzz. Builds go
# to CARGO_TARGET_DIR (default $HOME/.cache/flotilla/fuzz-target), a log of each run to
# $HOME/.cache/flotilla/fuzz/logs/. Exits non-zero when the target failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

targets() { sed -n 's/^name = "\(.*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^flotilla-fuzz$'; }

case "${1:-}" in
  --list) targets; exit 0 ;;
  ""|-h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
target=$1
seconds=${2:?"usage: scripts/fuzz.sh TARGET SECONDS (scripts/fuzz.sh --list names the targets)"}
shift 2
if ! targets | grep -qx "$target"; then
  echo "no fuzz target $target; the targets are:" >&2
  targets >&2
  exit 2
fi

cache=$HOME/.cache/flotilla/fuzz
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/flotilla/fuzz-target}
work=$cache/$target
artifacts=$cache/artifacts/$target
mkdir -p "$work" "$artifacts" "$cache/logs"
log=$cache/logs/$target-$(date +%Y%m%d-%H%M%S).log

rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
cargo +nightly fuzz --version >/dev/null 2>&1 || cargo install cargo-fuzz --locked

# Release with debug assertions and overflow checks (fuzz/Cargo.toml), AddressSanitizer.
nice -n 10 cargo +nightly fuzz build --fuzz-dir fuzz --target-dir "$CARGO_TARGET_DIR" "$target"

echo "fuzzing $target for ${seconds}s (log: $log)"
# -timeout: an input that takes this long is a finding (a bound missing on work per input).
# -rss_limit_mb and -malloc_limit_mb: so is memory beyond these.
dict=()
[ -f "fuzz/dict/$target.dict" ] && dict=(-dict="fuzz/dict/$target.dict")
start=$(date +%s)
set +e
/usr/bin/time -f "cpu_seconds: %U user %S sys" -o "$log.time" \
  nice -n 19 cargo +nightly fuzz run --fuzz-dir fuzz --target-dir "$CARGO_TARGET_DIR" "$target" \
  "$work" "fuzz/corpus/$target" -- \
  -max_total_time="$seconds" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 \
  -malloc_limit_mb=512 -artifact_prefix="$artifacts/" "${dict[@]}" "$@" >"$log" 2>&1
status=$?
set -e
wall=$(( $(date +%s) - start ))

final=$(grep -E '^#[0-9]+[[:space:]]+(DONE|pulse|NEW|REDUCE|INITED)' "$log" | tail -n 1 || true)
stat() { sed -n "s/^stat::$1:[[:space:]]*//p" "$log" | tail -n 1; }
read -r user _ sys _ < <(sed -n 's/^cpu_seconds: //p' "$log.time")
echo "target:        $target"
echo "wall seconds:  $wall"
echo "cpu seconds:   $(awk -v u="${user:-0}" -v s="${sys:-0}" 'BEGIN { printf "%.0f", u + s }')"
echo "executions:    $(stat number_of_executed_units)"
echo "exec/s:        $(stat average_exec_per_sec)"
echo "peak rss MB:   $(stat peak_rss_mb)"
echo "coverage:      $(grep -oE 'cov: [0-9]+ ft: [0-9]+' <<<"$final" || echo unknown)"
echo "corpus:        $(find "$work" -type f | wc -l) inputs in $work"
crashes=$(grep -oE '(Test unit written to|artifact_prefix.*Test unit written to) [^ ]+' "$log" | awk '{ print $NF }' || true)
if [ "$status" -ne 0 ] || [ -n "$crashes" ]; then
  echo "FAILED (exit $status); the inputs:"
  echo "${crashes:-none written; see $log}"
  grep -m 3 -E "panicked at|ERROR: libFuzzer|SUMMARY:" "$log" || true
  exit 1
fi
echo "no failure"
