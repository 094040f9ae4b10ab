//! Each template's compliance history, and whether a policy's report is new.
//!
//! As OCM records events: a template's history gets an entry only when its compliance or its
//! message changes, most recent first, at most [`MAX_HISTORY`] entries, each message at most
//! [`MAX_HISTORY_MESSAGE_BYTES`]; a report goes out only when it differs from the last one
//! that went out for the policy.

use std::collections::{HashMap, VecDeque};

use flotilla_proto::api::policy::{
    ComplianceHistory, ComplianceState, DetailsPerTemplate, PolicyStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use sha2::{Digest as _, Sha256};

use super::{MAX_HISTORY, MAX_HISTORY_MESSAGE_BYTES};

/// When a result was recorded: the RFC 3339 time and the event name OCM would give it.
#[derive(Clone, Debug)]
pub(crate) struct Stamp {
    pub time: String,
    pub event_name: String,
}

#[derive(Debug, Default)]
struct TemplateRecord {
    compliance: Option<ComplianceState>,
    message: String,
    history: VecDeque<ComplianceHistory>,
}

/// One policy's templates' histories and the last report sent for it.
#[derive(Debug, Default)]
pub(crate) struct PolicyHistory {
    templates: HashMap<String, TemplateRecord>,
    /// The generation and the SHA-256 of the status (its JSON) last sent: a digest, not a
    /// copy, as the templates' histories already hold what the status is made of.
    last_sent: Option<(i64, [u8; 32])>,
}

impl PolicyHistory {
    /// Records `template`'s result; a history entry is added only when the compliance or the
    /// message differs from the last one recorded.
    pub fn record(
        &mut self,
        template: &str,
        compliance: ComplianceState,
        message: &str,
        stamp: &Stamp,
    ) {
        let record = self.templates.entry(template.to_string()).or_default();
        let message = bounded(message);
        if record.compliance == Some(compliance) && record.message == message {
            return;
        }
        let kind = match compliance {
            ComplianceState::Compliant => "notification",
            _ => "violation",
        };
        record.history.push_front(ComplianceHistory {
            last_timestamp: Some(stamp.time.clone()),
            message: format!("{compliance:?}; {kind} - {message}"),
            event_name: stamp.event_name.clone(),
        });
        record.history.truncate(MAX_HISTORY);
        record.compliance = Some(compliance);
        record.message = message;
    }

    /// Forgets the templates not in `names` (the policy no longer carries them).
    pub fn retain(&mut self, names: &[String]) {
        self.templates.retain(|name, _| names.contains(name));
    }

    /// The policy's status over `names`, in that order: NonCompliant if any template is, else
    /// Compliant.
    pub fn status(&self, names: &[String]) -> PolicyStatus {
        let details: Vec<DetailsPerTemplate> = names
            .iter()
            .map(|name| {
                let record = self.templates.get(name);
                DetailsPerTemplate {
                    template_meta: ObjectMeta {
                        name: Some(name.clone()),
                        ..ObjectMeta::default()
                    },
                    compliant: record.and_then(|r| r.compliance),
                    history: record
                        .map(|r| r.history.iter().cloned().collect())
                        .unwrap_or_default(),
                }
            })
            .collect();
        let compliant = if details
            .iter()
            .all(|d| d.compliant == Some(ComplianceState::Compliant))
        {
            ComplianceState::Compliant
        } else {
            ComplianceState::NonCompliant
        };
        PolicyStatus {
            compliant: Some(compliant),
            details,
            ..PolicyStatus::default()
        }
    }

    /// Whether (`generation`, `status`) differs from the last report sent; if so it is now
    /// the last one sent.
    pub fn is_new(&mut self, generation: i64, status: &PolicyStatus) -> bool {
        // A status always serialises (typed, string-keyed); its fields are in a fixed order.
        let mut digest = Sha256::new();
        let _ = serde_json::to_writer(&mut digest, status);
        let sent = (generation, digest.finalize().into());
        if self.last_sent == Some(sent) {
            return false;
        }
        self.last_sent = Some(sent);
        true
    }
}

/// `message` cut to [`MAX_HISTORY_MESSAGE_BYTES`] at a character boundary, saying so.
fn bounded(message: &str) -> String {
    if message.len() <= MAX_HISTORY_MESSAGE_BYTES {
        return message.to_string();
    }
    const MARK: &str = " ... (cut)";
    let mut end = MAX_HISTORY_MESSAGE_BYTES - MARK.len();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{MARK}", &message[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(n: u32) -> Stamp {
        Stamp {
            time: format!("2026-01-01T00:00:{n:02}Z"),
            event_name: format!("default.p.{n:x}"),
        }
    }

    const OK: ComplianceState = ComplianceState::Compliant;
    const BAD: ComplianceState = ComplianceState::NonCompliant;

    #[test]
    fn history_grows_only_when_compliance_or_message_changes() {
        let mut h = PolicyHistory::default();
        let names = vec!["t".to_string()];
        h.record("t", BAD, "namespaces [prod] not found", &stamp(1));
        h.record("t", BAD, "namespaces [prod] not found", &stamp(2));
        h.record("t", OK, "namespaces [prod] found as specified", &stamp(3));
        let status = h.status(&names);
        assert_eq!(status.compliant, Some(OK));
        let history: Vec<&str> = status.details[0]
            .history
            .iter()
            .map(|e| e.message.as_str())
            .collect();
        assert_eq!(
            history,
            [
                "Compliant; notification - namespaces [prod] found as specified",
                "NonCompliant; violation - namespaces [prod] not found",
            ]
        );
        assert_eq!(
            status.details[0].history[1].last_timestamp.as_deref(),
            Some("2026-01-01T00:00:01Z"),
            "the unchanged second result added nothing"
        );
    }

    #[test]
    fn history_and_messages_are_bounded() {
        let mut h = PolicyHistory::default();
        for n in 0..25 {
            h.record("t", BAD, &format!("{n} {}", "é".repeat(2_000)), &stamp(n));
        }
        let status = h.status(&["t".to_string()]);
        let history = &status.details[0].history;
        assert_eq!(history.len(), MAX_HISTORY);
        assert!(
            history[0]
                .message
                .starts_with("NonCompliant; violation - 24 ")
        );
        assert!(history[0].message.ends_with(" ... (cut)"));
        assert!(
            history
                .iter()
                .all(|e| e.message.len() <= MAX_HISTORY_MESSAGE_BYTES + 64)
        );
    }

    #[test]
    fn a_report_is_new_only_when_it_differs_from_the_last_sent() {
        let mut h = PolicyHistory::default();
        let names = vec!["a".to_string(), "b".to_string()];
        h.record("a", OK, "fine", &stamp(1));
        h.record(
            "b",
            BAD,
            "configmaps [cm] not found in namespace default",
            &stamp(1),
        );
        let status = h.status(&names);
        assert_eq!(status.compliant, Some(BAD), "one template is NonCompliant");
        assert!(h.is_new(1, &status));
        assert!(!h.is_new(1, &h.status(&names)));
        assert!(
            h.is_new(2, &h.status(&names)),
            "a new generation is reported"
        );
        h.record("b", OK, "configmaps [cm] found as specified", &stamp(2));
        assert!(h.is_new(2, &h.status(&names)));
        h.retain(&["b".to_string()]);
        assert_eq!(h.status(&["b".to_string()]).compliant, Some(OK));
    }
}
