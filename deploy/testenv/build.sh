#!/usr/bin/env bash
# Builds the real kube-apiserver and etcd used by flotilla's tests from their Go modules
# (go/kube-apiserver and go/etcd), into a cache outside the clone, and prints the directory
# that holds them. Idempotent: a second run with the binaries present does nothing. Safe to run
# concurrently: runs serialise on a lock file in the binary directory.
#
# With --spoke it also builds what makes a spoke a cluster (the testenv's full spoke):
# kube-controller-manager and kube-scheduler from the apiserver's Kubernetes release
# (go/kube-controllers), and kwok, whose simulated kubelets run the pods (go/kwok). They go to a
# directory of their own, with a lock of its own, so that building them never holds up tests that
# need only the apiserver; that directory is printed last, the apiserver's on the line before.
#
# With --promtool it builds only promtool, Prometheus' own checker of expositions and rule files
# (go/promtool), into a directory of its own with a lock of its own, and prints that directory.
# The tests that hold flotilla's /metrics and alert rules to Prometheus' rules read it from
# FLOTILLA_PROMTOOL_BIN.
#
#   FLOTILLA_TESTENV_BIN         where etcd and kube-apiserver go
#                                (default: $HOME/.cache/flotilla/testenv/<versions>)
#   FLOTILLA_TESTENV_SPOKE_BIN   where the --spoke binaries go
#                                (default: $HOME/.cache/flotilla/testenv/spoke-<versions>)
#   FLOTILLA_PROMTOOL_BIN        where promtool goes
#                                (default: $HOME/.cache/flotilla/testenv/promtool-<version>)
#
# Go's own module and build caches ($HOME/go/pkg/mod, $HOME/.cache/go-build) make a rebuild after
# a version bump cheap; nothing here depends on them existing.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
kube_version=$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3}' "$here/go/kube-apiserver/go.mod")
controllers_kube_version=$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3}' "$here/go/kube-controllers/go.mod")
kwok_version=$(awk '$1 == "require" && $2 == "sigs.k8s.io/kwok" {print $3}' "$here/go/kwok/go.mod")
etcd_version=$(awk '$1 == "require" && $2 == "go.etcd.io/etcd/server/v3" {print $3}' "$here/go/etcd/go.mod")
prometheus_version=$(awk '$1 == "require" && $2 == "github.com/prometheus/prometheus" {print $3}' "$here/go/promtool/go.mod")
# Bump when the way the binaries are built changes, so caches of older builds are not reused.
recipe=2
bin=${FLOTILLA_TESTENV_BIN:-$HOME/.cache/flotilla/testenv/kube-$kube_version-etcd-$etcd_version-r$recipe}

spoke=false
promtool=false
case "${1:-}" in
  "") ;;
  --spoke) spoke=true ;;
  --promtool) promtool=true ;;
  *) echo "usage: $0 [--spoke | --promtool]" >&2; exit 2 ;;
esac
if [ "$controllers_kube_version" != "$kube_version" ]; then
  echo "go/kube-controllers builds Kubernetes $controllers_kube_version but go/kube-apiserver builds $kube_version; a cluster runs one release" >&2
  exit 1
fi

export GOTOOLCHAIN=local   # the toolchain on the machine; never download another
export GOFLAGS=-mod=readonly
export CGO_ENABLED=0

build() { # name, module dir, package, ldflags[, build tags[, more go build flags]]; into $bin
  local name=$1 dir=$2 pkg=$3 ldflags=$4 tags=${5:-providerless} more=${6:-}
  if [ -x "$bin/$name" ]; then return; fi
  echo "building $name ($pkg) into $bin ..." >&2
  local started=$SECONDS
  # shellcheck disable=SC2086 # $more is flags, split on purpose
  (cd "$dir" && go build -trimpath -tags "$tags" -ldflags="$ldflags" $more -o "$bin/$name.partial" "$pkg")
  mv "$bin/$name.partial" "$bin/$name"   # only a complete binary ever carries the final name
  echo "built $name in $((SECONDS - started)) s" >&2
}

if $promtool; then
  # Bump when the way promtool is built changes.
  promtool_recipe=1
  bin=${FLOTILLA_PROMTOOL_BIN:-$HOME/.cache/flotilla/testenv/promtool-$prometheus_version-r$promtool_recipe}
  mkdir -p "$bin"
  exec 9>"$bin/.build.lock"
  flock 9
  # A module build carries no git metadata: stamp the release `promtool --version` reports.
  prom_ldflags="-s -w -X github.com/prometheus/common/version.Version=$prometheus_version"
  # remove_all_sd leaves out Prometheus' service discoveries (the cloud SDKs, most of the build):
  # the tests check expositions and rule files, never a scrape configuration.
  build promtool "$here/go/promtool" github.com/prometheus/prometheus/cmd/promtool "$prom_ldflags" remove_all_sd
  echo "$bin"
  exit 0
fi

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

build etcd "$here/go/etcd" . "-s -w"
build kube-apiserver "$here/go/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver "$kube_ldflags"
echo "$bin"
exec 9>&-   # the apiserver's lock; tests that need only it go on while the rest builds

if $spoke; then
  # Bump when the way these binaries are built changes.
  spoke_recipe=2
  bin=${FLOTILLA_TESTENV_SPOKE_BIN:-$HOME/.cache/flotilla/testenv/spoke-kube-$kube_version-kwok-$kwok_version-r$spoke_recipe}
  mkdir -p "$bin"
  exec 9>"$bin/.build.lock"
  flock 9
  build kube-controller-manager "$here/go/kube-controllers" k8s.io/kubernetes/cmd/kube-controller-manager "$kube_ldflags"
  build kube-scheduler "$here/go/kube-controllers" k8s.io/kubernetes/cmd/kube-scheduler "$kube_ldflags"
  if [ ! -x "$bin/kwok" ] || [ ! -f "$bin/kwok-stages.yaml" ]; then
    # `go list -m` names no directory for a module not yet in the module cache (a fresh
    # machine): download it first.
    kwok_dir=$(cd "$here/go/kwok" && go mod download sigs.k8s.io/kwok && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
    if [ -z "$kwok_dir" ] || [ ! -d "$kwok_dir" ]; then
      echo "cannot find kwok's module source (go mod download sigs.k8s.io/kwok in $here/go/kwok)" >&2
      exit 1
    fi
  fi
  if [ ! -x "$bin/kwok" ]; then
    # Two faults of kwok's exec that a kubelet does not have (see go/kwok/patch/exit_code.go.in):
    # it loses a command's exit code, and it never closes the command's stdin when the caller's
    # ends, so `kubectl exec -i POD -- cat` (and `kubectl cp`) never finish. Go builds nothing
    # patched from its module cache, so the module is copied, patched, and kwok is built from
    # the copy (a `replace` in a copy of go/kwok's go.mod, given with -modfile); go/kwok and the
    # cache stay as they are. Each edit must match exactly once, so a kwok bump that moves the
    # code fails here rather than building unpatched.
    patched="$bin/.kwok-patched"
    rm -rf "$patched"; mkdir -p "$patched"
    cp -r "$kwok_dir" "$patched/kwok"
    chmod -R u+w "$patched/kwok"   # the module cache's files are read-only
    edit_once() { # file (in the copy), sed match, sed replacement
      local file=$patched/kwok/$1 n
      n=$(grep -c "$2" "$file" || true)
      if [ "$n" != 1 ]; then
        echo "kwok's $1 has $n lines matching '$2' where the patch expects 1; revisit go/kwok/patch" >&2
        exit 1
      fi
      sed -i "s/$2/$3/" "$file"
    }
    exec_call='\(err :\?= \)\(utilsexec.Exec(ctx, cmd\[0\], cmd\[1:\]...)\)$'
    edit_once pkg/kwok/server/debugging_exec.go "$exec_call" '\1flotillaCommandExit(\2)'
    edit_once pkg/kwok/server/debugging_exec_other.go "$exec_call" '\1flotillaCommandExit(\2)'
    edit_once pkg/utils/exec/exec.go '\(_, _ = io.Copy(inPipe, opt.In)\)$' '\1; _ = inPipe.Close()'
    server="$patched/kwok/pkg/kwok/server"
    cp "$here/go/kwok/patch/exit_code.go.in" "$server/flotilla_exit_code.go"
    cp "$here/go/kwok/go.sum" "$patched/go.sum"
    { cat "$here/go/kwok/go.mod"; echo "replace sigs.k8s.io/kwok => $patched/kwok"; } >"$patched/go.mod"
  fi
  build kwok "$here/go/kwok" sigs.k8s.io/kwok/cmd/kwok "-s -w" providerless "-modfile=$bin/.kwok-patched/go.mod"
  rm -rf "$bin/.kwok-patched"
  # The kwok binary has no stages of its own (kwokctl hands it these): kwok's own defaults, taken
  # from the module that built it, so stages and binary always come from the same release.
  if [ ! -f "$bin/kwok-stages.yaml" ]; then
    for stage in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
      pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
      echo "---"
      cat "$kwok_dir/kustomize/stage/$stage.yaml"
    done >"$bin/kwok-stages.yaml.partial"
    mv "$bin/kwok-stages.yaml.partial" "$bin/kwok-stages.yaml"
  fi
  echo "$bin"
fi
