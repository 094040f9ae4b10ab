//! TLS 1.3 session tickets for the agents' listeners, under keys that outlive the process.
//!
//! A reconnecting agent that presents a ticket resumes its session's TLS state: the handshake
//! still runs an ephemeral X25519 exchange (rustls resumes only with `psk_dhe_ke`, so the new
//! connection's traffic keys stay forward secret) but neither end signs or verifies a
//! certificate, which is most of a full handshake's CPU on both ends. That is what a storm
//! (every agent of a restarted gateway dialling at once) spends its first seconds on.
//!
//! The keys are derived from a secret the listener already has across restarts (the gateway's
//! serving key, the hub's CA key) and from the client roots it trusts, so a gateway restarted
//! in place accepts the tickets its previous run issued, and a change of trust (a CA rotation)
//! makes every earlier ticket worthless. Keys roll daily: a ticket is sealed under its day's
//! key and opens for [`TICKET_DAYS`] days more, the lifetime clients are told; the keys of
//! older days are never derived again.
//!
//! What a ticket vouches for: the client certificate the full handshake verified (rustls keeps
//! the chain in the ticket and restores it on resumption), so a resumed connection has the
//! same [`Peer`](crate::identity::Peer) and key digest as the one it resumes, and the gateway
//! checks that key against the cluster's registered keys as for any connection. A ticket is at
//! most [`TICKET_DAYS`] days old; an agent drops its tickets when its certificate changes.
//! Anyone holding the listener's secret can mint tickets, as they could already impersonate
//! the listener.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::counter::Counter;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hmac;
use ring::rand::{SecureRandom as _, SystemRandom};

/// How many days after the day it was issued a ticket still opens (and the lifetime clients
/// are told, in seconds): the most TLS 1.3 allows.
pub const TICKET_DAYS: u64 = 7;
const DAY_SECS: u64 = 24 * 60 * 60;
/// The day a ticket was sealed, in the clear before its nonce (and authenticated as its AAD).
const DAY_LEN: usize = 8;
const TAG_LEN: usize = 16;

/// The secret session tickets are derived from; see the module's documentation.
#[derive(Clone)]
pub struct TicketKeys {
    base: hmac::Key,
    /// Tickets that opened: agents' handshakes resumed instead of run in full.
    opened: Counter,
}

impl TicketKeys {
    /// The ticket keys of `secret` (HMAC-SHA256 under their own label: nothing else derived
    /// from the same secret, such as the QUIC reset key, can be computed from them).
    pub fn derived_from(secret: &[u8]) -> TicketKeys {
        let secret = hmac::Key::new(hmac::HMAC_SHA256, secret);
        let base = hmac::sign(&secret, b"flotilla TLS session ticket keys v1");
        TicketKeys {
            base: hmac::Key::new(hmac::HMAC_SHA256, base.as_ref()),
            opened: Counter::default(),
        }
    }

    /// The count of tickets that opened (handshakes resumed), for `/metrics`.
    pub fn opened(&self) -> Counter {
        self.opened.clone()
    }

    /// Counts every ticket that opens (a handshake about to resume) into `opened`.
    pub fn counted(mut self, opened: Counter) -> TicketKeys {
        self.opened = opened;
        self
    }

    /// Keys of this process alone (tests, and listeners nothing restarts in place).
    pub fn random() -> TicketKeys {
        let mut secret = [0u8; 32];
        SystemRandom::new()
            .fill(&mut secret)
            .expect("the system's random source works");
        TicketKeys::derived_from(&secret)
    }

    /// The ticketer of a listener trusting the client roots `trust_pem`: tickets issued under
    /// other roots do not open.
    pub(crate) fn ticketer(&self, trust_pem: &[u8]) -> Arc<Ticketer> {
        let digest = ring::digest::digest(&ring::digest::SHA256, trust_pem);
        let mut label = b"trust ".to_vec();
        label.extend_from_slice(digest.as_ref());
        let key = hmac::sign(&self.base, &label);
        Arc::new(Ticketer {
            key: hmac::Key::new(hmac::HMAC_SHA256, key.as_ref()),
            random: SystemRandom::new(),
            opened: self.opened.clone(),
        })
    }
}

impl std::fmt::Debug for TicketKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TicketKeys(<redacted>)")
    }
}

/// Seals and opens tickets for rustls ([`rustls::server::ProducesTickets`]).
pub(crate) struct Ticketer {
    key: hmac::Key,
    random: SystemRandom,
    opened: Counter,
}

impl Ticketer {
    /// The AEAD key of `day` (days since the Unix epoch).
    fn key_of(&self, day: u64) -> LessSafeKey {
        let key = hmac::sign(&self.key, &day.to_be_bytes());
        LessSafeKey::new(
            UnboundKey::new(&AES_256_GCM, key.as_ref()).expect("HMAC-SHA256 is 32 bytes"),
        )
    }

    /// `plain` sealed under `day`'s key: the day, a random nonce, the ciphertext and its tag.
    fn seal(&self, day: u64, plain: &[u8]) -> Option<Vec<u8>> {
        let mut nonce = [0u8; NONCE_LEN];
        self.random.fill(&mut nonce).ok()?;
        let mut ticket = Vec::with_capacity(DAY_LEN + NONCE_LEN + plain.len() + TAG_LEN);
        ticket.extend_from_slice(&day.to_be_bytes());
        ticket.extend_from_slice(&nonce);
        let mut sealed = plain.to_vec();
        self.key_of(day)
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(day.to_be_bytes()),
                &mut sealed,
            )
            .ok()?;
        ticket.extend_from_slice(&sealed);
        Some(ticket)
    }

    /// What `ticket` holds, if it was sealed by this ticketer on a day that still opens on
    /// `today`. `ticket` comes from the network: nothing in it is trusted before its tag is.
    fn open(&self, today: u64, ticket: &[u8]) -> Option<Vec<u8>> {
        if ticket.len() < DAY_LEN + NONCE_LEN + TAG_LEN {
            return None;
        }
        let (day, rest) = ticket.split_at(DAY_LEN);
        let (nonce, sealed) = rest.split_at(NONCE_LEN);
        let day = u64::from_be_bytes(day.try_into().ok()?);
        if day > today || today - day > TICKET_DAYS {
            return None;
        }
        let mut plain = sealed.to_vec();
        let opened = self
            .key_of(day)
            .open_in_place(
                Nonce::try_assume_unique_for_key(nonce).ok()?,
                Aad::from(day.to_be_bytes()),
                &mut plain,
            )
            .ok()?
            .len();
        plain.truncate(opened);
        Some(plain)
    }
}

fn today() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / DAY_SECS)
}

impl std::fmt::Debug for Ticketer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ticketer(<redacted>)")
    }
}

impl rustls::server::ProducesTickets for Ticketer {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        (TICKET_DAYS * DAY_SECS) as u32
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        self.seal(today(), plain)
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        let plain = self.open(today(), cipher)?;
        self.opened.inc();
        Some(plain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRUST: &[u8] = b"-----BEGIN CERTIFICATE----- the hub CA";

    #[test]
    fn a_ticket_opens_under_the_same_secret_and_trust_for_its_days_and_no_longer() {
        let plain = b"resumption secret and the client's certificate chain";
        let issued = TicketKeys::derived_from(b"serving key").ticketer(TRUST);
        let ticket = issued.seal(20_000, plain).unwrap();
        assert!(!ticket.windows(plain.len()).any(|w| w == plain), "sealed");

        // A process restarted with the same secret and roots opens it, for its days.
        let restarted = TicketKeys::derived_from(b"serving key").ticketer(TRUST);
        for today in 20_000..=20_000 + TICKET_DAYS {
            assert_eq!(
                restarted.open(today, &ticket).as_deref(),
                Some(&plain[..]),
                "day {today}"
            );
        }
        assert_eq!(
            restarted.open(20_000 + TICKET_DAYS + 1, &ticket),
            None,
            "expired"
        );
        assert_eq!(restarted.open(19_999, &ticket), None, "from the future");

        // Another secret, other roots (a CA rotation): never.
        let other = TicketKeys::derived_from(b"another key").ticketer(TRUST);
        assert_eq!(other.open(20_000, &ticket), None);
        let rotated = TicketKeys::derived_from(b"serving key").ticketer(b"the new CA bundle");
        assert_eq!(rotated.open(20_000, &ticket), None);
    }

    #[test]
    fn a_ticket_altered_anywhere_or_cut_short_does_not_open() {
        let ticketer = TicketKeys::random().ticketer(TRUST);
        let ticket = ticketer.seal(20_000, b"session").unwrap();
        for at in 0..ticket.len() {
            let mut altered = ticket.clone();
            altered[at] ^= 0x01;
            assert_eq!(ticketer.open(20_000, &altered), None, "byte {at} altered");
        }
        for len in 0..ticket.len() {
            assert_eq!(ticketer.open(20_000, &ticket[..len]), None, "cut to {len}");
        }
        // Moving a ticket to another day (its key and AAD) does not open it either.
        let mut moved = ticket.clone();
        moved[..DAY_LEN].copy_from_slice(&20_001u64.to_be_bytes());
        assert_eq!(ticketer.open(20_001, &moved), None);
    }

    #[test]
    fn two_tickets_of_one_session_do_not_share_a_nonce() {
        let ticketer = TicketKeys::random().ticketer(TRUST);
        let a = ticketer.seal(20_000, b"same").unwrap();
        let b = ticketer.seal(20_000, b"same").unwrap();
        assert_ne!(a, b);
    }
}
