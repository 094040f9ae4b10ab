//! Raw byte relays between two connections: what an upgraded tunnel (kubectl exec, attach,
//! port-forward over WebSocket or SPDY) becomes once both ends have switched protocols, on the
//! hub's proxy front (user to tunnel) and on the agent (tunnel to spoke apiserver) alike.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tracing::debug;

/// Copies bytes both ways, each direction on its own so a peer that stops reading one way
/// never stalls the other, until both sides have finished or nothing has moved either way for
/// `idle`. A side's end (or failure) half-closes the other side's writing. Returns the bytes
/// copied each way (a to b, b to a).
pub async fn relay_bytes<A, B>(a: A, b: B, idle: Duration) -> (u64, u64)
where
    A: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send,
    B: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send,
{
    let (a_read, a_write) = tokio::io::split(a);
    let (b_read, b_write) = tokio::io::split(b);
    let moved = tokio::sync::Notify::new();
    let (a_to_b, b_to_a) = (AtomicU64::new(0), AtomicU64::new(0));
    let both = futures::future::join(
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

/// Copies `from` to `to` until `from` ends or either fails, then half-closes `to`.
async fn copy_one_way<R, W>(mut from: R, mut to: W, moved: &tokio::sync::Notify, count: &AtomicU64)
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; RELAY_CHUNK];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).await.is_err() || to.flush().await.is_err() {
            break;
        }
        count.fetch_add(n as u64, Ordering::Relaxed);
        moved.notify_one();
    }
    let _ = to.shutdown().await;
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
