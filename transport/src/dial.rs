//! TCP to the hub: directly, from a chosen source address if asked, or through an HTTP forward
//! proxy (`CONNECT host:port`, then the agent's own TLS and mTLS end to end inside the tunnel,
//! so the proxy sees only ciphertext and the hub still authenticates the agent's certificate).

use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// Largest proxy response header the agent reads before giving up on the proxy.
const MAX_RESPONSE_HEADER: usize = 8 * 1024;

/// An `http://host:port` forward proxy (`--proxy-url`).
#[derive(Clone, PartialEq, Eq)]
pub struct ProxyUrl {
    /// host:port of the proxy.
    authority: String,
}

impl fmt::Debug for ProxyUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}", self.authority)
    }
}

impl fmt::Display for ProxyUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}", self.authority)
    }
}

/// Why a proxy URL is unusable; none is retryable without a new `--proxy-url`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProxyUrlError {
    /// Only plain-HTTP forward proxies that support CONNECT are spoken.
    #[error("--proxy-url {0:?}: only http://host:port forward proxies are supported")]
    Scheme(String),
    /// Credentials in the URL would end up in process listings and logs.
    #[error(
        "--proxy-url: credentials in the URL are not supported (they would show in process listings); use a proxy that admits the spoke by address"
    )]
    Credentials,
    /// No port: proxies have no well-known one.
    #[error("--proxy-url {0:?}: give host:port")]
    NoPort(String),
}

impl std::str::FromStr for ProxyUrl {
    type Err = ProxyUrlError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rest = s
            .strip_prefix("http://")
            .ok_or_else(|| ProxyUrlError::Scheme(s.to_string()))?;
        let authority = rest.trim_end_matches('/');
        if authority.contains('@') {
            return Err(ProxyUrlError::Credentials);
        }
        if authority.is_empty() || authority.contains('/') || !authority.contains(':') {
            return Err(ProxyUrlError::NoPort(s.to_string()));
        }
        Ok(ProxyUrl {
            authority: authority.to_string(),
        })
    }
}

/// A forward proxy in the way, carried inside the `io::Error` of [`dial`] (find it with
/// `get_ref()` and `downcast_ref`), so that callers can say it was the proxy.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The proxy itself cannot be reached. Retryable.
    #[error("cannot reach the proxy {proxy}: {source}")]
    Unreachable {
        proxy: String,
        #[source]
        source: io::Error,
    },
    /// The proxy answered CONNECT with something other than 200. Not retryable until the
    /// proxy's rules change.
    #[error(
        "proxy {proxy} refused CONNECT {target}: {status_line:?} (does it allow this client and this port?)"
    )]
    Refused {
        proxy: String,
        target: String,
        status_line: String,
    },
}

/// Opens a TCP stream to `target` (host:port): directly, or through `proxy` with HTTP CONNECT;
/// from `local` (any port) when given. Errors say which hop failed.
pub async fn dial(
    target: &str,
    proxy: Option<&ProxyUrl>,
    local: Option<IpAddr>,
) -> io::Result<TcpStream> {
    let Some(proxy) = proxy else {
        return connect(target, local).await;
    };
    let mut tcp = connect(&proxy.authority, local).await.map_err(|source| {
        io::Error::new(
            source.kind(),
            ProxyError::Unreachable {
                proxy: proxy.to_string(),
                source,
            },
        )
    })?;
    let request = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    tcp.write_all(request.as_bytes()).await?;
    // Byte by byte up to the blank line: after a 200 the proxy sends nothing until the client
    // speaks (its TLS hello), so nothing of the tunnel can be read by mistake.
    let mut header = Vec::with_capacity(256);
    let mut byte = [0u8; 1];
    while !header.ends_with(b"\r\n\r\n") {
        if header.len() >= MAX_RESPONSE_HEADER {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("proxy {proxy} sent a response header over {MAX_RESPONSE_HEADER} bytes"),
            ));
        }
        if tcp.read(&mut byte).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("proxy {proxy} closed the connection during CONNECT {target}"),
            ));
        }
        header.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&header);
    let status_line = text.lines().next().unwrap_or("").trim().to_string();
    let code = status_line.split_whitespace().nth(1).unwrap_or("");
    if code != "200" {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            ProxyError::Refused {
                proxy: proxy.to_string(),
                target: target.to_string(),
                status_line,
            },
        ));
    }
    Ok(tcp)
}

/// One TCP connection to `address` (host:port), with Nagle off; bound to `local` when given,
/// trying each of the host's addresses of the same family in turn.
async fn connect(address: &str, local: Option<IpAddr>) -> io::Result<TcpStream> {
    let tcp = match local {
        None => TcpStream::connect(address).await?,
        Some(local) => {
            let mut last = None;
            let mut connected = None;
            for remote in tokio::net::lookup_host(address).await? {
                if remote.is_ipv4() != local.is_ipv4() {
                    continue;
                }
                let socket = if local.is_ipv4() {
                    TcpSocket::new_v4()?
                } else {
                    TcpSocket::new_v6()?
                };
                socket.bind(SocketAddr::new(local, 0))?;
                match socket.connect(remote).await {
                    Ok(tcp) => {
                        connected = Some(tcp);
                        break;
                    }
                    Err(e) => last = Some(e),
                }
            }
            match connected {
                Some(tcp) => tcp,
                None => {
                    return Err(last.unwrap_or_else(|| {
                        io::Error::new(
                            io::ErrorKind::AddrNotAvailable,
                            format!("{address} has no address of the same family as {local}"),
                        )
                    }));
                }
            }
        }
    };
    tcp.set_nodelay(true)?;
    Ok(tcp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_urls() {
        let ok: ProxyUrl = "http://127.0.0.1:3128/".parse().unwrap();
        assert_eq!(ok.to_string(), "http://127.0.0.1:3128");
        for (bad, want) in [
            ("https://p:1", ProxyUrlError::Scheme("https://p:1".into())),
            ("http://u:pw@p:1", ProxyUrlError::Credentials),
            ("http://p", ProxyUrlError::NoPort("http://p".into())),
        ] {
            assert_eq!(bad.parse::<ProxyUrl>().unwrap_err(), want, "{bad}");
        }
    }

    #[tokio::test]
    async fn a_local_address_is_the_source_the_hub_sees() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = listener.local_addr().unwrap().to_string();
        let source: IpAddr = "127.0.0.3".parse().unwrap();
        let (dialled, accepted) =
            tokio::join!(dial(&target, None, Some(source)), listener.accept());
        dialled.unwrap();
        assert_eq!(accepted.unwrap().1.ip(), source);

        let v6: IpAddr = "::1".parse().unwrap();
        let err = dial(&target, None, Some(v6)).await.unwrap_err();
        assert!(err.to_string().contains("same family as ::1"), "{err}");
    }
}
