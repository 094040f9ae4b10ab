//! The kinds the hub stores, with the REST coordinates a store backend needs.

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
}

impl Kind {
    pub const ALL: [Kind; 13] = [
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
        }
    }

    pub fn group(self) -> &'static str {
        match self {
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
            Kind::ManagedCluster | Kind::ManifestWork | Kind::Policy | Kind::PlacementBinding => {
                "v1"
            }
            Kind::ManagedClusterSet | Kind::ManagedClusterSetBinding => "v1beta2",
            Kind::Placement | Kind::PlacementDecision | Kind::PolicySet => "v1beta1",
            Kind::ManifestWorkReplicaSet
            | Kind::AddOnPlacementScore
            | Kind::ManifestChunk
            | Kind::ClusterCompliance => "v1alpha1",
        }
    }

    /// `group/version`, the `apiVersion` field.
    pub fn api_version(self) -> String {
        format!("{}/{}", self.group(), self.version())
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
