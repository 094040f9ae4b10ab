#!/usr/bin/env bash
# Runs the image's flotilla-hub, flotilla-gateway and flotilla-agent as containers, in the
# shape deploy/ installs them (hub on the kube store with --gateways external, one gateway
# holding every shard through Leases, an agent joining with a bootstrap token), against real
# clusters of the test environment: a hub apiserver, and a spoke with controllers, scheduler
# and kwok nodes. It then places an nginx ManifestWork on the spoke and waits until the
# Deployment is Available there and the work says so on the hub, and reads the Deployment and a
# pod's log with kubectl through the hub's proxy front (relayed by the gateway).
#
#   deploy/image/smoke.sh [IMAGE]        # default IMAGE: localhost/flotilla:dev (build.sh's)
#
# Containers share the host's network (--network host) and reach the clusters on 127.0.0.1.
# Needs podman, kubectl, cargo and the test environment's binaries (deploy/testenv/build.sh,
# run on demand by the clusters' start). FLOTILLA_SMOKE_RUN_FLAGS adds flags to every
# `podman` call; a machine whose cgroups are v1 needs
#   FLOTILLA_SMOKE_RUN_FLAGS="--runtime runc --cgroup-manager cgroupfs"
# and one that caps the open files or processes of root below podman's defaults needs the
# container limits given too (docs/operations.md says what this repository's machine needed).
set -euo pipefail

image=${1:-localhost/flotilla:dev}
root=$(cd "$(dirname "$0")/../.." && pwd)
read -r -a podman_flags <<<"${FLOTILLA_SMOKE_RUN_FLAGS:-}"
read -r -a limit_flags <<<"${FLOTILLA_SMOKE_LIMITS:-}"
podman() { command podman "${podman_flags[@]}" "$@"; }
say() { echo "smoke: $*" >&2; }
die() { echo "smoke: FAILED: $*" >&2; exit 1; }

work=$(mktemp -d)
chmod 0755 "$work"
pids=()
containers=(flotilla-smoke-hub flotilla-smoke-gateway flotilla-smoke-agent)
cleanup() {
  status=$?
  if [ $status -ne 0 ]; then
    for c in "${containers[@]}"; do
      echo "--- last lines of $c" >&2
      podman logs --tail 20 "$c" 2>&1 | cat >&2 || true
    done
  fi
  podman rm -f "${containers[@]}" >/dev/null 2>&1 || true
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# until DEADLINE_SECONDS WHAT CMD...: runs CMD every second until it succeeds.
until_ok() {
  local seconds=$1 what=$2
  local deadline=$(( $(date +%s) + seconds ))
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || die "$what (waited $seconds s)"
    sleep 1
  done
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

say "starting the hub's apiserver and the spoke cluster"
(cd "$root" && cargo build -q -p flotilla-testenv --example cluster)
example=${CARGO_TARGET_DIR:-$root/target}/debug/examples/cluster
"$example" "$work/hub-api" & pids+=($!)
"$example" "$work/spoke" --full & pids+=($!)
until_ok 600 "the hub's apiserver to serve" test -s "$work/hub-api/kubeconfig"
until_ok 600 "the spoke cluster to serve" test -s "$work/spoke/kubeconfig"
hub_kubeconfig=$work/hub-api/kubeconfig
spoke_kubeconfig=$work/spoke/kubeconfig
kubectl --kubeconfig "$hub_kubeconfig" apply --server-side -k "$root/deploy/crds" >/dev/null
kubectl --kubeconfig "$hub_kubeconfig" create namespace flotilla-system >/dev/null
# The containers run as 65532: the kubeconfigs and the state directories must be theirs.
mkdir -p "$work/hub" "$work/agent" "$work/gateway-tls"
chmod a+r "$hub_kubeconfig" "$spoke_kubeconfig"
chmod a+rx "$work/hub-api" "$work/spoke"
chown 65532:65532 "$work/hub" "$work/agent" "$work/gateway-tls"

agents_port=$(free_port); api_port=$(free_port); gateway_port=$(free_port)
hub_metrics=$(free_port); gateway_metrics=$(free_port); agent_metrics=$(free_port)
proxy_port=$(free_port)
cat >"$work/access-rules.yaml" <<'YAML'
rules:
  - name: ops-stores
    groups: [ops]
    clusters: {names: [store-0001]}
    access: full
YAML
chmod a+r "$work/access-rules.yaml"
run=(run -d --log-driver k8s-file --network host --user 65532:65532 "${limit_flags[@]}" -v "$work:/smoke")

say "hub: flotilla-hub --store kube --gateways external"
podman "${run[@]}" --name flotilla-smoke-hub "$image" flotilla-hub \
  --data-dir /smoke/hub --store kube --kubeconfig /smoke/hub-api/kubeconfig \
  --gateways external --listen "127.0.0.1:$agents_port" --api-listen "127.0.0.1:$api_port" \
  --metrics-addr "127.0.0.1:$hub_metrics" --server-name 127.0.0.1 \
  --proxy-listen "127.0.0.1:$proxy_port" --proxy-access-rules /smoke/access-rules.yaml >/dev/null
until_ok 120 "the hub to be ready" curl -sf "http://127.0.0.1:$hub_metrics/readyz"

say "gateway: its certificate from the hub CA, then flotilla-gateway"
podman exec flotilla-smoke-hub flotilla-hub gateway-cert --data-dir /smoke/hub \
  --out /smoke/gateway-tls --server-name 127.0.0.1 >/dev/null
podman "${run[@]}" --name flotilla-smoke-gateway "$image" flotilla-gateway \
  --name gw-1 --listen "127.0.0.1:$gateway_port" --advertise-address "127.0.0.1:$gateway_port" \
  --kubeconfig /smoke/hub-api/kubeconfig --cert-dir /smoke/gateway-tls \
  --metrics-addr "127.0.0.1:$gateway_metrics" >/dev/null
until_ok 120 "the gateway to be ready" curl -sf "http://127.0.0.1:$gateway_metrics/readyz"

say "agent: a bootstrap token, flotilla-agent join, accepted by the token"
cli=(podman exec flotilla-smoke-hub flotilla --config /smoke/hub/operator/config.yaml)
token_json=$("${cli[@]}" token create --ttl 10m --uses 1 --auto-accept --cluster-name store-0001 -o json)
token=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])' <<<"$token_json")
fingerprint=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["caFingerprint"])' <<<"$token_json")
podman "${run[@]}" --name flotilla-smoke-agent -e "FLOTILLA_BOOTSTRAP_TOKEN=$token" "$image" \
  flotilla-agent join --hub "127.0.0.1:$agents_port" --cluster-name store-0001 \
  --ca-fingerprint "$fingerprint" --data-dir /smoke/agent \
  --kubeconfig /smoke/spoke/kubeconfig --metrics-addr "127.0.0.1:$agent_metrics" >/dev/null
until_ok 180 "store-0001 to be Available on the hub" kubectl --kubeconfig "$hub_kubeconfig" \
  wait --for=condition=ManagedClusterConditionAvailable managedcluster/store-0001 --timeout=5s

say "work: an nginx Deployment through a ManifestWork"
cat >"$work/work.yaml" <<'YAML'
apiVersion: work.open-cluster-management.io/v1
kind: ManifestWork
metadata:
  name: nginx
  namespace: store-0001
spec:
  workload:
    manifests:
      - apiVersion: apps/v1
        kind: Deployment
        metadata: {name: nginx, namespace: default}
        spec:
          replicas: 2
          selector: {matchLabels: {app: nginx}}
          template:
            metadata: {labels: {app: nginx}}
            spec:
              containers: [{name: nginx, image: nginx:1.27}]
YAML
chmod a+r "$work/work.yaml"
"${cli[@]}" apply -f /smoke/work.yaml >/dev/null
until_ok 300 "deployment/nginx to be Available on the spoke" \
  kubectl --kubeconfig "$spoke_kubeconfig" wait --for=condition=Available deployment/nginx --timeout=5s
until_ok 120 "the work to be Available on the hub" kubectl --kubeconfig "$hub_kubeconfig" \
  -n store-0001 wait --for=condition=Available manifestwork/nginx --timeout=5s

say "kubectl through the hub's proxy front: a user, a kubeconfig, the spoke's RBAC for group ops"
# It writes alice.kubeconfig into the working directory too.
podman exec --workdir /smoke/hub flotilla-smoke-hub flotilla \
  --config /smoke/hub/operator/config.yaml user create alice --groups ops >/dev/null
"${cli[@]}" kubeconfig --cluster store-0001 --user alice -o /smoke/hub/store-0001.kubeconfig >/dev/null
# The kubeconfig names the key and certificate by their paths in the container.
sed -i "s#/smoke/#$work/#g" "$work/hub/store-0001.kubeconfig"
kubectl --kubeconfig "$spoke_kubeconfig" create clusterrolebinding ops-admin \
  --clusterrole=cluster-admin --group=ops >/dev/null
through_hub=$(kubectl --kubeconfig "$work/hub/store-0001.kubeconfig" get deployment nginx \
  -o jsonpath='{.status.availableReplicas}')
[ "$through_hub" = 2 ] || die "kubectl through the hub saw availableReplicas '$through_hub', not 2"
pod=$(kubectl --kubeconfig "$work/hub/store-0001.kubeconfig" get pods -l app=nginx -o name | head -n 1)
kubectl --kubeconfig "$work/hub/store-0001.kubeconfig" logs "$pod" >/dev/null ||
  die "kubectl logs $pod through the hub failed"

say "passed: $image ran the hub, a gateway and an agent; store-0001 joined through the gateway"
say "and applied deployment/nginx, Available with $(kubectl --kubeconfig "$spoke_kubeconfig" \
  get deployment nginx -o jsonpath='{.status.availableReplicas}') replicas on kwok nodes;"
say "kubectl get and logs reached it through the hub's proxy front and the gateway"
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' "$image" >&2
