//! Measuring a link from both of its ends, both in this process: a ping-like UDP probe (round
//! trips and loss) and a bulk TCP transfer (goodput), so an operator sees what a link does
//! next to what it was asked to do.

use std::io;
use std::net::{SocketAddr, UdpSocket as StdUdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::time::Instant;

use crate::emulator::{EmulatedLink, LinkError};

/// Bytes of each probe: a sequence number and padding, the size of a small request.
const PROBE_BYTES: usize = 64;

/// What a round-trip probe saw.
#[derive(Clone, Debug)]
pub struct RoundTrips {
    /// Probes sent.
    pub sent: usize,
    /// Each answered probe's round trip, sorted.
    pub rtts: Vec<Duration>,
    /// The longest run of consecutive unanswered probes, in probes: an outage is one long run.
    pub longest_gap: usize,
    /// The first probe after that run, the first answered again (`sent` if none was).
    pub longest_gap_end: usize,
    /// The time between probes.
    pub interval: Duration,
}

impl RoundTrips {
    pub fn answered(&self) -> usize {
        self.rtts.len()
    }

    /// The share of probes not answered (a request or its answer lost).
    pub fn loss(&self) -> f64 {
        if self.sent == 0 {
            return 0.0;
        }
        1.0 - self.answered() as f64 / self.sent as f64
    }

    /// The `q` quantile (0..=1) of the answered round trips.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        let last = self.rtts.len().checked_sub(1)?;
        Some(self.rtts[((last as f64) * q).round() as usize])
    }

    /// The longest outage seen: the longest unanswered run, in time.
    pub fn longest_outage(&self) -> Duration {
        self.interval * self.longest_gap as u32
    }
}

/// Sends `count` UDP probes from the root namespace to an echo in the link's namespace, one
/// every `interval`, and waits for answers until `wait` after the last one was sent.
pub async fn round_trips(
    link: &EmulatedLink,
    count: usize,
    interval: Duration,
    wait: Duration,
) -> Result<RoundTrips, LinkError> {
    let inside = link.inside_address();
    let echo = link
        .inside(move || {
            let s = StdUdpSocket::bind((inside, 0))?;
            s.set_nonblocking(true)?;
            Ok(s)
        })
        .await?;
    let echo = UdpSocket::from_std(echo).map_err(|e| io_err(link, e))?;
    let echo_addr = echo.local_addr().map_err(|e| io_err(link, e))?;
    let echo_task = tokio::spawn(async move {
        let mut buf = [0u8; 2048];
        while let Ok((n, from)) = echo.recv_from(&mut buf).await {
            let _ = echo.send_to(&buf[..n], from).await;
        }
    });
    let result = probe(echo_addr, link.host(), count, interval, wait).await;
    echo_task.abort();
    result.map_err(|e| io_err(link, e))
}

async fn probe(
    echo: SocketAddr,
    host: std::net::Ipv4Addr,
    count: usize,
    interval: Duration,
    wait: Duration,
) -> io::Result<RoundTrips> {
    let socket = Arc::new(UdpSocket::bind((host, 0)).await?);
    let mut sent_at: Vec<Option<Instant>> = vec![None; count];
    let mut rtt: Vec<Option<Duration>> = vec![None; count];
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next = 0;
    let mut deadline = None;
    let mut buf = [0u8; 2048];
    loop {
        tokio::select! {
            _ = tick.tick(), if next < count => {
                let mut probe = [0u8; PROBE_BYTES];
                probe[..8].copy_from_slice(&(next as u64).to_be_bytes());
                sent_at[next] = Some(Instant::now());
                // A probe the sender's own stack refuses is lost like any other.
                if let Err(e) = socket.send_to(&probe, echo).await {
                    tracing::debug!(seq = next, error = %e, "a probe was not sent");
                }
                next += 1;
                if next == count {
                    deadline = Some(Instant::now() + wait);
                }
            }
            got = socket.recv_from(&mut buf) => {
                let (n, _) = got?;
                if n >= 8 {
                    let seq = u64::from_be_bytes(buf[..8].try_into().expect("8 bytes")) as usize;
                    if let (Some(Some(at)), Some(slot)) = (sent_at.get(seq), rtt.get_mut(seq)) {
                        slot.get_or_insert(at.elapsed());
                    }
                }
                if next == count && rtt.iter().all(Option::is_some) {
                    break;
                }
            }
            () = sleep_until_some(deadline) => break,
        }
    }
    let (mut longest_gap, mut longest_gap_end, mut gap) = (0, 0, 0);
    for (seq, r) in rtt.iter().enumerate() {
        gap = if r.is_some() { 0 } else { gap + 1 };
        if gap > longest_gap {
            (longest_gap, longest_gap_end) = (gap, seq + 1);
        }
    }
    let mut rtts: Vec<Duration> = rtt.into_iter().flatten().collect();
    rtts.sort_unstable();
    Ok(RoundTrips {
        sent: count,
        rtts,
        longest_gap,
        longest_gap_end,
        interval,
    })
}

/// What a bulk transfer moved.
#[derive(Clone, Copy, Debug)]
pub struct Bulk {
    /// Bytes received in the measured window.
    pub bytes: u64,
    /// The measured window (the transfer's first second, TCP's slow start, left out).
    pub window: Duration,
    /// Bytes received since the transfer began, and the time since it began: a rate no link
    /// can beat, since a receiver reading late only ever counts fewer bytes, never more.
    pub total_bytes: u64,
    pub total: Duration,
}

impl Bulk {
    /// Goodput over the measured window. A receiver starved for CPU at the window's start
    /// reads a backlog into it, so on a loaded machine it can read above the link's rate;
    /// [`Bulk::average_bits_per_second`] cannot.
    pub fn bits_per_second(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.window.as_secs_f64()
    }

    /// Goodput since the transfer began, slow start included.
    pub fn average_bits_per_second(&self) -> f64 {
        self.total_bytes as f64 * 8.0 / self.total.as_secs_f64()
    }
}

/// Sends as fast as TCP allows from the root namespace to a receiver in the link's namespace
/// for `warmup + window`, and counts what arrived during `window`.
pub async fn bulk_transfer(
    link: &EmulatedLink,
    warmup: Duration,
    window: Duration,
) -> Result<Bulk, LinkError> {
    let inside = link.inside_address();
    let listener = link
        .inside(move || {
            let l = std::net::TcpListener::bind((inside, 0))?;
            l.set_nonblocking(true)?;
            Ok(l)
        })
        .await?;
    let listener = TcpListener::from_std(listener).map_err(|e| io_err(link, e))?;
    let addr = listener.local_addr().map_err(|e| io_err(link, e))?;
    let received = Arc::new(AtomicU64::new(0));
    let receiver = {
        let received = received.clone();
        tokio::spawn(async move {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let mut buf = vec![0u8; 64 * 1024];
            while let Ok(n) = stream.read(&mut buf).await {
                if n == 0 {
                    return;
                }
                received.fetch_add(n as u64, Ordering::Relaxed);
            }
        })
    };
    // Before the connection: no byte can arrive earlier.
    let began = Instant::now();
    let sender: tokio::task::JoinHandle<io::Result<()>> = tokio::spawn(async move {
        let mut stream = TcpStream::connect(addr).await?;
        let chunk = vec![0u8; 64 * 1024];
        loop {
            stream.write_all(&chunk).await?;
        }
    });
    // The measurement's own windows: the transfer runs meanwhile, nothing is waited for.
    tokio::time::sleep(warmup).await;
    let before = received.load(Ordering::Relaxed);
    let start = Instant::now();
    tokio::time::sleep(window).await;
    let total_bytes = received.load(Ordering::Relaxed);
    let (window, total) = (start.elapsed(), began.elapsed());
    let bytes = total_bytes - before;
    receiver.abort();
    if sender.is_finished() {
        // It only ends on an error: the connection failed or broke.
        if let Ok(Err(e)) = sender.await {
            return Err(io_err(link, e));
        }
    } else {
        sender.abort();
    }
    Ok(Bulk {
        bytes,
        window,
        total_bytes,
        total,
    })
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn io_err(link: &EmulatedLink, source: io::Error) -> LinkError {
    LinkError::Probe {
        namespace: link.namespace().to_string(),
        source,
    }
}
