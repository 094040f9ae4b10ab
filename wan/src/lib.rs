//! Emulated wide-area links for the load test and the end-to-end tests: a network namespace
//! on this machine whose only way out is a link with the delay, jitter, loss, rate and outages
//! of a [`LinkSpec`] (or a named [`Profile`]: `lan`, `lte`, `congested`, `satellite`,
//! `flapping`), so agents put in it meet the hub over the links edge sites really have.
//!
//! * [`spec`]: what a link is asked to be, parsed and validated.
//! * [`checksum`]: UDP checksums put right as packets enter a delay line.
//! * [`delay_line`]: one direction's hold (delay ± jitter, order, bound), without IO.
//! * [`emulator`]: the namespace, the TUN pair, the qdiscs and rules; the packet path is in
//!   its doc.
//! * [`probe`]: a ping-like UDP probe and a bulk TCP transfer across a link.
//! * [`beside`]: a host's loopback service served inside a namespace without crossing its
//!   link (an agent's cluster apiserver, beside it at the edge site).
//!
//! Not for: shaping traffic that leaves this machine, or anything in the product. It needs
//! root, `ip`, `tc`, `nft` and `/dev/net/tun`; everything it makes is named after this
//! process and removed when dropped.

pub mod beside;
pub mod checksum;
pub mod delay_line;
pub mod emulator;
pub mod probe;
pub mod spec;

pub use beside::BesideRelay;
pub use emulator::{EmulatedLink, LinkError, NamespaceRuntime, check_available};
pub use spec::{Flap, LinkSpec, Loss, Profile, QueueBound, Rate, SpecError};
