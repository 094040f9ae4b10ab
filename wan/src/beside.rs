//! A [`BesideRelay`]: a service on this machine's loopback served inside a link's namespace
//! at the same address, `127.0.0.1:PORT`, without crossing the link. What sits beside an agent
//! at an edge site (its cluster's apiserver) stays beside it while its hub is across the WAN;
//! a client in the namespace keeps the address (and the certificate naming it) it would use on
//! the host.
//!
//! The listener is a socket of the namespace (made with [`EmulatedLink::inside`]); each
//! connection it accepts is copied both ways to a connection this process opens to the host's
//! `127.0.0.1:PORT` from the root namespace. Both ends are loopback: no delay, loss or rate.
//! Made by [`EmulatedLink::serve_beside`].
//!
//! [`EmulatedLink::inside`]: crate::EmulatedLink::inside
//! [`EmulatedLink::serve_beside`]: crate::EmulatedLink::serve_beside

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, warn};

/// The most connections one relay carries at once; more wait in the listener's backlog until
/// one ends.
pub const MAX_RELAYED: usize = 256;
/// How long the relay waits after a failed accept (out of descriptors, say) before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// A relay serving the host's `127.0.0.1:PORT` inside a link's namespace. Dropping it stops
/// the listener and every connection it carries.
pub struct BesideRelay {
    port: u16,
    accepted: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl BesideRelay {
    /// Serves, from `listener` (bound to `127.0.0.1:port` inside a namespace), the host's
    /// `127.0.0.1:port`. Needs a runtime.
    pub(crate) fn start(listener: std::net::TcpListener, port: u16) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        let accepted = Arc::new(AtomicU64::default());
        let accept = tokio::spawn(accept_loop(listener, port, accepted.clone()));
        Ok(BesideRelay {
            port,
            accepted,
            accept,
        })
    }

    /// The port served, the same inside as on the host.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Connections accepted inside so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for BesideRelay {
    fn drop(&mut self) {
        // The connections' tasks are in the accept task's set, aborted as it drops.
        self.accept.abort();
    }
}

async fn accept_loop(listener: TcpListener, port: u16, accepted: Arc<AtomicU64>) {
    let slots = Arc::new(Semaphore::new(MAX_RELAYED));
    let mut connections = JoinSet::new();
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        tokio::select! {
            conn = listener.accept() => match conn {
                Ok((inside, _)) => {
                    accepted.fetch_add(1, Ordering::Relaxed);
                    connections.spawn(relay(inside, port, slot));
                }
                Err(e) => {
                    warn!(port, error = %e, "accepting a connection to relay beside the link failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            },
            // Reaps the tasks of connections that ended; their slots are free already.
            Some(_) = connections.join_next() => {}
        }
    }
}

/// One connection accepted inside, copied both ways to a new one to the host's loopback.
async fn relay(mut inside: TcpStream, port: u16, _slot: OwnedSemaphorePermit) {
    let mut host = match TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await {
        Ok(host) => host,
        Err(e) => {
            // The client sees its connection closed, as if the service had refused it.
            debug!(port, error = %e, "the host's service beside the link refused a relayed connection");
            return;
        }
    };
    // Small requests (an apiserver's) go out at once, as they would on loopback.
    let _ = inside.set_nodelay(true);
    let _ = host.set_nodelay(true);
    if let Err(e) = tokio::io::copy_bidirectional(&mut inside, &mut host).await {
        debug!(port, error = %e, "a connection relayed beside the link ended with an error");
    }
}
