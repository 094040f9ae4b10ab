#!/usr/bin/env python3
"""Writes the facts of Open Cluster Management's CRD schemas, one file per kind we share with
OCM, into proto/tests/ocm_schemas/ (read by proto/tests/ocm_schemas.rs).

Run by hand, with a checkout of open-cluster-management-io/api:

    scripts/ocm-schema-facts.py ~/src/ocm-api [commit]

and for the governance kinds (Policy, PlacementBinding, PolicySet), whose CRDs live in
open-cluster-management-io/governance-policy-propagator:

    scripts/ocm-schema-facts.py --governance ~/src/governance-policy-propagator [commit]

Only facts go into the files (paths, types, formats, enums, defaults, patterns, bounds,
required properties, list and map types, CEL rules): no descriptions. The format is one line per
schema node, `path key=value ...`, with JSON values; `proto/tests/ocm_schemas.rs` renders the
same lines from our generated CRDs and compares.
"""

import json
import subprocess
import sys
from pathlib import Path

import yaml

# OCM's CRD file (relative to its repository) for each kind both sides have, keyed by the facts
# file name (the plural).
KINDS = {
    "managedclusters": "cluster/v1/0000_00_clusters.open-cluster-management.io_managedclusters.crd.yaml",
    "clusterclaims": "cluster/v1alpha1/0000_02_clusters.open-cluster-management.io_clusterclaims.crd.yaml",
    "addonplacementscores": "cluster/v1alpha1/0000_05_clusters.open-cluster-management.io_addonplacementscores.crd.yaml",
    "placements": "cluster/v1beta1/0000_02_clusters.open-cluster-management.io_placements.crd.yaml",
    "placementdecisions": "cluster/v1beta1/0000_03_clusters.open-cluster-management.io_placementdecisions.crd.yaml",
    "managedclustersets": "cluster/v1beta2/0000_00_clusters.open-cluster-management.io_managedclustersets.crd.yaml",
    "managedclustersetbindings": "cluster/v1beta2/0000_01_clusters.open-cluster-management.io_managedclustersetbindings.crd.yaml",
    "manifestworks": "work/v1/0000_00_work.open-cluster-management.io_manifestworks.crd.yaml",
    "manifestworkreplicasets": "work/v1alpha1/0000_00_work.open-cluster-management.io_manifestworkreplicasets.crd.yaml",
}

# The same for the governance kinds, in governance-policy-propagator.
GOVERNANCE_KINDS = {
    "policies": "deploy/crds/policy.open-cluster-management.io_policies.yaml",
    "placementbindings": "deploy/crds/policy.open-cluster-management.io_placementbindings.yaml",
    "policysets": "deploy/crds/policy.open-cluster-management.io_policysets.yaml",
}

# Schema keywords recorded, in this order, under the names the Rust side uses.
FACTS = [
    ("type", "type"),
    ("format", "format"),
    ("enum", "enum"),
    ("default", "default"),
    ("pattern", "pattern"),
    ("minimum", "minimum"),
    ("maximum", "maximum"),
    ("minLength", "minLength"),
    ("maxLength", "maxLength"),
    ("minItems", "minItems"),
    ("maxItems", "maxItems"),
    ("required", "required"),
    ("x-kubernetes-list-type", "listType"),
    ("x-kubernetes-list-map-keys", "listMapKeys"),
    ("x-kubernetes-map-type", "mapType"),
    ("x-kubernetes-int-or-string", "intOrString"),
    ("x-kubernetes-preserve-unknown-fields", "preserveUnknownFields"),
    ("x-kubernetes-embedded-resource", "embeddedResource"),
]


def compact(value):
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def walk(node, path, out):
    facts = []
    for key, name in FACTS:
        if key in node:
            value = node[key]
            if key == "required":
                value = sorted(value)
            facts.append(f"{name}={compact(value)}")
    for rule in node.get("x-kubernetes-validations", []):
        facts.append(f"rule={compact(rule['rule'])}")
    out.append(f"{path or '.'} {' '.join(facts)}".rstrip())
    for name, child in sorted(node.get("properties", {}).items()):
        walk(child, f"{path}.{name}" if path else name, out)
    if isinstance(node.get("items"), dict):
        walk(node["items"], f"{path}[]", out)
    if isinstance(node.get("additionalProperties"), dict):
        walk(node["additionalProperties"], f"{path}{{}}", out)


def main():
    args = sys.argv[1:]
    kinds, repository = KINDS, "open-cluster-management-io/api"
    if args[:1] == ["--governance"]:
        args = args[1:]
        kinds = GOVERNANCE_KINDS
        repository = "open-cluster-management-io/governance-policy-propagator"
    if len(args) not in (1, 2):
        sys.exit(__doc__)
    checkout = Path(args[0])
    commit = args[1] if len(args) == 2 else "HEAD"
    git = ["git", "-C", str(checkout)]
    commit = subprocess.check_output(git + ["rev-parse", commit], text=True).strip()
    out_dir = Path(__file__).resolve().parent.parent / "proto" / "tests" / "ocm_schemas"
    out_dir.mkdir(parents=True, exist_ok=True)
    for plural, path in kinds.items():
        text = subprocess.check_output(git + ["show", f"{commit}:{path}"], text=True)
        crd = yaml.safe_load(text)
        [version] = [v for v in crd["spec"]["versions"] if v.get("served")]
        schema = version["schema"]["openAPIV3Schema"]
        # metadata is the apiserver's, not the kind's; apiVersion and kind are the same
        # everywhere. The rest is the kind's: spec and status, or (PlacementBinding) its
        # top-level fields.
        schema = dict(schema)
        schema["properties"] = {
            k: v
            for k, v in schema.get("properties", {}).items()
            if k not in ("apiVersion", "kind", "metadata")
        }
        lines = []
        walk(schema, "", lines)
        header = [
            f"# Facts of OCM's {crd['spec']['names']['kind']} schema "
            f"({crd['spec']['group']}/{version['name']}), {repository} {commit}.",
            "# Generated by scripts/ocm-schema-facts.py; do not edit by hand.",
            f"version {version['name']}",
        ]
        (out_dir / f"{plural}.txt").write_text("\n".join(header + lines) + "\n")
        print(f"{plural}: {len(lines)} nodes")


if __name__ == "__main__":
    main()
