//! The kinds the hub stores, with the REST coordinates a store backend needs.
//!
//! All but one are custom resources (OCM's and flotilla's own, with CRDs in `deploy/crds`);
//! [`Kind::ConfigMap`] is Kubernetes' own core kind, which the kube backend's apiserver serves
//! natively (`/api/v1`).

/// One of the OCM kinds the hub keeps. Store backends key objects by kind, namespace and name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    ManagedCluster,
    ManagedClusterSet,
    ManagedClusterSetBinding,
    ManifestWork,
    ManifestWorkReplicaSet,
    Placement,
    PlacementDecision,
    AddOnPlacementScore,
    /// flotilla's own: a piece of a large work's manifests (see [`super::content`]).
    ManifestChunk,
    /// Governance (see [`super::policy`]): templates delivered to the clusters a
    /// PlacementBinding's Placement selects.
    Policy,
    /// Binds Policies and PolicySets to a Placement.
    PlacementBinding,
    /// A named group of Policies placed together.
    PolicySet,
    /// flotilla's own: one cluster's compliance with each root Policy it carries, in the
    /// cluster's namespace (see [`super::policy::ClusterCompliance`]).
    ClusterCompliance,
    /// Kubernetes' core ConfigMap (`v1`, no CRD): data hub templates read with
    /// `fromConfigMap` from their policy's namespace (see [`super::config_map`]).
    ConfigMap,
}

impl Kind {
    pub const ALL: [Kind; 14] = [
        Kind::ManagedCluster,
        Kind::ManagedClusterSet,
        Kind::ManagedClusterSetBinding,
        Kind::ManifestWork,
        Kind::ManifestWorkReplicaSet,
        Kind::Placement,
        Kind::PlacementDecision,
        Kind::AddOnPlacementScore,
        Kind::ManifestChunk,
        Kind::Policy,
        Kind::PlacementBinding,
        Kind::PolicySet,
        Kind::ClusterCompliance,
        Kind::ConfigMap,
    ];

    /// The `kind` field.
    pub fn name(self) -> &'static str {
        match self {
            Kind::ManagedCluster => "ManagedCluster",
            Kind::ManagedClusterSet => "ManagedClusterSet",
            Kind::ManagedClusterSetBinding => "ManagedClusterSetBinding",
            Kind::ManifestWork => "ManifestWork",
            Kind::ManifestWorkReplicaSet => "ManifestWorkReplicaSet",
            Kind::Placement => "Placement",
            Kind::PlacementDecision => "PlacementDecision",
            Kind::AddOnPlacementScore => "AddOnPlacementScore",
            Kind::ManifestChunk => "ManifestChunk",
            Kind::Policy => "Policy",
            Kind::PlacementBinding => "PlacementBinding",
            Kind::PolicySet => "PolicySet",
            Kind::ClusterCompliance => "ClusterCompliance",
            Kind::ConfigMap => "ConfigMap",
        }
    }

    /// The API group; `""` for the core group (ConfigMap).
    pub fn group(self) -> &'static str {
        match self {
            Kind::ConfigMap => "",
            Kind::ManifestWork | Kind::ManifestWorkReplicaSet => "work.open-cluster-management.io",
            Kind::ManifestChunk => "work.flotilla.io",
            Kind::Policy | Kind::PlacementBinding | Kind::PolicySet => super::policy::POLICY_GROUP,
            Kind::ClusterCompliance => super::policy::COMPLIANCE_GROUP,
            _ => "cluster.open-cluster-management.io",
        }
    }

    /// The storage version flotilla serves (the one OCM's docs use).
    pub fn version(self) -> &'static str {
        match self {
            Kind::ManagedCluster
            | Kind::ManifestWork
            | Kind::Policy
            | Kind::PlacementBinding
            | Kind::ConfigMap => "v1",
            Kind::ManagedClusterSet | Kind::ManagedClusterSetBinding => "v1beta2",
            Kind::Placement | Kind::PlacementDecision | Kind::PolicySet => "v1beta1",
            Kind::ManifestWorkReplicaSet
            | Kind::AddOnPlacementScore
            | Kind::ManifestChunk
            | Kind::ClusterCompliance => "v1alpha1",
        }
    }

    /// `group/version`, the `apiVersion` field; the version alone in the core group (`v1`).
    pub fn api_version(self) -> String {
        if self.group().is_empty() {
            return self.version().to_owned();
        }
        format!("{}/{}", self.group(), self.version())
    }

    /// Where the kind's REST paths start: `/apis/GROUP/VERSION`, or `/api/VERSION` for the
    /// core group, as on a kube-apiserver (and the hub's operator API).
    pub fn api_root(self) -> String {
        if self.group().is_empty() {
            return format!("/api/{}", self.version());
        }
        format!("/apis/{}/{}", self.group(), self.version())
    }

    /// Whether the kind has a CustomResourceDefinition in `deploy/crds`: every kind but
    /// Kubernetes' own ConfigMap.
    pub fn has_crd(self) -> bool {
        self != Kind::ConfigMap
    }

    /// Whether the kind has a status, written through the status subresource. A ManifestChunk
    /// is written once and never has one; a ConfigMap is data only.
    pub fn has_status(self) -> bool {
        !matches!(self, Kind::ManifestChunk | Kind::ConfigMap)
    }

    /// The REST resource name (lower-case plural).
    pub fn plural(self) -> &'static str {
        match self {
            Kind::ManagedCluster => "managedclusters",
            Kind::ManagedClusterSet => "managedclustersets",
            Kind::ManagedClusterSetBinding => "managedclustersetbindings",
            Kind::ManifestWork => "manifestworks",
            Kind::ManifestWorkReplicaSet => "manifestworkreplicasets",
            Kind::Placement => "placements",
            Kind::PlacementDecision => "placementdecisions",
            Kind::AddOnPlacementScore => "addonplacementscores",
            Kind::ManifestChunk => "manifestchunks",
            Kind::Policy => "policies",
            Kind::PlacementBinding => "placementbindings",
            Kind::PolicySet => "policysets",
            Kind::ClusterCompliance => "clustercompliances",
            Kind::ConfigMap => "configmaps",
        }
    }

    /// Cluster-scoped kinds have no namespace; the others live in a namespace (for
    /// ManifestWork: the managed cluster's namespace, named after the cluster).
    pub fn namespaced(self) -> bool {
        !matches!(self, Kind::ManagedCluster | Kind::ManagedClusterSet)
    }

    /// Looks a kind up by its `kind` field, as found in YAML.
    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_core_kind_has_kubernetes_coordinates() {
        let cm = Kind::ConfigMap;
        assert_eq!(cm.api_version(), "v1");
        assert_eq!(cm.api_root(), "/api/v1");
        assert!(cm.namespaced() && !cm.has_crd() && !cm.has_status());
        assert_eq!(Kind::from_name("ConfigMap"), Some(cm));
        assert_eq!(
            Kind::Policy.api_root(),
            "/apis/policy.open-cluster-management.io/v1"
        );
        assert_eq!(
            Kind::Policy.api_version(),
            "policy.open-cluster-management.io/v1"
        );
        assert_eq!(
            Kind::ALL.iter().filter(|k| !k.has_crd()).count(),
            1,
            "only ConfigMap is served without a CRD"
        );
    }
}
