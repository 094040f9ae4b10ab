//! Raw byte relays between two connections: what an upgraded tunnel (kubectl exec, attach,
//! port-forward over WebSocket or SPDY) becomes once both ends have switched protocols, on the
//! hub's proxy front (user to tunnel) and on the agent (tunnel to spoke apiserver) alike.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tracing::debug;

/// Copies bytes both ways, each direction on its own so a peer that stops reading one way
/// never stalls the other, until both sides have finished or nothing has moved either way for
/// `idle`. A side's clean end half-closes the other side's writing; a side that breaks
/// (reading it fails) ends the relay at once with no clean close on the other side, so a cut
/// stream never looks complete to the far end. Returns the bytes copied each way (a to b, b
/// to a).
pub async fn relay_bytes<A, B>(a: A, b: B, idle: Duration) -> (u64, u64)
where
    A: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send,
    B: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send,
{
    let (a_read, a_write) = tokio::io::split(a);
    let (b_read, b_write) = tokio::io::split(b);
    let moved = tokio::sync::Notify::new();
    let (a_to_b, b_to_a) = (AtomicU64::new(0), AtomicU64::new(0));
    let both = futures::future::try_join(
        copy_one_way(a_read, b_write, &moved, &a_to_b),
        copy_one_way(b_read, a_write, &moved, &b_to_a),
    );
    let watchdog = async {
        while tokio::time::timeout(idle, moved.notified()).await.is_ok() {}
        debug!(?idle, "upgraded stream idle; closing it");
    };
    tokio::select! {
        _ = both => {}
        _ = watchdog => {}
    }
    (a_to_b.into_inner(), b_to_a.into_inner())
}

/// Copies `from` to `to` until `from` ends or `to` fails, then half-closes `to`. Reading
/// `from` failing is an error, with `to` left as it is.
async fn copy_one_way<R, W>(
    mut from: R,
    mut to: W,
    moved: &tokio::sync::Notify,
    count: &AtomicU64,
) -> std::io::Result<()>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; RELAY_CHUNK];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => {
                debug!(error = %e, "upgraded stream broke; cutting the other side");
                return Err(e);
            }
        };
        if to.write_all(&buf[..n]).await.is_err() || to.flush().await.is_err() {
            break;
        }
        count.fetch_add(n as u64, Ordering::Relaxed);
        moved.notify_one();
    }
    let _ = to.shutdown().await;
    Ok(())
}

/// Bytes read at once by a relay direction.
const RELAY_CHUNK: usize = 32 * 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    #[tokio::test]
    async fn bytes_cross_both_ways_intact_and_each_end_closes_the_other() {
        let (user, hub_side) = tokio::io::duplex(64);
        let (agent_side, mut spoke) = tokio::io::duplex(64);
        let relay = tokio::spawn(relay_bytes(hub_side, agent_side, Duration::from_secs(60)));
        let (mut user_read, mut user_write) = tokio::io::split(user);
        let up: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let writer = {
            let up = up.clone();
            tokio::spawn(async move {
                user_write.write_all(&up).await.unwrap();
                user_write.shutdown().await.unwrap();
            })
        };
        let mut got = Vec::new();
        spoke.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, up);
        spoke.write_all(b"exit 0").await.unwrap();
        spoke.shutdown().await.unwrap();
        let mut back = Vec::new();
        user_read.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"exit 0");
        writer.await.unwrap();
        assert_eq!(relay.await.unwrap(), (100_000, 6));
    }

    /// Reads `data`, then fails as a connection reset would.
    struct Breaks(std::io::Cursor<Vec<u8>>);

    impl tokio::io::AsyncRead for Breaks {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            if self.0.position() as usize == self.0.get_ref().len() {
                return std::task::Poll::Ready(Err(std::io::ErrorKind::ConnectionReset.into()));
            }
            std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
        }
    }

    impl tokio::io::AsyncWrite for Breaks {
        fn poll_write(
            self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::task::Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_side_that_breaks_is_never_passed_on_as_a_clean_end() {
        let (user, hub_side) = tokio::io::duplex(1024);
        let agent_side = Breaks(std::io::Cursor::new(b"partial output".to_vec()));
        // The user keeps its writing side open, as an interactive exec does.
        let relay = tokio::spawn(relay_bytes(hub_side, agent_side, Duration::from_secs(60)));
        let (mut user_read, _user_write) = tokio::io::split(user);
        let mut got = vec![0u8; 14];
        user_read.read_exact(&mut got).await.unwrap();
        assert_eq!(got, b"partial output");
        // The relay ends without waiting for the user (whose idle timeout is a minute away)
        // and drops the user's side, never shutting it down cleanly (a duplex reports both
        // as end of stream; over TLS the user sees the connection cut).
        let moved = tokio::time::timeout(Duration::from_secs(10), relay)
            .await
            .expect("the relay ended when its other side broke")
            .unwrap();
        assert_eq!(moved, (0, 14));
        let mut rest = Vec::new();
        user_read.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_relay_is_closed() {
        let (_user, hub_side) = tokio::io::duplex(64);
        let (agent_side, _spoke) = tokio::io::duplex(64);
        // Neither end sends: the idle timeout ends the relay (time is paused and auto-advances).
        assert_eq!(
            relay_bytes(hub_side, agent_side, Duration::from_secs(5)).await,
            (0, 0)
        );
    }
}
