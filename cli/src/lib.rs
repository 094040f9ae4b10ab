//! flotilla's operator CLI: the `flotilla` binary and what it is made of. `client`, the
//! operator API's HTTPS client with the operator's certificate (the load test and the
//! end-to-end tests drive the hub through it too); `cli`, the argument rules and the objects
//! the commands send (label and taint changes, works and replica sets, large works cut into
//! chunks, kubeconfigs for the proxy front); `table`, the lists as kubectl prints them;
//! `dashboard`, the loopback forwarder of the hub's status page; `decommission`, a cluster's
//! decommission as resumable steps over the operator API.
//!
//! Not for: serving anything to anyone but the operator's own browser. It talks to the hub
//! only through the operator API and links none of the hub, gateway or store, so an operator's
//! machine builds and carries only this crate.
#![forbid(unsafe_code)]

pub mod cli;
pub mod client;
pub mod dashboard;
pub mod decommission;
pub mod table;
