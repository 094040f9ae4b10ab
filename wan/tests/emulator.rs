//! The emulator checked from both ends of real links (namespaces, TUN devices, qdiscs and
//! nftables rules): what each setting does to packets, not how fast this machine is. Needs
//! root and the tools `check_available` names; where they are missing each test says it is
//! skipped and why.

use std::time::Duration;

use flotilla_wan::probe::{bulk_transfer, round_trips};
use flotilla_wan::{EmulatedLink, LinkSpec, check_available};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A link of `spec`, or `None` (the test skips, saying why) where links cannot be made.
async fn link(spec: &str) -> Option<EmulatedLink> {
    if let Err(e) = check_available() {
        eprintln!("SKIPPED: {e}");
        return None;
    }
    let spec: LinkSpec = spec.parse().unwrap();
    Some(EmulatedLink::create(spec, 28).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_round_trip_beats_the_delay_and_nothing_is_lost_without_loss() {
    let Some(link) = link("delay=60ms,jitter=20ms").await else {
        return;
    };
    // Each direction holds 30 ms ± 10: no round trip under 40 ms.
    assert_eq!(link.spec().min_round_trip(), ms(40));
    let seen = round_trips(&link, 100, ms(5), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(seen.answered(), 100, "no loss was asked: {seen:?}");
    assert!(seen.rtts[0] >= ms(40), "fastest {:?}", seen.rtts[0]);
    // Both directions carried every probe through their delay lines.
    assert!(link.inbound().delivered >= 100 && link.outbound().delivered >= 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loss_drops_packets_each_way() {
    let Some(link) = link("loss=20%").await else {
        return;
    };
    let seen = round_trips(&link, 500, ms(2), Duration::from_secs(2))
        .await
        .unwrap();
    // 20 % each way loses 1 - 0.8² = 36 % of round trips; 500 probes put that within
    // ±4 standard deviations of 27..45 %, and one way only (20 %) well outside.
    let loss = seen.loss();
    assert!((0.27..=0.45).contains(&loss), "round-trip loss {loss:.3}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_taken_down_drops_everything_and_passes_again_when_back() {
    let Some(link) = link("delay=10ms").await else {
        return;
    };
    link.set_down(true).await.unwrap();
    assert!(link.is_down());
    let before = link.outbound();
    let seen = round_trips(&link, 50, ms(5), Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(seen.answered(), 0, "{seen:?}");
    // Dropped on the way in: the echo inside never saw a probe to answer.
    assert_eq!(link.outbound().offered, before.offered);
    link.set_down(false).await.unwrap();
    let seen = round_trips(&link, 50, ms(5), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(seen.answered(), 50, "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flap_schedule_takes_the_link_down_and_brings_it_back() {
    // Up 2 s, then down 1 s, over and over.
    let Some(link) = link("flap=1s/3s").await else {
        return;
    };
    // 4 s of probes every 20 ms span the first outage and the time up after it.
    let seen = round_trips(&link, 200, ms(20), Duration::from_secs(1))
        .await
        .unwrap();
    // An outage of about 50 probes (less if the machine is slow to run the rule changes).
    assert!(
        seen.longest_gap >= 20,
        "longest run of lost probes {} ({:?})",
        seen.longest_gap,
        seen.longest_outage()
    );
    // Probes before it were answered, and after it again: it came back.
    assert!(seen.longest_gap_end > seen.longest_gap, "{seen:?}");
    assert!(
        seen.longest_gap_end < seen.sent,
        "never came back: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_transfer_is_held_to_the_rate() {
    let Some(link) = link("rate=2mbit").await else {
        return;
    };
    let bulk = bulk_transfer(&link, Duration::from_secs(1), Duration::from_secs(2))
        .await
        .unwrap();
    // The shaper never lets more through than the rate (its burst is 10 ms' worth), counted
    // from the transfer's start, which a receiver reading late cannot inflate; TCP fills most
    // of it on a link without loss.
    let bps = bulk.average_bits_per_second();
    assert!(
        (1.0e6..=2.0e6 * 1.02).contains(&bps),
        "{bps:.0} bit/s: {bulk:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_delay_line_drops_and_bounds_what_is_in_flight() {
    // Each direction holds 50 ms and at most 8 packets: at most 8 full-size packets per 50 ms
    // cross, 1.92 Mbit/s, whatever TCP tries.
    let Some(link) = link("delay=100ms,queue=8").await else {
        return;
    };
    let bulk = bulk_transfer(&link, Duration::from_secs(1), Duration::from_secs(2))
        .await
        .unwrap();
    let bound = 8.0 * 1_500.0 * 8.0 / 0.050;
    assert!(
        bulk.average_bits_per_second() <= bound,
        "{:.0} bit/s through a line of 8 packets: {bulk:?}",
        bulk.average_bits_per_second()
    );
    assert!(bulk.bytes > 0);
    assert!(link.inbound().dropped_full > 0, "{:?}", link.inbound());
}

/// A TCP and a UDP service on this machine's loopback (as the hub and gateways listen), each
/// answering once, reached from inside `link`'s namespace at `dial` (same port for both): the
/// TCP greeting arrives, the UDP echo comes back from the address dialled. Returns the peer
/// addresses the two services saw.
async fn greeted_and_echoed(
    link: &EmulatedLink,
    dial: std::net::IpAddr,
) -> (std::net::IpAddr, std::net::IpAddr) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = tcp.local_addr().unwrap().port();
    let udp = tokio::net::UdpSocket::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let served = tokio::spawn(async move {
        let (mut conn, from) = tcp.accept().await.unwrap();
        conn.write_all(b"over tcp").await.unwrap();
        let mut buf = [0u8; 16];
        let (n, peer) = udp.recv_from(&mut buf).await.unwrap();
        udp.send_to(&buf[..n], peer).await.unwrap();
        (from.ip(), peer.ip())
    });
    let target = std::net::SocketAddr::new(dial, port);
    let socket = link.inside(tokio::net::TcpSocket::new_v4).await.unwrap();
    let mut conn = socket.connect(target).await.unwrap();
    let mut got = [0u8; 8];
    conn.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"over tcp");
    let udp = link
        .inside(|| {
            let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
            s.set_nonblocking(true)?;
            Ok(s)
        })
        .await
        .unwrap();
    let udp = tokio::net::UdpSocket::from_std(udp).unwrap();
    udp.send_to(b"over udp", target).await.unwrap();
    let mut buf = [0u8; 16];
    let (n, from) = udp.recv_from(&mut buf).await.unwrap();
    assert_eq!(
        (&buf[..n], from),
        (&b"over udp"[..], target),
        "the echo, from the address dialled"
    );
    served.await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_namespace_reaches_loopback_services_at_the_host_end() {
    let Some(link) = link("delay=20ms,loss=0").await else {
        return;
    };
    let peers = greeted_and_echoed(&link, link.host().into()).await;
    // The services saw the namespace's own address: the link, not a relay.
    let inside = std::net::IpAddr::from(link.inside_address());
    assert_eq!(peers, (inside, inside));
}

#[tokio::test]
async fn loopback_inside_can_be_sent_to_the_host_ends_loopback() {
    let Some(link) = link("delay=20ms,loss=0").await else {
        return;
    };
    link.send_loopback_to_host().unwrap();
    // A service named to the namespace by its loopback address (as a gateway's redirect names
    // another gateway).
    let before = link.outbound().delivered;
    let peers = greeted_and_echoed(&link, std::net::Ipv4Addr::LOCALHOST.into()).await;
    // Both came over the link, from the namespace's address, not its own loopback.
    let inside = std::net::IpAddr::from(link.inside_address());
    assert_eq!(peers, (inside, inside));
    assert!(
        link.outbound().delivered > before,
        "nothing crossed the link"
    );
}

#[test]
fn links_made_while_others_are_removed_keep_their_namespaces_and_carry() {
    if let Err(e) = check_available() {
        eprintln!("SKIPPED: {e}");
        return;
    }
    // Two makers at once, as two tests of one binary are (each on its own runtime, a link
    // dropped outside the runtime's workers): each removes its link as the other makes one.
    // A new link may get the names of one being removed, and must not lose its namespace to
    // that removal.
    let maker = |who: usize| {
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                for round in 0..12 {
                    let link = link("delay=1ms").await.unwrap();
                    let seen = round_trips(&link, 3, ms(2), Duration::from_secs(5))
                        .await
                        .unwrap();
                    assert_eq!(seen.answered(), 3, "maker {who} round {round}: {seen:?}");
                }
            });
        })
    };
    let (a, b) = (maker(0), maker(1));
    a.join().unwrap();
    b.join().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_runtimes_connections_cross_the_link_and_are_counted_in_bytes() {
    use tokio::io::AsyncReadExt;
    let Some(link) = link("delay=20ms,loss=0").await else {
        return;
    };
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = tcp.local_addr().unwrap().port();
    const PAYLOAD: usize = 200_000;
    let served = tokio::spawn(async move {
        let (mut conn, from) = tcp.accept().await.unwrap();
        let mut got = Vec::new();
        conn.read_to_end(&mut got).await.unwrap();
        (from.ip(), got.len())
    });
    let before = link.outbound().offered_bytes;
    let runtime = link.runtime().await.unwrap();
    let host = link.host();
    // A client that makes its own connection, as a kube client does, on the namespace's runtime.
    runtime
        .handle()
        .spawn(async move {
            use tokio::io::AsyncWriteExt;
            let mut conn = tokio::net::TcpStream::connect((host, port)).await.unwrap();
            conn.write_all(&vec![7u8; PAYLOAD]).await.unwrap();
            conn.shutdown().await.unwrap();
        })
        .await
        .unwrap();
    let (peer, len) = served.await.unwrap();
    assert_eq!(peer, std::net::IpAddr::from(link.inside_address()));
    assert_eq!(len, PAYLOAD);
    // What left the namespace is on the wire's count: the payload and the headers with it.
    let sent = link.outbound().offered_bytes - before;
    assert!(
        sent as usize > PAYLOAD && (sent as usize) < PAYLOAD * 12 / 10,
        "{sent} bytes counted for {PAYLOAD} sent"
    );
}

/// A loopback service of this machine (a spoke's apiserver, as on an edge site beside its
/// agent) reached from inside the namespace at its own address, 127.0.0.1:PORT, through
/// `serve_beside`: the service sees loopback, nothing crosses the link, and no exchange takes
/// the link's round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_beside_the_link_is_reached_without_crossing_it() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(link) = link("delay=1s").await else {
        return;
    };
    let service = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = service.local_addr().unwrap().port();
    // Echoes every connection, and says whom it served.
    let served = tokio::spawn(async move {
        let mut peers = Vec::new();
        for _ in 0..2 {
            let (mut conn, from) = service.accept().await.unwrap();
            peers.push(from.ip());
            tokio::spawn(async move {
                let (mut r, mut w) = conn.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
        peers
    });
    let relay = link.serve_beside(port).await.unwrap();
    assert_eq!(relay.port(), port);
    let (before_in, before_out) = (link.inbound(), link.outbound());
    // The devices' own chatter (IPv6 comes up with them) never reaches the link.
    assert_eq!((before_in.offered, before_out.offered), (0, 0));
    for round in 0..2 {
        let socket = link.inside(tokio::net::TcpSocket::new_v4).await.unwrap();
        let mut conn = socket
            .connect((std::net::Ipv4Addr::LOCALHOST, port).into())
            .await
            .unwrap();
        for exchange in 0..5 {
            let started = tokio::time::Instant::now();
            let asked = format!("round {round} exchange {exchange}");
            conn.write_all(asked.as_bytes()).await.unwrap();
            let mut answer = vec![0u8; asked.len()];
            conn.read_exact(&mut answer).await.unwrap();
            assert_eq!(answer, asked.as_bytes());
            // The link holds each packet 500 ms each way: an exchange that crossed it could
            // not be back sooner than its round trip.
            assert!(
                started.elapsed() < link.spec().min_round_trip(),
                "round {round} exchange {exchange} took {:?}",
                started.elapsed()
            );
        }
    }
    assert_eq!(relay.accepted(), 2);
    // Not a packet crossed the link either way (the namespace sends nothing else).
    assert_eq!(
        (link.inbound().offered, link.outbound().offered),
        (before_in.offered, before_out.offered)
    );
    // The service was dialled from this machine's loopback, not from the namespace's address.
    let peers = served.await.unwrap();
    assert!(peers.iter().all(|p| p.is_loopback()), "{peers:?}");
}

/// This machine's connections (in any state but listening) whose peer is `address`, from the
/// kernel's table of IPv4 TCP sockets, orphans included.
fn connections_with(address: std::net::Ipv4Addr) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (remote, state) = (fields[2], fields[3]);
            // The address as the kernel stores it, printed as a native-endian word.
            let ip = u32::from_str_radix(&remote[..8], 16).unwrap();
            std::net::Ipv4Addr::from(ip.to_ne_bytes()) == address && state != "0A"
        })
        .count()
}

/// A loopback service's end of a connection with the namespace, still closing when the link is
/// removed, ends with the link: left alone it resends its FIN for minutes, and the next link
/// given the same address would carry those packets (and its namespace's answers) as its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_links_connections_end_with_it() {
    use tokio::io::AsyncWriteExt;
    let Some(link) = link("delay=10ms").await else {
        return;
    };
    let service = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = service.local_addr().unwrap().port();
    let socket = link.inside(tokio::net::TcpSocket::new_v4).await.unwrap();
    let conn = socket.connect((link.host(), port).into()).await.unwrap();
    let (mut served, _) = service.accept().await.unwrap();
    // The service answers and closes while nothing crosses: its end waits, resending.
    link.set_down(true).await.unwrap();
    served.write_all(b"bye").await.unwrap();
    drop(served);
    let inside = link.inside_address();
    assert_eq!(connections_with(inside), 1, "the service's end is closing");
    drop(conn);
    drop(link);
    assert_eq!(
        connections_with(inside),
        0,
        "a connection with the removed link's address is left"
    );
}

#[tokio::test]
async fn loopback_is_sent_to_the_host_or_serves_beside_never_both() {
    let Some(serving) = link("delay=1ms").await else {
        return;
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _relay = serving.serve_beside(port).await.unwrap();
    let refused = serving.send_loopback_to_host().unwrap_err();
    assert!(
        matches!(refused, flotilla_wan::LinkError::LoopbackTaken { .. }),
        "{refused}"
    );
    assert!(
        refused
            .to_string()
            .contains("serves host services beside the link"),
        "{refused}"
    );
    // Another service beside the same link is fine.
    let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let other_port = other.local_addr().unwrap().port();
    serving.serve_beside(other_port).await.unwrap();

    let Some(sending) = link("delay=1ms").await else {
        return;
    };
    sending.send_loopback_to_host().unwrap();
    let refused = sending.serve_beside(port).await.err().unwrap();
    assert!(
        refused
            .to_string()
            .contains("is sent to the host over the link already"),
        "{refused}"
    );
}

/// A loopback service answering the namespace with one UDP segmentation-offload batch (four
/// datagrams in one send, as QUIC stacks send): every datagram arrives, though the emulator's
/// translation back from loopback leaves the kernel's split segments with checksums the
/// namespace would otherwise drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_segmentation_offload_batch_from_a_loopback_service_arrives_whole() {
    use nix::sys::socket::{setsockopt, sockopt::UdpGsoSegment};
    const SEGMENT: usize = 1_200;
    let Some(link) = link("delay=2ms").await else {
        return;
    };
    let service = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = service.local_addr().unwrap().port();
    let client = link
        .inside(|| {
            let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            Ok(s)
        })
        .await
        .unwrap();
    let host = link.host();
    let answered = tokio::task::spawn_blocking(move || {
        client.send_to(b"ask", (host, port)).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 65_536];
        while got.len() < 4 {
            match client.recv(&mut buf) {
                Ok(n) => got.push(n),
                Err(_) => break,
            }
        }
        got
    });
    let mut buf = [0u8; 64];
    let (_, peer) = service.recv_from(&mut buf).unwrap();
    setsockopt(&service, UdpGsoSegment, &(SEGMENT as i32)).unwrap();
    let batch = vec![7u8; 4 * SEGMENT];
    assert_eq!(service.send_to(&batch, peer).unwrap(), batch.len());
    assert_eq!(answered.await.unwrap(), vec![SEGMENT; 4]);
}
