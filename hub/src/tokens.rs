//! Bootstrap tokens: short-lived, optionally use-limited secrets that let a spoke ask to join
//! (like `kubeadm token` / `clusteradm get token`).
//!
//! A token reads `<id>.<secret>`. The id is public (it names the token in lists, logs and the
//! ManagedCluster's annotation); the secret is shown once, at creation, and only its SHA-256 is
//! stored. Records live with the CA in the hub's data dir (`registration/tokens.json`, mode
//! 0600), whatever the store backend: only the process that holds the CA key redeems tokens,
//! so they sit in the same trust domain and need no CRD on the hub apiserver. A plain SHA-256
//! is enough because the secret is 128 bits of randomness, not a password.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use jiff::Timestamp;
use rand::Rng;
use serde::{Deserialize, Serialize};
use sha2::Digest;
use tokio::sync::Mutex;
use tracing::info;

use crate::ca;

/// Characters of token ids and secrets (lower-case alphanumerics, as kubeadm's).
const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
/// Length of a token id.
pub const ID_LEN: usize = 6;
/// Length of a token secret: 25 characters of 36 symbols, just over 128 bits.
pub const SECRET_LEN: usize = 25;

/// Why a token does not admit a join. Every message names the token by id (never the secret)
/// and the fix; none is retryable with the same token.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// Not of the form `<id>.<secret>`. Not retryable: copy the whole token from the join
    /// command.
    #[error(
        "bootstrap token is malformed: expected <id>.<secret> as printed by `flotilla token create`"
    )]
    Malformed,
    /// No token with this id, or the secret does not match. Not retryable.
    #[error(
        "bootstrap token {id} is not valid for this hub: create one with `flotilla token create`"
    )]
    Unknown { id: String },
    /// Past its expiry. Not retryable: create a new token.
    #[error(
        "bootstrap token {id} expired at {expired}: create a new one with `flotilla token create`"
    )]
    Expired { id: String, expired: Timestamp },
    /// Revoked by an operator. Not retryable: create a new token.
    #[error(
        "bootstrap token {id} was revoked at {revoked}: create a new one with `flotilla token create`"
    )]
    Revoked { id: String, revoked: Timestamp },
    /// Every allowed use is spent. Not retryable: create a new token (`--uses N` for several
    /// clusters).
    #[error(
        "bootstrap token {id} is used up ({uses} of {uses} uses): create a new one with \
         `flotilla token create` (--uses N for several clusters)"
    )]
    UsedUp { id: String, uses: u32 },
    /// The token records could not be read or written. Retryable once the disk is fixed.
    #[error("bootstrap token records at {path}: {detail}")]
    Storage { path: PathBuf, detail: String },
}

/// One stored token. Holds the secret's hash only.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TokenRecord {
    pub id: String,
    /// Hex SHA-256 of the secret.
    secret_sha256: String,
    pub created: Timestamp,
    pub expires: Timestamp,
    /// How many joins the token admits; `None` means any number until it expires.
    pub max_uses: Option<u32>,
    /// Joins it admitted so far.
    pub uses: u32,
    pub revoked: Option<Timestamp>,
    /// Clusters that join with this token are accepted at once (no `flotilla cluster accept`).
    pub auto_accept: bool,
    /// Labels every cluster that joins with this token gets.
    pub labels: BTreeMap<String, String>,
}

impl std::fmt::Debug for TokenRecord {
    // The hash of a 128-bit secret is not a secret, but nothing about it belongs in logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenRecord")
            .field("id", &self.id)
            .field("expires", &self.expires)
            .field("max_uses", &self.max_uses)
            .field("uses", &self.uses)
            .field("revoked", &self.revoked)
            .field("auto_accept", &self.auto_accept)
            .finish_non_exhaustive()
    }
}

impl TokenRecord {
    /// The token's state for lists: `valid`, `expired`, `revoked` or `used up`.
    pub fn state(&self, now: Timestamp) -> &'static str {
        if self.revoked.is_some() {
            "revoked"
        } else if now >= self.expires {
            "expired"
        } else if self.max_uses.is_some_and(|m| self.uses >= m) {
            "used up"
        } else {
            "valid"
        }
    }

    /// Whether the token admits a join now. A re-attach spends nothing, so a token whose last
    /// use admitted this very request still lets its agent come back to it.
    fn check(&self, now: Timestamp, how: Use) -> Result<(), TokenError> {
        let id = self.id.clone();
        if let Some(revoked) = self.revoked {
            return Err(TokenError::Revoked { id, revoked });
        }
        if now >= self.expires {
            return Err(TokenError::Expired {
                id,
                expired: self.expires,
            });
        }
        if let Some(max) = self.max_uses
            && self.uses >= max
            && how == Use::Spend
        {
            return Err(TokenError::UsedUp { id, uses: max });
        }
        Ok(())
    }
}

/// A token as created: the record and the whole token, shown to the operator once.
pub struct CreatedToken {
    pub record: TokenRecord,
    pub token: String,
}

impl std::fmt::Debug for CreatedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreatedToken")
            .field("record", &self.record)
            .field("token", &"<redacted>")
            .finish()
    }
}

/// What a valid token grants a join.
#[derive(Clone, Debug)]
pub struct Grant {
    pub token_id: String,
    pub auto_accept: bool,
    pub labels: BTreeMap<String, String>,
}

/// What to do with a use of the token when it admits a join.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// A new join request: spends one use.
    Spend,
    /// The same agent (same key) re-attaching to its recorded request, e.g. after a hub
    /// restart: validity is checked, nothing is spent.
    Reattach,
}

/// The hub's bootstrap tokens, in `<data-dir>/registration/tokens.json`.
pub struct BootstrapTokens {
    path: PathBuf,
    /// The records; the file is rewritten (atomically) on every change. One writer: this hub.
    records: Mutex<Vec<TokenRecord>>,
}

impl BootstrapTokens {
    /// Loads the records under `data_dir`, starting empty on first use.
    pub fn open(data_dir: &Path) -> Result<BootstrapTokens, TokenError> {
        let path = data_dir.join("registration").join("tokens.json");
        let storage = |detail: String| TokenError::Storage {
            path: path.clone(),
            detail,
        };
        let records = match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| storage(format!("does not parse ({e}); restore or remove it")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(storage(e.to_string())),
        };
        Ok(BootstrapTokens {
            path,
            records: Mutex::new(records),
        })
    }

    /// Creates a token valid for `ttl`, for at most `max_uses` joins (`None`: unlimited).
    pub async fn create(
        &self,
        ttl: Duration,
        max_uses: Option<u32>,
        auto_accept: bool,
        labels: BTreeMap<String, String>,
    ) -> Result<CreatedToken, TokenError> {
        let mut records = self.records.lock().await;
        let mut rng = rand::rng();
        let mut id = random_string(&mut rng, ID_LEN);
        while records.iter().any(|r| r.id == id) {
            id = random_string(&mut rng, ID_LEN);
        }
        let secret = random_string(&mut rng, SECRET_LEN);
        let now = Timestamp::now();
        let expires = now
            .checked_add(jiff::SignedDuration::try_from(ttl).unwrap_or(jiff::SignedDuration::MAX))
            .unwrap_or(Timestamp::MAX);
        let record = TokenRecord {
            max_uses,
            auto_accept,
            labels,
            ..record_of(&id, &secret, now, expires)
        };
        let mut next = records.clone();
        // Forget tokens that expired or were revoked more than a day ago: the list stays short.
        let horizon = now - jiff::SignedDuration::from_hours(24);
        next.retain(|r| r.expires > horizon && r.revoked.is_none_or(|t| t > horizon));
        next.push(record.clone());
        self.save(&next)?;
        *records = next;
        info!(token = %id, expires = %expires, max_uses, auto_accept, "bootstrap token created");
        Ok(CreatedToken {
            record,
            token: format!("{id}.{secret}"),
        })
    }

    /// Every record, newest first.
    pub async fn list(&self) -> Vec<TokenRecord> {
        let mut records = self.records.lock().await.clone();
        records.sort_by_key(|r| std::cmp::Reverse(r.created));
        records
    }

    /// Revokes token `id`: joins with it are refused from now on (clusters that already joined
    /// are not affected). Returns `Ok(false)` if there is no such token.
    pub async fn revoke(&self, id: &str) -> Result<bool, TokenError> {
        let mut records = self.records.lock().await;
        let mut next = records.clone();
        let Some(record) = next.iter_mut().find(|r| r.id == id) else {
            return Ok(false);
        };
        if record.revoked.is_none() {
            record.revoked = Some(Timestamp::now());
        }
        self.save(&next)?;
        *records = next;
        info!(token = %id, "bootstrap token revoked");
        Ok(true)
    }

    /// Checks `token` and, for [`Use::Spend`], spends one use durably before returning.
    pub async fn redeem(&self, token: &str, how: Use) -> Result<Grant, TokenError> {
        let mut records = self.records.lock().await;
        let index = admitting(&records, token, Timestamp::now(), how)?;
        if how == Use::Spend {
            let mut next = records.clone();
            next[index].uses += 1;
            self.save(&next)?;
            *records = next;
        }
        let r = &records[index];
        Ok(Grant {
            token_id: r.id.clone(),
            auto_accept: r.auto_accept,
            labels: r.labels.clone(),
        })
    }

    fn save(&self, records: &[TokenRecord]) -> Result<(), TokenError> {
        let storage = |detail: String| TokenError::Storage {
            path: self.path.clone(),
            detail,
        };
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| storage(e.to_string()))?;
        }
        let text = serde_json::to_string_pretty(records).map_err(|e| storage(e.to_string()))?;
        ca::write(&self.path, &text, true).map_err(|e| storage(e.to_string()))
    }
}

/// The record of `token` if it admits a join at `now`, by its index in `records`.
pub(crate) fn admitting(
    records: &[TokenRecord],
    token: &str,
    now: Timestamp,
    how: Use,
) -> Result<usize, TokenError> {
    let (id, secret) = token.split_once('.').ok_or(TokenError::Malformed)?;
    if id.len() != ID_LEN || secret.is_empty() {
        return Err(TokenError::Malformed);
    }
    let unknown = || TokenError::Unknown { id: id.to_string() };
    let index = records
        .iter()
        .position(|r| r.id == id)
        .ok_or_else(unknown)?;
    // Hashes of a 128-bit random secret: comparing them in variable time leaks nothing an
    // attacker can use to find a preimage.
    if records[index].secret_sha256 != sha256(secret) {
        return Err(unknown());
    }
    records[index].check(now, how)?;
    Ok(index)
}

/// A fresh record for token `<id>.<secret>`: unused, unlimited, nothing granted.
pub(crate) fn record_of(
    id: &str,
    secret: &str,
    created: Timestamp,
    expires: Timestamp,
) -> TokenRecord {
    TokenRecord {
        id: id.to_string(),
        secret_sha256: sha256(secret),
        created,
        expires,
        max_uses: None,
        uses: 0,
        revoked: None,
        auto_accept: false,
        labels: BTreeMap::new(),
    }
}

fn random_string(rng: &mut impl Rng, len: usize) -> String {
    (0..len)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

fn sha256(s: &str) -> String {
    hex::encode(sha2::Sha256::digest(s.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn tokens() -> (tempfile::TempDir, BootstrapTokens) {
        let dir = tempfile::tempdir().unwrap();
        let tokens = BootstrapTokens::open(dir.path()).unwrap();
        (dir, tokens)
    }

    fn hour() -> Duration {
        Duration::from_secs(3600)
    }

    #[tokio::test]
    async fn a_single_use_token_admits_one_join_and_reattaches() {
        let (_dir, tokens) = tokens().await;
        let created = tokens
            .create(hour(), Some(1), false, BTreeMap::new())
            .await
            .unwrap();
        tokens.redeem(&created.token, Use::Spend).await.unwrap();
        tokens.redeem(&created.token, Use::Reattach).await.unwrap();
        let err = tokens
            .redeem(&created.token, Use::Spend)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("used up (1 of 1 uses)"), "{err}");
        assert!(err.contains(&created.record.id) && !err.contains(&created.token));
    }

    #[tokio::test]
    async fn expired_revoked_unknown_and_malformed_tokens_are_refused_by_id() {
        let (dir, tokens) = tokens().await;
        let expired = tokens
            .create(Duration::ZERO, None, false, BTreeMap::new())
            .await
            .unwrap();
        let err = tokens.redeem(&expired.token, Use::Spend).await.unwrap_err();
        assert!(matches!(err, TokenError::Expired { .. }), "{err}");

        let revoked = tokens
            .create(hour(), None, false, BTreeMap::new())
            .await
            .unwrap();
        assert!(tokens.revoke(&revoked.record.id).await.unwrap());
        assert!(!tokens.revoke("nosuch").await.unwrap());
        let err = tokens.redeem(&revoked.token, Use::Spend).await.unwrap_err();
        assert!(err.to_string().contains("was revoked"), "{err}");

        let wrong_secret = format!("{}.{}", revoked.record.id, "x".repeat(SECRET_LEN));
        let err = tokens.redeem(&wrong_secret, Use::Spend).await.unwrap_err();
        assert!(matches!(err, TokenError::Unknown { .. }), "{err}");
        assert!(matches!(
            tokens.redeem("no-dot", Use::Spend).await,
            Err(TokenError::Malformed)
        ));

        // Durable, hashed, private.
        let reopened = BootstrapTokens::open(dir.path()).unwrap();
        assert_eq!(reopened.list().await, tokens.list().await);
        let path = dir.path().join("registration/tokens.json");
        let text = std::fs::read_to_string(&path).unwrap();
        let secret = revoked.token.split_once('.').unwrap().1;
        assert!(!text.contains(secret), "secrets are stored hashed");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(
            !format!("{revoked:?}").contains(secret),
            "Debug never prints it"
        );
    }
}
