//! The agents' listening sockets: TCP for the gRPC carrier and UDP for QUIC, on the same
//! address and port, so one name and one port (and one load-balancer rule per protocol) reach
//! a gateway whichever carrier an agent uses.

use std::net::SocketAddr;

use tokio::net::TcpListener;

/// Tries when port 0 is asked for and the TCP port the kernel picked is taken for UDP.
const BIND_ATTEMPTS: usize = 16;

/// Connections the kernel completes and keeps for the gateway to accept: a reconnect herd
/// waits here while the gateway loads its shards (see `crate::gate`) or while every handshake
/// slot is taken. The kernel caps it at `net.core.somaxconn` (4,096 by default since Linux
/// 5.4); beyond it new SYNs wait for the client's retransmission.
pub const ACCEPT_BACKLOG: u32 = 4096;

/// A TCP listener on `addr` with [`ACCEPT_BACKLOG`] (tokio's `bind` asks for 1,024).
pub fn tcp_listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    // As `TcpListener::bind` does: a restarted gateway rebinds its port at once.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(ACCEPT_BACKLOG)
}

/// The agents' sockets on one address and port.
#[derive(Debug)]
pub struct AgentSockets {
    pub tcp: TcpListener,
    /// `None` when QUIC is off.
    pub udp: Option<std::net::UdpSocket>,
}

impl AgentSockets {
    /// Binds TCP on `addr` and, with `quic`, UDP on the same address and port. With port 0 the
    /// kernel picks a TCP port, and the UDP socket takes the same one (tried again with
    /// another port if that one is taken for UDP).
    pub async fn bind(addr: SocketAddr, quic: bool) -> std::io::Result<AgentSockets> {
        let mut last = None;
        for _ in 0..BIND_ATTEMPTS {
            let tcp = tcp_listener(addr)?;
            if !quic {
                return Ok(AgentSockets { tcp, udp: None });
            }
            let bound = tcp.local_addr()?;
            match std::net::UdpSocket::bind(bound) {
                Ok(udp) => {
                    return Ok(AgentSockets {
                        tcp,
                        udp: Some(udp),
                    });
                }
                // Port 0: another port may be free for both.
                Err(e) if addr.port() == 0 => last = Some(e),
                Err(e) => {
                    return Err(std::io::Error::new(
                        e.kind(),
                        format!("UDP port {bound} for QUIC: {e} (or turn QUIC off)"),
                    ));
                }
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("no port free for both TCP and UDP")))
    }

    /// The bound address (TCP and UDP alike).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tcp_and_udp_share_the_port() {
        let sockets = AgentSockets::bind("127.0.0.1:0".parse().unwrap(), true)
            .await
            .unwrap();
        let tcp = sockets.tcp.local_addr().unwrap();
        assert_ne!(tcp.port(), 0);
        assert_eq!(sockets.udp.unwrap().local_addr().unwrap(), tcp);
    }
}
