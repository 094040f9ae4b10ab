//! flotilla's spoke agent: dials out to the hub, keeps one session (reconnecting with jittered
//! backoff), and speaks the shared sans-IO protocol from `flotilla-proto`.
//!
//! Not for: anything the hub decides, and it links no hub code: what both ends agree on lives in
//! `flotilla-proto`. The agent opens outbound connections only; it never listens.
#![forbid(unsafe_code)]

pub mod config;
pub mod connect;
pub mod session;

pub use config::AgentConfig;
pub use session::run;
