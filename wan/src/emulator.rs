//! An [`EmulatedLink`]: a network namespace on this machine whose one way out is a link shaped
//! by a [`LinkSpec`].
//!
//! ## The packet path
//!
//! The link is a pair of TUN devices, not a veth pair: `H` in the root namespace (address
//! `host`, its peer `inside`) and `G` in the link's namespace (address `inside`, its peer
//! `host`, and the namespace's default route). This process holds both devices' file
//! descriptors; each direction is a task that reads what one device's kernel side sends and
//! writes it into the other, where the kernel takes it as received:
//!
//! ```text
//! root namespace                            this process           link namespace (agents)
//! socket ─► route to `inside` ─► tbf ─► H ─► delay line ─► G ─► [nft in: down, loss] ─► socket
//! socket ◄─ [nft in: down, loss] ◄────── H ◄─ delay line ◄─ G ◄─ tbf ◄─ default route ◄─ socket
//! ```
//!
//! * **Delay and jitter**: the delay lines ([`DelayLine`]), in this process, one task per
//!   direction with its own seeded RNG; each holds at most its bound and counts what it drops.
//! * **Rate**: a `tbf` qdisc on each device's egress (`H` in the root namespace, `G` inside),
//!   so each direction's bottleneck sits before its delay line, as a slow access link before
//!   the long haul. Its queue holds [`TBF_QUEUE`] of traffic at the rate.
//! * **Loss and flaps**: an nftables table at each receiving end (named after this process and
//!   the link), hooked on input for what comes in through its device, so a sender never sees
//!   the drop, as on a real path: loss is `numgen random` against the spec's parts per
//!   million; a flap, or [`EmulatedLink::set_down`], adds a chain at both ends that drops
//!   everything, and the delay lines drop what they hold as it comes due while the link is
//!   down (what was on the wire when it went down is lost). The root namespace's table also
//!   drops anything forwarded to or from `H`: a packet from the namespace reaches this
//!   machine's own addresses and nothing beyond it.
//!
//! The delay lines also put right the UDP checksums the emulator's own translation back from
//! loopback breaks (segmentation-offload batches split after it; see [`crate::checksum`]).
//!
//! Why this is loop-free and needs no sysctl: every packet the delay line writes is addressed
//! to the other namespace's own address, so the kernel delivers it locally (no forwarding);
//! the only route to each peer is its device, so the reverse path check (rp_filter) holds
//! for both; and nothing is ever routed back into the device it came from.
//!
//! A process put in the namespace (`EmulatedLink::command`) reaches this machine's loopback
//! services at [`EmulatedLink::host`], same port: the root namespace's table sends a new
//! connection (TCP or UDP) from the namespace to `host` on to 127.0.0.1 (DNAT, with
//! `route_localnet` on `H` so the kernel routes loopback addresses there; answers are
//! translated back by conntrack). Connections the root namespace opens into the namespace
//! are not translated. A socket of this process can be made inside with
//! [`EmulatedLink::inside`]; a loopback service of this machine that belongs beside the
//! namespace rather than across the link is served inside with
//! [`EmulatedLink::serve_beside`].
//!
//! Everything is removed on drop, and on every error while it is being made: the tasks, the
//! nftables table, the namespace (`G` goes with it) and `H` (closed with its descriptor); on
//! drop also this machine's connections with the namespace's address (`ss -K`), whose
//! retransmissions would otherwise reach the next link given that address.

use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_tun::Tun;
use tracing::{debug, info, warn};

use crate::beside::BesideRelay;
use crate::checksum;
use crate::delay_line::{DelayLine, Offer};
use crate::spec::{LOSS_SCALE, LinkSpec, Rate};

/// The most links one process has at once: the /30s of one /24.
pub const MAX_LINKS: usize = 64;
/// How much traffic each direction's rate limiter queues, in time at its rate: a modem's
/// buffer, enough for TCP to fill the link, short of bufferbloat.
pub const TBF_QUEUE: Duration = Duration::from_millis(200);
/// The largest packet a delay line reads: the devices' MTU is 1500, this leaves room.
const MAX_PACKET: usize = 65_536;

/// The slots (names and /30s) of this process's links, one bit each: a link takes the lowest
/// free one and gives it back once its devices are closed, so links made at once (tests in one
/// binary) never share a name or an address.
static SLOTS: AtomicU64 = AtomicU64::new(0);

fn take_slot() -> Option<usize> {
    let mut taken = None;
    SLOTS
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
            let free = (!used).trailing_zeros() as usize;
            taken = (free < MAX_LINKS).then_some(free);
            taken.map(|f| used | (1 << f))
        })
        .ok()?;
    taken
}

fn give_back(slot: usize) {
    SLOTS.fetch_and(!(1u64 << slot), Ordering::AcqRel);
}

/// Why a link could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// This machine or user cannot make links (not root, a tool or `/dev/net/tun` missing).
    /// Not retryable here: the message says what to install or how to run.
    #[error("{0}")]
    Unavailable(String),
    /// A command that makes the link failed. Not retryable as is: its stderr says why.
    #[error("`{command}` failed: {stderr}")]
    Command { command: String, stderr: String },
    /// A command could not be started. Not retryable until it is installed.
    #[error("running `{program}`: the link emulator needs iproute2 and nftables")]
    Spawn {
        program: &'static str,
        #[source]
        source: io::Error,
    },
    /// Opening a TUN device failed. Not retryable until `/dev/net/tun` works.
    #[error("opening TUN device {name}")]
    Tun {
        name: String,
        #[source]
        source: tokio_tun::Error,
    },
    /// Entering the link's namespace to make a socket there failed. Retryable only if the
    /// link still exists.
    #[error("making a socket in network namespace {namespace}")]
    Inside {
        namespace: String,
        #[source]
        source: io::Error,
    },
    /// A probe's socket failed (`probe`). Retryable: a probe makes its sockets anew.
    #[error("probing the link of network namespace {namespace}")]
    Probe {
        namespace: String,
        #[source]
        source: io::Error,
    },
    /// This process already has [`MAX_LINKS`] links. Retryable once some are dropped.
    #[error("this process already has {MAX_LINKS} links; drop some before making more")]
    TooMany,
    /// The namespace's 127.0.0.1 is used the other way already: a link sends loopback to the
    /// host ([`EmulatedLink::send_loopback_to_host`]) or serves the host's services beside
    /// ([`EmulatedLink::serve_beside`]), never both. Not retryable on this link.
    #[error(
        "network namespace {namespace}: its 127.0.0.1 {taken} already; sending loopback to the host and serving host services beside the link exclude each other"
    )]
    LoopbackTaken {
        namespace: String,
        taken: &'static str,
    },
}

/// Packets counted in one direction.
#[derive(Debug, Default)]
pub struct DirectionStats {
    /// Read from the sending side's device.
    pub offered: AtomicU64,
    /// Written into the receiving side's device after their hold.
    pub delivered: AtomicU64,
    /// Dropped because the delay line was full.
    pub dropped_full: AtomicU64,
    /// Dropped as they came due while the link was down.
    pub dropped_down: AtomicU64,
    /// The IP bytes of the packets offered: what the sender put on the wire, headers included.
    pub offered_bytes: AtomicU64,
}

/// A snapshot of [`DirectionStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub offered: u64,
    pub delivered: u64,
    pub dropped_full: u64,
    pub dropped_down: u64,
    pub offered_bytes: u64,
}

impl DirectionStats {
    pub fn counts(&self) -> Counts {
        Counts {
            offered: self.offered.load(Ordering::Relaxed),
            delivered: self.delivered.load(Ordering::Relaxed),
            dropped_full: self.dropped_full.load(Ordering::Relaxed),
            dropped_down: self.dropped_down.load(Ordering::Relaxed),
            offered_bytes: self.offered_bytes.load(Ordering::Relaxed),
        }
    }
}

/// Names and addresses of one link.
#[derive(Clone, Debug)]
struct Plan {
    namespace: String,
    host_if: String,
    inside_if: String,
    table: String,
    host: Ipv4Addr,
    inside: Ipv4Addr,
}

impl Plan {
    /// Slot `slot` of this process in 10.214.`third`.0/24, one /30 per link (10.213 is
    /// `--gateway-netns`'s).
    fn new(slot: usize, third: u8) -> Plan {
        let pid = std::process::id();
        let tag = pid % 100_000;
        let base = (slot * 4) as u8;
        Plan {
            namespace: format!("flotilla-wan-{pid}-{slot}"),
            host_if: format!("fw{tag}h{slot}"),
            inside_if: format!("fw{tag}g{slot}"),
            table: format!("flotilla_wan_{pid}_{slot}"),
            host: Ipv4Addr::new(10, 214, third, base + 1),
            inside: Ipv4Addr::new(10, 214, third, base + 2),
        }
    }
}

/// A network namespace behind a shaped link. See the module's doc for the packet path.
pub struct EmulatedLink {
    slot: usize,
    plan: Plan,
    spec: LinkSpec,
    /// What exists, so that drop removes exactly that.
    made_namespace: bool,
    made_table: bool,
    /// The delay lines and the flap schedule.
    tasks: Vec<JoinHandle<()>>,
    /// Root namespace to the link's namespace, and back.
    inbound: Arc<DirectionStats>,
    outbound: Arc<DirectionStats>,
    /// Whether the link is down now (a flap or [`EmulatedLink::set_down`]); the lock orders
    /// the nftables changes that make it so.
    down: Arc<AtomicBool>,
    toggle: Arc<Mutex<()>>,
    /// What the namespace's 127.0.0.1 is used for: a [`LoopbackUse`].
    loopback: AtomicU8,
}

/// What a link's namespace's 127.0.0.1 is used for: the two uses exclude each other (a
/// connection to 127.0.0.1 cannot both cross the link and stay beside it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum LoopbackUse {
    /// The namespace's own, as in any namespace.
    Own,
    /// Sent over the link to the host ([`EmulatedLink::send_loopback_to_host`]).
    SentToHost,
    /// Host services served beside the link ([`EmulatedLink::serve_beside`]).
    ServedBeside,
}

impl LoopbackUse {
    fn taken(use_: u8) -> &'static str {
        match use_ {
            u if u == LoopbackUse::SentToHost as u8 => "is sent to the host over the link",
            u if u == LoopbackUse::ServedBeside as u8 => "serves host services beside the link",
            _ => "is its own",
        }
    }
}

impl EmulatedLink {
    /// Makes a link shaped by `spec`, its jitter drawn from RNGs seeded from `seed`. The
    /// namespace exists, addressed and routed, when this returns. On an error, whatever was
    /// made is removed again.
    pub async fn create(spec: LinkSpec, seed: u64) -> Result<EmulatedLink, LinkError> {
        check_available()?;
        let slot = take_slot().ok_or(LinkError::TooMany)?;
        let plan = Plan::new(slot, free_subnet(slot));
        // Whatever a crashed process of the same pid left.
        let _ = ip(&["netns", "del", &plan.namespace]);
        let _ = ip(&["link", "del", &plan.host_if]);
        let _ = nft(None, &format!("delete table inet {}\n", plan.table));
        let mut link = EmulatedLink {
            slot,
            plan,
            spec,
            made_namespace: false,
            made_table: false,
            tasks: Vec::new(),
            inbound: Arc::default(),
            outbound: Arc::default(),
            down: Arc::default(),
            toggle: Arc::default(),
            loopback: AtomicU8::new(LoopbackUse::Own as u8),
        };
        link.build(seed).await?;
        info!(namespace = %link.plan.namespace, host = %link.plan.host, inside = %link.plan.inside, spec = %link.spec, "emulated link ready");
        Ok(link)
    }

    async fn build(&mut self, seed: u64) -> Result<(), LinkError> {
        let p = self.plan.clone();
        ip(&["netns", "add", &p.namespace])?;
        self.made_namespace = true;
        ip(&["-n", &p.namespace, "link", "set", "lo", "up"])?;
        let host_tun = open_tun(&p.host_if)?;
        let inside_tun = open_tun(&p.inside_if)?;
        let (host, inside) = (p.host.to_string(), p.inside.to_string());
        let (host_peer, inside_peer) = (format!("{host}/32"), format!("{inside}/32"));
        let [host_end, inside_end] = self.ends();
        ip(&[
            "addr",
            "add",
            &host,
            "peer",
            &inside_peer,
            "dev",
            &p.host_if,
        ])?;
        quiet_ipv6(&host_end);
        ip(&["link", "set", &p.host_if, "up"])?;
        ip(&["link", "set", &p.inside_if, "netns", &p.namespace])?;
        ip(&[
            "-n",
            &p.namespace,
            "addr",
            "add",
            &inside,
            "peer",
            &host_peer,
            "dev",
            &p.inside_if,
        ])?;
        // After the move: a device takes its new namespace's defaults there.
        quiet_ipv6(&inside_end);
        ip(&["-n", &p.namespace, "link", "set", &p.inside_if, "up"])?;
        ip(&[
            "-n",
            &p.namespace,
            "route",
            "add",
            "default",
            "dev",
            &p.inside_if,
        ])?;
        if let Some(rate) = self.spec.rate {
            tbf(None, &p.host_if, rate)?;
            tbf(Some(&p.namespace), &p.inside_if, rate)?;
        }
        // Connections from the namespace to `host` go on to this machine's loopback (the
        // table's `to_loopback`), which the kernel routes only where this knob allows it.
        let knob = format!("net.ipv4.conf.{}.route_localnet=1", p.host_if);
        run("sysctl", &["-qw", &knob], None)?;
        for end in self.ends() {
            // The root namespace's table is marked made first: the namespace's goes with it.
            self.made_table |= end.namespace.is_none();
            nft(end.namespace.as_deref(), &self.table_script(&end))?;
        }

        let (host_tun, inside_tun) = (Arc::new(host_tun), Arc::new(inside_tun));
        let mut seeds = StdRng::seed_from_u64(seed);
        for (from, to, stats) in [
            (&host_tun, &inside_tun, &self.inbound),
            (&inside_tun, &host_tun, &self.outbound),
        ] {
            let line = DelayLine::new(&self.spec, StdRng::from_rng(&mut seeds));
            self.tasks.push(tokio::spawn(carry(
                from.clone(),
                to.clone(),
                line,
                stats.clone(),
                self.down.clone(),
            )));
        }
        if let Some(flap) = self.spec.flap {
            let ends = self.ends();
            let (down, toggle) = (self.down.clone(), self.toggle.clone());
            let made = Instant::now();
            self.tasks.push(tokio::spawn(async move {
                loop {
                    let elapsed = made.elapsed();
                    tokio::time::sleep(flap.next_change(elapsed)).await;
                    let now_down = flap.is_down(made.elapsed());
                    if let Err(e) = toggle_down(&ends, &down, &toggle, now_down).await {
                        warn!(error = %e, "a flap of the emulated link failed");
                    }
                }
            }));
        }
        Ok(())
    }

    /// The two receiving ends, where loss and outages drop packets: the root namespace takes
    /// what comes in through `H`, the link's namespace what comes in through `G`.
    fn ends(&self) -> [Receiver; 2] {
        [
            Receiver {
                namespace: None,
                dev: self.plan.host_if.clone(),
                table: self.plan.table.clone(),
            },
            Receiver {
                namespace: Some(self.plan.namespace.clone()),
                dev: self.plan.inside_if.clone(),
                table: self.plan.table.clone(),
            },
        ]
    }

    /// Each end's table: loss on input, and (in the root namespace) nothing forwarded to or
    /// from the link.
    fn table_script(&self, end: &Receiver) -> String {
        let Receiver { table, dev, .. } = end;
        let mut s = format!(
            "add table inet {table}\n\
             add chain inet {table} in {{ type filter hook input priority 0; policy accept; }}\n"
        );
        if end.namespace.is_none() {
            let host = self.plan.host;
            s.push_str(&format!(
                "add chain inet {table} to_loopback {{ type nat hook prerouting priority -100; }}\n\
                 add rule inet {table} to_loopback iifname \"{dev}\" ip daddr {host} dnat ip to 127.0.0.1\n\
                 add chain inet {table} through {{ type filter hook forward priority 0; policy accept; }}\n\
                 add rule inet {table} through iifname \"{dev}\" drop\n\
                 add rule inet {table} through oifname \"{dev}\" drop\n"
            ));
        }
        if !self.spec.loss.is_zero() {
            let ppm = self.spec.loss.per_million;
            s.push_str(&format!(
                "add rule inet {table} in iifname \"{dev}\" numgen random mod {LOSS_SCALE} < {ppm} drop\n"
            ));
        }
        s
    }

    /// Takes the link down (everything dropped both ways, including what it holds) or brings
    /// it back: a partition. On a link with a `flap` schedule, the schedule's next change
    /// overrides it.
    pub async fn set_down(&self, down: bool) -> Result<(), LinkError> {
        toggle_down(&self.ends(), &self.down, &self.toggle, down).await
    }

    /// Whether the link is down now.
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Relaxed)
    }

    pub fn spec(&self) -> &LinkSpec {
        &self.spec
    }

    /// The namespace's name (`ip netns exec NAME ...`).
    pub fn namespace(&self) -> &str {
        &self.plan.namespace
    }

    /// The root namespace's end: what the namespace dials to reach this machine's services,
    /// those listening on loopback included (same port).
    pub fn host(&self) -> Ipv4Addr {
        self.plan.host
    }

    /// From now on, what the namespace sends to 127.0.0.1 goes over the link to this
    /// machine's loopback, same port, as if dialled at [`host`](Self::host): for clients that
    /// are told loopback addresses by the services they reach (a gateway's redirect to another
    /// gateway on this machine). The namespace's own loopback then serves nothing on
    /// 127.0.0.1; the rest of 127.0.0.0/8 stays its own.
    ///
    /// Inside, an output NAT rule points 127.0.0.1 at `host` and a postrouting one gives such
    /// packets the namespace's address as their source (`route_localnet` on `G` lets the
    /// kernel route them out with their loopback source first); the root namespace's
    /// `to_loopback` then takes them to 127.0.0.1 as any other connection to `host`.
    ///
    /// Fails with [`LinkError::LoopbackTaken`] on a link that [serves host services
    /// beside](Self::serve_beside).
    pub fn send_loopback_to_host(&self) -> Result<(), LinkError> {
        self.use_loopback(LoopbackUse::SentToHost)?;
        let p = &self.plan;
        let knob = format!("net.ipv4.conf.{}.route_localnet=1", p.inside_if);
        run(
            "ip",
            &["netns", "exec", &p.namespace, "sysctl", "-qw", &knob],
            None,
        )?;
        let script = format!(
            "add table ip loopback_to_host\n\
             flush table ip loopback_to_host\n\
             add chain ip loopback_to_host out {{ type nat hook output priority -100; }}\n\
             add rule ip loopback_to_host out ip daddr 127.0.0.1 dnat to {host}\n\
             add chain ip loopback_to_host post {{ type nat hook postrouting priority 100; }}\n\
             add rule ip loopback_to_host post oifname \"{dev}\" ip saddr 127.0.0.0/8 snat to {inside}\n",
            host = p.host,
            dev = p.inside_if,
            inside = p.inside,
        );
        nft(Some(&p.namespace), &script)
    }

    /// Serves the host's loopback service at `127.0.0.1:port` inside the namespace, at the
    /// same address, without crossing the link: a service beside the agents in the namespace
    /// (their cluster's apiserver at an edge site), which they reach with the address and
    /// certificate they would use on the host. Served until the [`BesideRelay`] is dropped;
    /// see [`crate::beside`].
    ///
    /// Fails with [`LinkError::LoopbackTaken`] on a link that [sends loopback to the
    /// host](Self::send_loopback_to_host), and with [`LinkError::Inside`] if the port is taken
    /// inside.
    pub async fn serve_beside(&self, port: u16) -> Result<BesideRelay, LinkError> {
        self.use_loopback(LoopbackUse::ServedBeside)?;
        // The namespace's loopback is up from `build`: binding its 127.0.0.1 would fail
        // otherwise (the address exists only on an up `lo`).
        let listener = self
            .inside(move || std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port)))
            .await?;
        BesideRelay::start(listener, port).map_err(|source| LinkError::Inside {
            namespace: self.plan.namespace.clone(),
            source,
        })
    }

    /// Marks the namespace's 127.0.0.1 as used for `wanted`, unless it is used otherwise.
    fn use_loopback(&self, wanted: LoopbackUse) -> Result<(), LinkError> {
        let (own, wanted) = (LoopbackUse::Own as u8, wanted as u8);
        match self
            .loopback
            .compare_exchange(own, wanted, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Ok(()),
            Err(used) if used == wanted => Ok(()),
            Err(used) => Err(LinkError::LoopbackTaken {
                namespace: self.plan.namespace.clone(),
                taken: LoopbackUse::taken(used),
            }),
        }
    }

    /// The namespace's own address.
    pub fn inside_address(&self) -> Ipv4Addr {
        self.plan.inside
    }

    /// Packets from the root namespace into the link's namespace.
    pub fn inbound(&self) -> Counts {
        self.inbound.counts()
    }

    /// Packets from the link's namespace out to the root namespace.
    pub fn outbound(&self) -> Counts {
        self.outbound.counts()
    }

    /// `program` run inside the namespace (through `ip netns exec`, which execs it: the
    /// child's pid is the program's).
    /// A std command, so both tokio's (`tokio::process::Command::from`) and blocking callers
    /// take it.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.plan.namespace])
            .arg(program);
        cmd
    }

    /// Runs `make` on a thread that has entered the namespace, so the sockets it makes belong
    /// there (a socket keeps its namespace wherever it is used after). Make std sockets or
    /// `tokio::net::TcpSocket`s there and register them with the runtime after.
    pub async fn inside<T, F>(&self, make: F) -> Result<T, LinkError>
    where
        T: Send + 'static,
        F: FnOnce() -> io::Result<T> + Send + 'static,
    {
        let namespace = self.plan.namespace.clone();
        let path = format!("/run/netns/{namespace}");
        let inside = move || -> io::Result<T> {
            let ns = File::open(&path)?;
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            make()
        };
        // A thread of its own that ends after: never one of the runtime's, which must stay in
        // the root namespace.
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            let _ = tx.send(inside());
        });
        let result = rx
            .await
            .unwrap_or_else(|_| Err(io::Error::other("the namespace thread panicked")));
        result.map_err(|source| LinkError::Inside { namespace, source })
    }
}

/// A tokio runtime whose threads are in a link's namespace: every socket its tasks make goes
/// through the link. For clients that make their connections themselves (a `kube::Client`
/// makes a new one whenever it needs), where [`EmulatedLink::inside`]'s one-off sockets do not
/// fit. Its thread stops, and its tasks with it, when this is dropped.
pub struct NamespaceRuntime {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl NamespaceRuntime {
    /// Where to spawn the tasks that must connect through the link.
    pub fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

impl Drop for NamespaceRuntime {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl EmulatedLink {
    /// A current-thread runtime on a thread of its own that has entered the namespace (threads
    /// it starts, such as its blocking pool's, inherit the namespace).
    pub async fn runtime(&self) -> Result<NamespaceRuntime, LinkError> {
        let namespace = self.plan.namespace.clone();
        let path = format!("/run/netns/{namespace}");
        let (made_tx, made_rx) = tokio::sync::oneshot::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(format!("ns-{namespace}"))
            .spawn(move || {
                let made = (|| -> io::Result<tokio::runtime::Runtime> {
                    let ns = File::open(&path)?;
                    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET)
                        .map_err(io::Error::from)?;
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                })();
                match made {
                    Ok(runtime) => {
                        let _ = made_tx.send(Ok(runtime.handle().clone()));
                        // Drives the spawned tasks until the owner lets go.
                        let _ = runtime.block_on(stop_rx);
                        runtime.shutdown_background();
                    }
                    Err(e) => {
                        let _ = made_tx.send(Err(e));
                    }
                }
            })
            .map_err(|source| LinkError::Inside {
                namespace: namespace.clone(),
                source,
            })?;
        let handle = made_rx
            .await
            .unwrap_or_else(|_| Err(io::Error::other("the namespace thread panicked")))
            .map_err(|source| LinkError::Inside { namespace, source })?;
        Ok(NamespaceRuntime {
            handle,
            stop: Some(stop_tx),
        })
    }
}

impl Drop for EmulatedLink {
    fn drop(&mut self) {
        let tasks = std::mem::take(&mut self.tasks);
        for t in &tasks {
            t.abort();
        }
        if self.made_table
            && let Err(e) = nft(None, &format!("delete table inet {}\n", self.plan.table))
        {
            warn!(table = %self.plan.table, error = %e, "deleting the emulated link's nftables table failed");
        }
        if self.made_namespace
            && let Err(e) = ip(&["netns", "del", &self.plan.namespace])
        {
            warn!(namespace = %self.plan.namespace, error = %e, "deleting the emulated link's namespace failed");
        }
        // This machine's ends of connections with the namespace outlive it: a loopback
        // service's end still closing (FIN-WAIT, LAST-ACK) resends its FIN for minutes. Ended
        // here, or those retransmissions reach the next link given this address, whose
        // namespace answers them, and that link counts traffic none of its users sent.
        // Only a link that got its namespace had the address (another process may hold it).
        let inside = self.plan.inside.to_string();
        if self.made_namespace
            && let Err(e) = run("ss", &["-K", "-t", "-u", "dst", &inside], None)
        {
            warn!(address = %inside, error = %e, "ending this machine's connections with the removed link's namespace failed");
        }
        // The slot (its names) is free again only after the namespace and the table are gone,
        // and once the tasks, which hold the TUN devices, are (the host end's device closes
        // with them): a link made on it sooner would lose its new namespace to the deletion
        // above. Without a runtime the process is ending and the slot is not needed again.
        let slot = self.slot;
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                for t in tasks {
                    let _ = t.await;
                }
                give_back(slot);
            });
        }
        debug!(namespace = %self.plan.namespace, "emulated link removed");
    }
}

/// One direction: packets read from `from`'s device held in `line`, then written into `to`'s.
async fn carry(
    from: Arc<Tun>,
    to: Arc<Tun>,
    mut line: DelayLine<StdRng>,
    stats: Arc<DirectionStats>,
    down: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; MAX_PACKET];
    loop {
        let due = line.next_release();
        tokio::select! {
            read = from.recv(&mut buf) => match read {
                Ok(n) => {
                    stats.offered.fetch_add(1, Ordering::Relaxed);
                    stats.offered_bytes.fetch_add(n as u64, Ordering::Relaxed);
                    checksum::complete_udp(&mut buf[..n]);
                    if line.offer(Instant::now(), buf[..n].to_vec()) == Offer::Full {
                        stats.dropped_full.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(e) => {
                    warn!(device = from.name(), error = %e, "reading the emulated link's device failed; this direction stops");
                    return;
                }
            },
            () = sleep_until_some(due) => {
                while let Some(packet) = line.pop_due(Instant::now()) {
                    if down.load(Ordering::Relaxed) {
                        stats.dropped_down.fetch_add(1, Ordering::Relaxed);
                    } else if to.send(&packet).await.is_ok() {
                        stats.delivered.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// One end of the link as a receiver: the namespace (`None`: the root one), the device packets
/// come in through, and the nftables table that drops some of them.
#[derive(Clone, Debug)]
struct Receiver {
    namespace: Option<String>,
    dev: String,
    table: String,
}

/// Adds (down) or deletes (up) a chain at each end dropping everything that comes in through
/// the link. Both ends drop on input, where a real path would lose a packet: the sender's own
/// stack never sees the drop (an output drop would fail its `send` with EPERM, which TCP and
/// QUIC treat as local congestion, not as loss).
async fn toggle_down(
    ends: &[Receiver],
    down: &AtomicBool,
    toggle: &Mutex<()>,
    to_down: bool,
) -> Result<(), LinkError> {
    let _order = toggle.lock().await;
    if down.load(Ordering::Relaxed) == to_down {
        return Ok(());
    }
    // Marked down first, so the delay lines drop what they hold from the moment it starts.
    if to_down {
        down.store(true, Ordering::Relaxed);
    }
    for end in ends {
        let Receiver { table, dev, .. } = end;
        let script = if to_down {
            format!(
                "add chain inet {table} down {{ type filter hook input priority -10; policy accept; }}\n\
                 add rule inet {table} down iifname \"{dev}\" drop\n"
            )
        } else {
            format!("flush chain inet {table} down\ndelete chain inet {table} down\n")
        };
        let namespace = end.namespace.clone();
        tokio::task::spawn_blocking(move || nft(namespace.as_deref(), &script))
            .await
            .map_err(|e| {
                LinkError::Unavailable(format!("the nft task of {table} failed: {e}"))
            })??;
    }
    down.store(to_down, Ordering::Relaxed);
    info!(down = to_down, "emulated link toggled");
    Ok(())
}

/// The third octet for slot `slot`: this process's own (its pid mod 256) unless another
/// process (a pid 256 apart) has the slot's host address already, then the next free one, so
/// two processes' links never share an address.
fn free_subnet(slot: usize) -> u8 {
    let assigned = Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let pid = std::process::id();
    (0..256)
        .map(|k| ((pid + k) % 256) as u8)
        .find(|third| {
            let host = Plan::new(slot, *third).host;
            !assigned.contains(&format!("inet {host}/"))
                && !assigned.contains(&format!("inet {host} "))
        })
        .unwrap_or((pid % 256) as u8)
}

fn open_tun(name: &str) -> Result<Tun, LinkError> {
    let mut tuns = Tun::builder()
        .name(name)
        .build()
        .map_err(|source| LinkError::Tun {
            name: name.to_string(),
            source,
        })?;
    tuns.pop()
        .ok_or_else(|| LinkError::Unavailable(format!("no TUN device {name} was made")))
}

/// A `tbf` qdisc shaping `dev`'s egress (in `namespace`, or the root one) to `rate`.
fn tbf(namespace: Option<&str>, dev: &str, rate: Rate) -> Result<(), LinkError> {
    let bytes_per_second = rate.bytes_per_second();
    // A burst of 10 ms at the rate, never under two full-size packets: tbf needs at least one
    // timer tick's worth, and bursts longer than that would let slow links spike.
    let burst = ((bytes_per_second * 0.010) as u64).max(3_028);
    let limit = ((bytes_per_second * TBF_QUEUE.as_secs_f64()) as u64).max(16 * 1_514);
    let (rate, burst, limit) = (rate.to_string(), burst.to_string(), limit.to_string());
    let mut args = Vec::new();
    if let Some(ns) = namespace {
        args.extend(["-n", ns]);
    }
    args.extend([
        "qdisc", "add", "dev", dev, "root", "tbf", "rate", &rate, "burst", &burst, "limit", &limit,
    ]);
    run("tc", &args, None)
}

fn ip(args: &[&str]) -> Result<(), LinkError> {
    run("ip", args, None)
}

/// `nft -f -` with `script`, in `namespace` or the root one.
fn nft(namespace: Option<&str>, script: &str) -> Result<(), LinkError> {
    match namespace {
        None => run("nft", &["-f", "-"], Some(script)),
        Some(ns) => run("ip", &["netns", "exec", ns, "nft", "-f", "-"], Some(script)),
    }
}

/// Runs `program args`, with `stdin` piped in if given, failing with its stderr.
fn run(program: &'static str, args: &[&str], stdin: Option<&str>) -> Result<(), LinkError> {
    use std::io::Write;
    let spawn_err = |source| LinkError::Spawn { program, source };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .expect("piped stdin")
            .write_all(text.as_bytes())
            .map_err(spawn_err)?;
    }
    let out = child.wait_with_output().map_err(spawn_err)?;
    if !out.status.success() {
        let command = match stdin {
            Some(text) => format!("{program} {} <<< {}", args.join(" "), text.trim()),
            None => format!("{program} {}", args.join(" ")),
        };
        return Err(LinkError::Command {
            command,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// Whether this process can make links: root, `ip`, `tc`, `nft` and `/dev/net/tun`. The error
/// says what is missing and what to do.
pub fn check_available() -> Result<(), LinkError> {
    if !nix::unistd::geteuid().is_root() {
        return Err(LinkError::Unavailable(
            "an emulated link makes a network namespace, TUN devices, qdiscs and nftables rules, which needs root; run as root".into(),
        ));
    }
    for (program, arg, package) in [
        ("ip", "-V", "iproute2"),
        ("tc", "-V", "iproute2"),
        ("ss", "-V", "iproute2"),
        ("nft", "--version", "nftables"),
    ] {
        let ok = Command::new(program)
            .arg(arg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return Err(LinkError::Unavailable(format!(
                "an emulated link runs `{program}`, which is not installed; install {package}"
            )));
        }
    }
    if std::fs::metadata("/dev/net/tun").is_err() {
        return Err(LinkError::Unavailable(
            "an emulated link's delay line needs /dev/net/tun (the tun module); load it or run where it exists".into(),
        ));
    }
    Ok(())
}

/// Disables IPv6 on one end of a link before it is brought up, so the device's own chatter
/// (router solicitations, DAD, MLD reports, sent as it comes up) never reaches the link and
/// its counters show only what the probes and agents sent. Disabled after the device is up,
/// a packet of that chatter could already wait in the TUN device and be counted whenever
/// the delay line first read it. A kernel without IPv6 has no such chatter: the knob's
/// absence is no error.
fn quiet_ipv6(end: &Receiver) {
    let knob = format!("net.ipv6.conf.{}.disable_ipv6=1", end.dev);
    let _ = match &end.namespace {
        None => run("sysctl", &["-qw", &knob], None),
        Some(ns) => run("ip", &["netns", "exec", ns, "sysctl", "-qw", &knob], None),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_held_until_given_back_and_there_are_at_most_max_links() {
        let taken: Vec<usize> = std::iter::from_fn(take_slot).collect();
        assert_eq!(taken, (0..MAX_LINKS).collect::<Vec<_>>());
        assert_eq!(take_slot(), None);
        give_back(17);
        assert_eq!(take_slot(), Some(17));
        for slot in taken {
            give_back(slot);
        }
        assert_eq!(take_slot(), Some(0));
        give_back(0);
    }

    #[test]
    fn each_link_has_its_own_slash_30_and_short_interface_names() {
        for slot in 0..MAX_LINKS {
            let p = Plan::new(slot, 7);
            assert!(p.host_if.len() <= 15 && p.inside_if.len() <= 15, "{p:?}");
            let ([a, b, c, h], [.., i]) = (p.host.octets(), p.inside.octets());
            assert_eq!((a, b), (10, 214));
            assert_eq!((h, i), (4 * slot as u8 + 1, 4 * slot as u8 + 2));
            assert_eq!(c, p.inside.octets()[2]);
        }
    }
}
