//! `spec.executor`: a work may name a ServiceAccount on the spoke whose rights bound what it
//! applies. Before writing each manifest the agent asks the spoke's authorizer, with one
//! SubjectAccessReview per verb, whether that account may do it (OCM's verbs: create, update,
//! patch, get, and delete unless the object is orphaned with the work), and refuses the
//! manifest alone when it may not. The agent still writes with its own credentials: the
//! executor is a bound, not an identity. Without an executor the agent's own rights apply.
//!
//! A SubjectAccessReview cannot say whether a Role the executor may create grants rights the
//! executor does not hold (RBAC escalation). So before an RBAC object (Role, ClusterRole and
//! their bindings) is written under an executor, [`check_escalation`] has the spoke apiserver
//! try it: a server-side dry run impersonating the executor's ServiceAccount, which runs the
//! apiserver's own escalation and bind checks and stores nothing. A refusal fails that
//! manifest with the apiserver's reason and message.
//!
//! The agent's RBAC needs `create` on `subjectaccessreviews.authorization.k8s.io` and
//! `impersonate` on `serviceaccounts` for this (docs/security.md).

use flotilla_proto::api::ManifestWorkExecutor;
use serde_json::Value;

use crate::apply::target::{
    AccessCheck, ApplyError, ApplyTarget, FIELD_MANAGER, ManifestFailure, REASON_APPLY_FAILED,
};
use crate::cache::AppliedResource;

/// The reason of a manifest's `Applied=False` condition when the spoke apiserver refused the
/// executor's dry run as forbidden (its own reason, e.g. for an RBAC escalation).
pub const REASON_FORBIDDEN: &str = "Forbidden";

/// The RBAC kinds whose writes the apiserver checks for escalation (roles) and binding
/// (bindings) beyond what any authorizer question can tell.
const RBAC_GROUP: &str = "rbac.authorization.k8s.io";
const RBAC_KINDS: [&str; 4] = ["Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"];

/// The only executor subject type OCM defines.
pub const SERVICE_ACCOUNT: &str = "ServiceAccount";

/// Checks that the executor may do every one of `verbs` on `resource`.
pub async fn check(
    target: &dyn ApplyTarget,
    executor: &ManifestWorkExecutor,
    resource: &AppliedResource,
    verbs: &[&str],
) -> Result<(), ManifestFailure> {
    let refuse = |message: String, retryable: bool| ManifestFailure {
        message,
        retryable,
        reason: REASON_APPLY_FAILED,
    };
    let subject = &executor.subject;
    if subject.type_ != SERVICE_ACCOUNT {
        return Err(refuse(
            format!(
                "executor subject type {:?} is not supported; use ServiceAccount",
                subject.type_
            ),
            false,
        ));
    }
    let Some(sa) = subject
        .service_account
        .as_ref()
        .filter(|sa| !sa.namespace.is_empty() && !sa.name.is_empty())
    else {
        return Err(refuse(
            "executor subject ServiceAccount needs serviceAccount.namespace and serviceAccount.name"
                .to_owned(),
            false,
        ));
    };
    let user = format!("system:serviceaccount:{}:{}", sa.namespace, sa.name);
    // The groups the apiserver gives every service account token, so group bindings count.
    let groups = vec![
        "system:serviceaccounts".to_owned(),
        format!("system:serviceaccounts:{}", sa.namespace),
        "system:authenticated".to_owned(),
    ];
    for verb in verbs {
        let check = AccessCheck {
            user: user.clone(),
            groups: groups.clone(),
            verb: (*verb).to_owned(),
            resource: resource.clone(),
        };
        match target.review_access(&check).await {
            Ok(true) => {}
            Ok(false) => {
                let what = qualified(resource);
                let object = if resource.namespace.is_empty() {
                    resource.name.clone()
                } else {
                    format!("{}/{}", resource.namespace, resource.name)
                };
                let scope = if resource.namespace.is_empty() {
                    "cluster-wide".to_owned()
                } else {
                    format!("in namespace {}", resource.namespace)
                };
                // Retryable: the spoke's admin may grant the right; the agent asks again.
                return Err(refuse(
                    format!(
                        "executor ServiceAccount {}/{} may not {verb} {what} {object}; grant it {} on {what} {scope}",
                        sa.namespace,
                        sa.name,
                        verbs.join(", "),
                    ),
                    true,
                ));
            }
            Err(e) => {
                return Err(refuse(
                    format!(
                        "cannot check the executor's permission to {verb} {}: {e}",
                        qualified(resource)
                    ),
                    true,
                ));
            }
        }
    }
    Ok(())
}

/// For an RBAC object, has the spoke apiserver decide whether the executor may write it: a
/// server-side dry run of `manifest` impersonating the executor's ServiceAccount. Call it after
/// [`check`] passed; anything but an RBAC object passes at once.
pub async fn check_escalation(
    target: &dyn ApplyTarget,
    executor: &ManifestWorkExecutor,
    resource: &AppliedResource,
    manifest: &Value,
) -> Result<(), ManifestFailure> {
    if resource.group != RBAC_GROUP || !RBAC_KINDS.contains(&resource.kind.as_str()) {
        return Ok(());
    }
    let Some(sa) = executor.subject.service_account.as_ref() else {
        // `check` refused it already.
        return Ok(());
    };
    let user = format!("system:serviceaccount:{}:{}", sa.namespace, sa.name);
    let object = if resource.namespace.is_empty() {
        resource.name.clone()
    } else {
        format!("{}/{}", resource.namespace, resource.name)
    };
    match target
        .dry_run_as(&user, resource, manifest, FIELD_MANAGER)
        .await
    {
        Ok(()) => Ok(()),
        Err(ApplyError::Rejected {
            code,
            reason,
            message,
        }) => Err(ManifestFailure {
            message: format!(
                "executor ServiceAccount {}/{} may not write {} {object}: the spoke refused it ({reason}): {message}",
                sa.namespace, sa.name, resource.kind
            ),
            // The spoke's admin may grant the missing rights; the agent asks again.
            retryable: code == 403 || code == 409 || code == 429 || code >= 500,
            reason: if reason == REASON_FORBIDDEN {
                REASON_FORBIDDEN
            } else {
                REASON_APPLY_FAILED
            },
        }),
        Err(e) => Err(ManifestFailure {
            message: format!(
                "cannot check the executor's right to write {} {object}: {e}",
                resource.kind
            ),
            retryable: true,
            reason: REASON_APPLY_FAILED,
        }),
    }
}

/// `deployments.apps`, `configmaps`: how RBAC and kubectl name a resource.
fn qualified(resource: &AppliedResource) -> String {
    if resource.group.is_empty() {
        resource.resource.clone()
    } else {
        format!("{}.{}", resource.resource, resource.group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::memory::MemoryCluster;
    use flotilla_proto::api::{ManifestWorkExecutorSubject, ServiceAccountSubject};

    fn executor(type_: &str, sa: Option<(&str, &str)>) -> ManifestWorkExecutor {
        ManifestWorkExecutor {
            subject: ManifestWorkExecutorSubject {
                type_: type_.into(),
                service_account: sa.map(|(ns, name)| ServiceAccountSubject {
                    namespace: ns.into(),
                    name: name.into(),
                }),
            },
        }
    }

    fn deployment() -> AppliedResource {
        AppliedResource {
            group: "apps".into(),
            version: "v1".into(),
            kind: "Deployment".into(),
            resource: "deployments".into(),
            namespace: "default".into(),
            name: "web".into(),
        }
    }

    #[tokio::test]
    async fn a_missing_right_is_named_with_the_account_and_what_to_grant() {
        let cluster = MemoryCluster::new();
        cluster
            .deny("system:serviceaccount:team-a:deployer", "delete")
            .await;
        let verbs = ["create", "update", "patch", "get", "delete"];
        let err = check(
            &cluster,
            &executor("ServiceAccount", Some(("team-a", "deployer"))),
            &deployment(),
            &verbs,
        )
        .await
        .unwrap_err();
        assert_eq!(
            err.message,
            "executor ServiceAccount team-a/deployer may not delete deployments.apps default/web; grant it create, update, patch, get, delete on deployments.apps in namespace default"
        );
        assert!(err.retryable);
        assert_eq!(err.reason, "AppliedManifestFailed");
        // Without the delete verb (an orphaned object) it may.
        check(
            &cluster,
            &executor("ServiceAccount", Some(("team-a", "deployer"))),
            &deployment(),
            &verbs[..4],
        )
        .await
        .unwrap();
    }

    fn role() -> AppliedResource {
        AppliedResource {
            group: RBAC_GROUP.into(),
            version: "v1".into(),
            kind: "Role".into(),
            resource: "roles".into(),
            namespace: "default".into(),
            name: "wide".into(),
        }
    }

    #[tokio::test]
    async fn an_escalating_role_is_refused_with_the_spokes_reason_and_others_pass() {
        let cluster = MemoryCluster::new();
        cluster
            .deny("system:serviceaccount:team-a:deployer", "escalate")
            .await;
        let deployer = executor("ServiceAccount", Some(("team-a", "deployer")));
        let err = check_escalation(&cluster, &deployer, &role(), &Value::Null)
            .await
            .unwrap_err();
        assert_eq!(err.reason, REASON_FORBIDDEN);
        assert!(
            err.message.starts_with(
                "executor ServiceAccount team-a/deployer may not write Role default/wide: the spoke refused it (Forbidden): "
            ),
            "{}",
            err.message
        );
        assert!(
            err.message.contains("not currently held"),
            "{}",
            err.message
        );
        assert!(err.retryable);
        // Not an RBAC object: nothing to ask.
        check_escalation(&cluster, &deployer, &deployment(), &Value::Null)
            .await
            .unwrap();
        // Another executor without the denial may.
        let other = executor("ServiceAccount", Some(("team-a", "admin")));
        check_escalation(&cluster, &other, &role(), &Value::Null)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn malformed_executors_are_refused_without_asking() {
        let cluster = MemoryCluster::new();
        let err = check(&cluster, &executor("User", None), &deployment(), &["get"])
            .await
            .unwrap_err();
        assert!(
            err.message.contains("\"User\" is not supported"),
            "{}",
            err.message
        );
        let err = check(
            &cluster,
            &executor("ServiceAccount", None),
            &deployment(),
            &["get"],
        )
        .await
        .unwrap_err();
        assert!(
            err.message.contains("needs serviceAccount"),
            "{}",
            err.message
        );
        assert!(!err.retryable);
    }
}
