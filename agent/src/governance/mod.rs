//! Governance on the spoke: the agent's evaluator of the Policies the hub delivers to this
//! cluster, in OCM's config-policy-controller's manner.
//!
//! The [`Governor`] is one task. The session hands it each delivered policy
//! ([`GovernorHandle::upsert`]) and each removal ([`GovernorHandle::remove`]); it evaluates
//! every `ConfigurationPolicy` template against the spoke through [`ApplyTarget`] (so the load
//! test's in-memory clusters evaluate for real too), makes the writes `enforce` asks for,
//! applies Gatekeeper and Kyverno templates and reads their engines' verdicts, and sends a
//! [`PolicyReport`] per policy whenever its compliance or a message changes.
//!
//! A file per job: `evaluation` reads, judges (proto's pure evaluator decides) and writes one
//! template, and prunes; `engine_templates` applies a Gatekeeper or Kyverno template and reads
//! its compliance from that engine's reports; `history` keeps each template's compliance history and decides when
//! a report is new; `watches` turns changes on the spoke into evaluations; `governor` is the
//! task and its handle.
//!
//! Bounds: at most [`MAX_POLICIES`] policies, [`MAX_CONCURRENT_EVALUATIONS`] evaluations and
//! [`MAX_CONCURRENT_PRUNES`] prunes at once, [`MAX_WATCHED_KINDS`] kinds watched, [`MAX_LISTED_OBJECTS`] objects per read,
//! [`MAX_HISTORY`] history entries of at most [`MAX_HISTORY_MESSAGE_BYTES`] per template, and
//! one pending report per policy when the consumer lags.
//!
//! [`ApplyTarget`]: crate::apply::ApplyTarget

mod engine_templates;
mod evaluation;
mod governor;
mod history;
mod watches;

pub use evaluation::POLICY_FIELD_MANAGER;
pub use governor::{Governor, GovernorHandle, GovernorStopped};

use flotilla_proto::api::policy::{Policy, PolicyStatus};

/// Most policies one cluster evaluates; more are reported NonCompliant, never evaluated.
pub const MAX_POLICIES: usize = 2_000;
/// Most templates evaluated at the same time: the spoke's apiserver serves the workloads too.
pub const MAX_CONCURRENT_EVALUATIONS: usize = 4;
/// Most removed policies pruned at the same time; the others wait their turn (and their
/// `remove` with them).
pub const MAX_CONCURRENT_PRUNES: usize = 2;
/// Most kinds watched for changes; a template of another kind is evaluated by its interval
/// only.
pub const MAX_WATCHED_KINDS: usize = 32;
/// Most objects one list of the spoke may return; a template matching more is NonCompliant
/// with a message saying so.
pub const MAX_LISTED_OBJECTS: usize = 10_000;
/// Most history entries kept per template, most recent first (OCM keeps 10 too).
pub const MAX_HISTORY: usize = 10;
/// Most bytes of one history message; a longer one is cut at a character boundary.
pub const MAX_HISTORY_MESSAGE_BYTES: usize = 1_024;
/// Reports buffered for the consumer; behind that, only the latest per policy is kept.
pub const REPORT_CHANNEL: usize = 64;

/// A root Policy as the hub delivered it to this cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct DeliveredPolicy {
    /// The root Policy's uid; reports and removals name the policy by it.
    pub uid: String,
    /// The root Policy's generation this delivery carries.
    pub generation: i64,
    /// The policy; its metadata (namespace, name, uid) is the root's.
    pub policy: Policy,
}

/// What goes back to the hub for one policy on this cluster: OCM's cluster copy of a policy
/// status, with only `compliant` and `details[]` set.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyReport {
    /// The root Policy's uid.
    pub uid: String,
    /// The generation evaluated.
    pub generation: i64,
    /// `compliant` (NonCompliant if any template is) and, per template, its compliance and
    /// history (most recent first, at most [`MAX_HISTORY`] entries).
    pub status: PolicyStatus,
}
