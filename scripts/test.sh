#!/usr/bin/env bash
# The one test command (README, .ci/run): installs and builds everything it needs on a fresh
# machine, then checks formatting, lints, dependencies, and runs every test, including the ones
# against a real kube-apiserver and etcd.
#
# Build outputs are cached outside the clone so repeated runs are fast; nothing depends on the
# caches existing:
#   CARGO_TARGET_DIR        default $HOME/.cache/flotilla/target
#   FLOTILLA_TESTENV_BIN    default $HOME/.cache/flotilla/testenv/<versions> (deploy/testenv/build.sh)
#   FLOTILLA_TESTENV_SPOKE_BIN  default $HOME/.cache/flotilla/testenv/spoke-<versions> (the full
#                           spoke's controller-manager, scheduler and kwok: build.sh --spoke)
#   FLOTILLA_PROMTOOL_BIN   default $HOME/.cache/flotilla/testenv/promtool-<version> (Prometheus'
#                           promtool, which checks every /metrics page and the alert rules:
#                           build.sh --promtool)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/flotilla/target}
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
export CARGO_NET_RETRY=${CARGO_NET_RETRY:-5}
# Every run builds a fresh clone, whose files are all newer than the cache: incremental state
# would be rewritten each time for nothing, and it is most of the cache's size.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
cache=$HOME/.cache/flotilla
mkdir -p "$cache"

step() { printf '\n==> %s (%s)\n' "$*" "$(date +%H:%M:%S)"; }

step "toolchain"
for tool in cargo go kubectl; do
  command -v "$tool" >/dev/null || { echo "missing $tool: install it (README, 'What a machine needs')" >&2; exit 1; }
done
cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
# Installs Debian package $1 when command $2 is missing.
apt_install_for() {
  command -v "$2" >/dev/null && return 0
  step "installing $1"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo -n"
  $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$1" >/dev/null \
    || { $sudo_cmd apt-get update -q >/dev/null && $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$1" >/dev/null; }
}
# A real HTTP forward proxy for the proxy end-to-end test (registration.rs).
apt_install_for tinyproxy tinyproxy
# Headless Chromium for the status page's browser test (status_page.rs).
apt_install_for chromium chromium
# nftables for the chaos scenario's partitions (loadtest/tests/chaos.rs) and the link
# emulator's loss and outages (wan/tests, loadtest/tests/link.rs).
apt_install_for nftables nft
# iproute2 (ip, tc) for the link emulator's namespaces and rate shaping.
apt_install_for iproute2 tc
if ! command -v cargo-deny >/dev/null; then
  step "installing cargo-deny"
  cargo install --locked cargo-deny@0.20.2 2>&1 | tail -n 3
fi

step "test kube-apiserver, etcd, and the full spoke's controller-manager, scheduler and kwok"
testenv_dirs=$(deploy/testenv/build.sh --spoke)
FLOTILLA_TESTENV_BIN=$(echo "$testenv_dirs" | tail -n 2 | head -n 1)
FLOTILLA_TESTENV_SPOKE_BIN=$(echo "$testenv_dirs" | tail -n 1)
export FLOTILLA_TESTENV_BIN FLOTILLA_TESTENV_SPOKE_BIN

step "promtool"
FLOTILLA_PROMTOOL_BIN=$(deploy/testenv/build.sh --promtool | tail -n 1)
export FLOTILLA_PROMTOOL_BIN

step "format"
cargo fmt --all --check

step "fetch"
cargo fetch --locked

step "dependencies (cargo deny)"
if [ -d "$root/../shared/advisory-db" ]; then
  # A snapshot of the RustSec database for machines that cannot fetch it.
  "$root/../shared/advisory-db/prepare.sh" "$cache/advisory-db" >/dev/null
else
  cargo deny fetch db
fi
cargo deny --offline check

step "clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "build"
cargo build --workspace --bins --locked

step "tests"
cargo test --workspace --locked --no-fail-fast -- --test-threads="${FLOTILLA_TEST_THREADS:-4}"

step "no stray test processes"
strays=$(pgrep -a -f "$FLOTILLA_TESTENV_BIN/(kube-apiserver|etcd)|$FLOTILLA_TESTENV_SPOKE_BIN/(kube-controller-manager|kube-scheduler|kwok)|$CARGO_TARGET_DIR/debug/flotilla-(hub|agent)|tinyproxy -d -c /tmp/" || true)
if [ -n "$strays" ]; then
  echo "test processes left behind:" >&2
  echo "$strays" >&2
  exit 1
fi
echo "all checks passed"
