//! Turning a TCP connection away before any TLS: what the gateway writes, in the clear, on a
//! connection over its new-session rate, and how the agent tells it from a TLS answer.
//!
//! The gateway reads what the agent sent first (its ClientHello, never parsed), writes one
//! line, [`notice`], and closes: no certificate is checked, no key exchanged, so a herd over
//! the rate costs the gateway an accept and two small writes per connection instead of a
//! handshake each. The line's first byte, `F`, is no TLS record's content type (20 to 24), so
//! the agent's side ([`Sniffed`], under its TLS client) decides from the first byte the gateway
//! sends whether it is a TLS answer, handed on untouched, or a notice, turned into a
//! [`TurnedAway`] error carrying the retry-after: the agent comes back then, as after a drain.
//!
//! The notice is not authenticated: anything on the path could forge one, as it could drop the
//! connection. A forged one delays an agent by at most [`MAX_RETRY_AFTER`].

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio::net::TcpStream;

/// The notice up to its number of milliseconds.
const PREFIX: &[u8] = b"FLOTILLA-OVER-RATE retry-after-ms=";
/// Longest notice read: the prefix, a `u64` in decimal and the newline.
const MAX_NOTICE: usize = 64;
/// Longest retry-after an agent takes from a notice (a longer one is cut to it).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);
/// How long the gateway spends on one connection it turns away: reading the agent's first
/// bytes, writing the notice, and waiting for the agent to close.
pub const TURN_AWAY_TIMEOUT: Duration = Duration::from_secs(2);

/// The line a gateway writes on a connection it turns away, telling the agent to come back
/// after `retry_after`.
pub fn notice(retry_after: Duration) -> Vec<u8> {
    let mut line = PREFIX.to_vec();
    line.extend_from_slice(retry_after.as_millis().to_string().as_bytes());
    line.push(b'\n');
    line
}

/// The retry-after of a notice (its bytes up to the newline, or all of them), at most
/// [`MAX_RETRY_AFTER`]; `None` if it is not one.
pub fn parse(line: &[u8]) -> Option<Duration> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let digits = line.strip_prefix(PREFIX)?;
    if digits.is_empty() || digits.len() > 20 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let ms: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(Duration::from_millis(ms).min(MAX_RETRY_AFTER))
}

/// The gateway turned the connection away before TLS: it is over its new-session rate, and
/// the agent is to come back after `retry_after`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the gateway is over its new-session rate and turned the connection away before TLS; come back after {retry_after:?}"
)]
pub struct TurnedAway {
    pub retry_after: Duration,
}

/// The gateway's side: reads the agent's first bytes (left unread, closing would reset the
/// connection and could destroy the notice before the agent reads it), writes the notice,
/// closes its side and waits for the agent to close; all within [`TURN_AWAY_TIMEOUT`].
pub async fn turn_away(mut tcp: TcpStream, retry_after: Duration) {
    let _ = tokio::time::timeout(TURN_AWAY_TIMEOUT, async {
        let mut scratch = [0u8; 4096];
        let _ = tcp.read(&mut scratch).await?;
        tcp.write_all(&notice(retry_after)).await?;
        tcp.shutdown().await?;
        while tcp.read(&mut scratch).await? > 0 {}
        Ok::<_, io::Error>(())
    })
    .await;
}

/// The agent's TCP stream before TLS, checking the gateway's first bytes for a notice: a TLS
/// answer passes through untouched; a notice becomes a read error carrying [`TurnedAway`]
/// (bytes that are neither: an `InvalidData` error naming them).
pub struct Sniffed<S> {
    inner: S,
    /// What the gateway sent first, while it may still be a notice.
    head: Vec<u8>,
    /// Whether the first bytes were a TLS answer: then `head` is handed on, then `inner`.
    tls: bool,
}

impl<S> Sniffed<S> {
    pub fn new(inner: S) -> Sniffed<S> {
        Sniffed {
            inner,
            head: Vec::new(),
            tls: false,
        }
    }
}

/// What the gateway's first bytes say, once enough of them arrived.
fn judge(head: &[u8], ended: bool) -> Option<io::Result<()>> {
    let first = *head.first()?;
    if first != PREFIX[0] {
        return Some(Ok(()));
    }
    let line_done = head.contains(&b'\n') || head.len() >= MAX_NOTICE || ended;
    if !line_done {
        return None;
    }
    let end = head.iter().position(|b| *b == b'\n').unwrap_or(head.len());
    Some(Err(match parse(&head[..end]) {
        Some(retry_after) => io::Error::other(TurnedAway { retry_after }),
        None => io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the hub answered with {:?}, neither TLS nor a flotilla gateway's notice: is the address a flotilla hub?",
                String::from_utf8_lossy(&head[..end.min(MAX_NOTICE)])
            ),
        ),
    }))
}

impl<S: AsyncRead + Unpin> AsyncRead for Sniffed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.tls {
                if !this.head.is_empty() {
                    let n = this.head.len().min(buf.remaining());
                    buf.put_slice(&this.head[..n]);
                    this.head.drain(..n);
                    return Poll::Ready(Ok(()));
                }
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            let mut chunk = [0u8; MAX_NOTICE];
            let mut read = ReadBuf::new(&mut chunk);
            std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            let got = read.filled();
            let ended = got.is_empty();
            if ended && this.head.is_empty() {
                // Closed before a byte: the caller's TLS reports it as it would.
                this.tls = true;
                return Poll::Ready(Ok(()));
            }
            this.head.extend_from_slice(got);
            match judge(&this.head, ended) {
                None => continue,
                Some(Ok(())) => this.tls = true,
                Some(Err(e)) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Sniffed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notice_round_trips_and_anything_else_is_none() {
        let d = Duration::from_millis(1_234);
        assert_eq!(parse(&notice(d)), Some(d));
        assert_eq!(
            parse(&notice(Duration::from_secs(86_400))),
            Some(MAX_RETRY_AFTER),
            "cut to the bound"
        );
        for bad in [
            &b"FLOTILLA-OVER-RATE retry-after-ms=\n"[..],
            b"FLOTILLA-OVER-RATE retry-after-ms=12x\n",
            b"FLOTILLA-OVER-RATE retry-after-ms=99999999999999999999999\n",
            b"HTTP/1.1 400 Bad Request\r\n",
        ] {
            assert_eq!(parse(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    /// Real sockets: the gateway's side turns the connection away after reading a fake
    /// ClientHello; the agent's side reads the notice as [`TurnedAway`]. A TLS-looking answer
    /// passes through byte for byte, and a line that only starts as a notice does is named in
    /// the error.
    #[tokio::test]
    async fn the_agent_reads_a_notice_as_turned_away_and_tls_as_it_came() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Each connection is closed by its side once done with it.
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            turn_away(tcp, Duration::from_millis(2_500)).await;
            let (mut tcp, _) = listener.accept().await.unwrap();
            tcp.write_all(&[0x16, 0x03, 0x03, 0x00, 0x01, 0x02])
                .await
                .unwrap();
            drop(tcp);
            let (mut tcp, _) = listener.accept().await.unwrap();
            tcp.write_all(b"FORBIDDEN by the firewall\n").await.unwrap();
        });

        let mut agent = Sniffed::new(TcpStream::connect(addr).await.unwrap());
        agent.write_all(&[0x16; 1500]).await.unwrap();
        let mut buf = [0u8; 16];
        let e = agent.read(&mut buf).await.unwrap_err();
        drop(agent);
        let turned = e
            .get_ref()
            .and_then(|e| e.downcast_ref::<TurnedAway>())
            .copied();
        assert_eq!(
            turned,
            Some(TurnedAway {
                retry_after: Duration::from_millis(2_500)
            }),
            "{e}"
        );

        let mut agent = Sniffed::new(TcpStream::connect(addr).await.unwrap());
        let mut got = Vec::new();
        agent.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, [0x16, 0x03, 0x03, 0x00, 0x01, 0x02]);
        drop(agent);

        let mut agent = Sniffed::new(TcpStream::connect(addr).await.unwrap());
        let e = agent.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("FORBIDDEN by the firewall"), "{e}");
        server.await.unwrap();
    }
}
