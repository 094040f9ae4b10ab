//! Emulated wide-area links for the load test and the end-to-end tests: a network namespace
//! on this machine whose only way out is a link with the delay, jitter, loss, rate and outages
//! of a [`LinkSpec`] (or a named [`Profile`]: `lan`, `lte`, `congested`, `satellite`,
//! `flapping`), so agents put in it meet the hub over the links edge sites really have.
//!
//! Not for: shaping traffic that leaves this machine, or anything in the product. It needs
//! root, `ip`, `tc`, `nft` and `/dev/net/tun`; everything it makes is named after this
//! process and removed when dropped.

pub mod spec;

pub use spec::{Flap, LinkSpec, Loss, Profile, QueueBound, Rate, SpecError};
