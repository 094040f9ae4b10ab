#!/usr/bin/env bash
# Builds the real kube-apiserver and etcd used by flotilla's tests from their Go modules
# (go/kube-apiserver and go/etcd), into a cache outside the clone, and prints the directory
# that holds them. Idempotent: a second run with the binaries present does nothing. Safe to run
# concurrently: runs serialise on a lock file in the binary directory.
#
#   FLOTILLA_TESTENV_BIN   where the binaries go (default: $HOME/.cache/flotilla/testenv/<versions>)
#
# Go's own module and build caches ($HOME/go/pkg/mod, $HOME/.cache/go-build) make a rebuild after
# a version bump cheap; nothing here depends on them existing.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
kube_version=$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3}' "$here/go/kube-apiserver/go.mod")
etcd_version=$(awk '$1 == "require" && $2 == "go.etcd.io/etcd/server/v3" {print $3}' "$here/go/etcd/go.mod")
# Bump when the way the binaries are built changes, so caches of older builds are not reused.
recipe=2
bin=${FLOTILLA_TESTENV_BIN:-$HOME/.cache/flotilla/testenv/kube-$kube_version-etcd-$etcd_version-r$recipe}

export GOTOOLCHAIN=local   # the toolchain on the machine; never download another
export GOFLAGS=-mod=readonly
export CGO_ENABLED=0

mkdir -p "$bin"
# Parallel test processes each run this script; one builds, the others wait here and then find the
# binaries present. The lock is released when this shell exits (the fd closes).
exec 9>"$bin/.build.lock"
flock 9

# A module build carries no git metadata: stamp the version Kubernetes reports at /version (and
# that clients such as kubectl and the agent read), as the release build does.
minor=${kube_version#v1.}; minor=${minor%%.*}
kube_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_ldflags+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  kube_ldflags+=" -X $pkg.gitTreeState=clean"
done

build() { # name, module dir, package, ldflags
  local name=$1 dir=$2 pkg=$3 ldflags=$4
  if [ -x "$bin/$name" ]; then return; fi
  echo "building $name ($pkg) into $bin ..." >&2
  (cd "$dir" && go build -trimpath -tags providerless -ldflags="$ldflags" -o "$bin/$name.partial" "$pkg")
  mv "$bin/$name.partial" "$bin/$name"   # only a complete binary ever carries the final name
}
build etcd "$here/go/etcd" . "-s -w"
build kube-apiserver "$here/go/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver "$kube_ldflags"
echo "$bin"
