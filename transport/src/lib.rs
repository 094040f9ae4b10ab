//! How flotilla's processes reach each other: TLS with the ring provider only ([`tls`]), the
//! peer's identity read from its client certificate ([`identity`]), and TLS material written to
//! disk atomically and durably ([`files`]). Used by the hub, the gateways and the agents alike.
//!
//! Not for: anything the session protocol decides (proto's sans-IO machines do), or what a
//! process does with a connection once it has one (gateway and agent drivers).
#![forbid(unsafe_code)]

pub mod files;
pub mod identity;
pub mod tls;
