//! The session protocol end to end, on a simulated link with a virtual clock: no sockets, no
//! real time. Each test drives a hub and an agent session against each other the way the
//! gateway and agent drivers do, and checks what a user of either side would notice.

use std::collections::VecDeque;
use std::time::Duration;

use flotilla_proto::PROTOCOL_VERSION;
use flotilla_proto::session::{
    AgentConfig, AgentEvent, AgentSession, CloseReason, DesiredWork, HeldWork, HubConfig, HubEvent,
    HubSession, MAX_CSR_BYTES, ProtocolError, renew_at,
};
use flotilla_proto::wire::{self, agent_frame, hub_frame};
use tokio::time::Instant;

const CLUSTER: &str = "store-0042";
const INTERVAL: Duration = Duration::from_secs(10);
const TIMEOUT: Duration = Duration::from_secs(30);
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
const WELCOME_TIMEOUT: Duration = Duration::from_secs(15);
const MAX_PENDING: usize = 8;

fn hub_config() -> HubConfig {
    HubConfig {
        heartbeat_interval: INTERVAL,
        heartbeat_timeout: TIMEOUT,
        hello_timeout: HELLO_TIMEOUT,
        max_pending_works: MAX_PENDING,
    }
}

fn agent_config(cluster: &str) -> AgentConfig {
    AgentConfig {
        cluster_name: cluster.to_string(),
        agent_version: "0.1.0".to_string(),
        kubernetes_version: "v1.36.0".to_string(),
        claims: vec![wire::ClusterClaim {
            name: "region.open-cluster-management.io".to_string(),
            value: "eu-west".to_string(),
        }],
        welcome_timeout: WELCOME_TIMEOUT,
    }
}

/// The desired state of work `uid` at `generation`; its content hash follows the generation.
fn work(uid: &str, generation: i64) -> DesiredWork {
    DesiredWork {
        uid: uid.to_string(),
        namespace: CLUSTER.to_string(),
        name: format!("work-{uid}"),
        generation,
        content_hash: format!("hash-{generation}"),
        manifest_work_json: format!(r#"{{"uid":"{uid}","generation":{generation}}}"#).into(),
        kind: String::new(),
    }
}

/// What an agent holds of `uid` when it stored `generation` of [`work`].
fn held(uid: &str, generation: i64) -> HeldWork {
    HeldWork {
        uid: uid.to_string(),
        generation,
        content_hash: format!("hash-{generation}"),
    }
}

/// One direction of the simulated network.
struct Link<F> {
    /// Frames on the wire with the instant they arrive.
    in_flight: VecDeque<(Instant, F)>,
    latency: Duration,
    /// Frames the sender writes are lost.
    dropping: bool,
    /// The sender's transport accepts nothing: frames stay in the session's own queue, which
    /// is where coalescing and the queue bound act.
    stalled: bool,
}

impl<F> Link<F> {
    fn new() -> Self {
        Self {
            in_flight: VecDeque::new(),
            latency: Duration::from_millis(20),
            dropping: false,
            stalled: false,
        }
    }

    fn send(&mut self, now: Instant, frame: F) {
        if !self.dropping {
            self.in_flight.push_back((now + self.latency, frame));
        }
    }

    fn due(&mut self, now: Instant) -> Option<F> {
        match self.in_flight.front() {
            Some((at, _)) if *at <= now => self.in_flight.pop_front().map(|(_, f)| f),
            _ => None,
        }
    }

    fn next_arrival(&self) -> Option<Instant> {
        self.in_flight.front().map(|(at, _)| *at)
    }
}

/// A hub session and an agent session joined by two [`Link`]s, with the parts of the drivers
/// that matter here: the gateway begins the sync with `desired` on `Established`, the agent
/// acks every work it receives when `auto_ack` is set.
struct Sim {
    now: Instant,
    hub: HubSession,
    agent: AgentSession,
    to_hub: Link<wire::AgentFrame>,
    to_agent: Link<wire::HubFrame>,
    desired: Vec<DesiredWork>,
    auto_ack: bool,
    hub_events: Vec<HubEvent>,
    agent_events: Vec<AgentEvent>,
    hub_errors: Vec<ProtocolError>,
    agent_errors: Vec<ProtocolError>,
    /// Every frame the agent received, in order.
    agent_received: Vec<wire::HubFrame>,
    /// Every frame the hub received, in order.
    hub_received: Vec<wire::AgentFrame>,
}

impl Sim {
    fn new(
        identity: &str,
        hello_cluster: &str,
        held: Vec<HeldWork>,
        desired: Vec<DesiredWork>,
    ) -> Self {
        let now = Instant::now();
        Self {
            now,
            hub: HubSession::new(now, hub_config(), identity, "session-1"),
            agent: AgentSession::new(now, agent_config(hello_cluster), held),
            to_hub: Link::new(),
            to_agent: Link::new(),
            desired,
            auto_ack: true,
            hub_events: Vec::new(),
            agent_events: Vec::new(),
            hub_errors: Vec::new(),
            agent_errors: Vec::new(),
            agent_received: Vec::new(),
            hub_received: Vec::new(),
        }
    }

    /// A pair for cluster [`CLUSTER`], driven until the handshake and the sync are done.
    fn synced(held: Vec<HeldWork>, desired: Vec<DesiredWork>) -> Self {
        let mut sim = Sim::new(CLUSTER, CLUSTER, held, desired);
        sim.settle();
        assert!(sim.hub.is_synced(), "sync did not finish");
        sim
    }

    /// Moves frames, fires timers and runs the drivers' reactions until `d` of virtual time
    /// has passed.
    fn run_for(&mut self, d: Duration) {
        let deadline = self.now + d;
        for _ in 0..1_000_000 {
            self.pump();
            let next = [
                self.to_hub.next_arrival(),
                self.to_agent.next_arrival(),
                self.hub.poll_timeout(),
                self.agent.poll_timeout(),
            ]
            .into_iter()
            .flatten()
            .min();
            match next {
                Some(at) if at <= deadline => {
                    self.now = self.now.max(at);
                    self.hub.handle_timeout(self.now);
                    self.agent.handle_timeout(self.now);
                }
                _ => {
                    self.now = deadline;
                    self.pump();
                    return;
                }
            }
        }
        panic!("simulation did not reach its deadline: a timer that never advances?");
    }

    /// Long enough for any frame in flight to land and be answered, short of a heartbeat.
    fn settle(&mut self) {
        self.run_for(Duration::from_secs(1));
    }

    /// Everything that can happen at `now` without time passing.
    fn pump(&mut self) {
        loop {
            let mut progress = false;
            if !self.to_agent.stalled {
                while let Some(frame) = self.hub.poll_transmit() {
                    self.to_agent.send(self.now, frame);
                    progress = true;
                }
            }
            if !self.to_hub.stalled {
                while let Some(frame) = self.agent.poll_transmit() {
                    self.to_hub.send(self.now, frame);
                    progress = true;
                }
            }
            while let Some(frame) = self.to_hub.due(self.now) {
                self.hub_received.push(frame.clone());
                if let Err(e) = self.hub.handle_frame(self.now, frame) {
                    self.hub_errors.push(e);
                }
                progress = true;
            }
            while let Some(frame) = self.to_agent.due(self.now) {
                self.agent_received.push(frame.clone());
                if let Err(e) = self.agent.handle_frame(self.now, frame) {
                    self.agent_errors.push(e);
                }
                progress = true;
            }
            while let Some(event) = self.hub.poll_event() {
                if let HubEvent::Established { .. } = event {
                    self.hub.begin_sync(self.desired.clone());
                }
                self.hub_events.push(event);
                progress = true;
            }
            while let Some(event) = self.agent.poll_event() {
                if let AgentEvent::WorkReceived { work } = &event
                    && self.auto_ack
                {
                    self.agent.ack_work(work.uid.clone(), work.generation);
                }
                self.agent_events.push(event);
                progress = true;
            }
            if !progress {
                return;
            }
        }
    }

    fn hub_closed(&self) -> Option<(&CloseReason, bool)> {
        self.hub_events.iter().find_map(|e| match e {
            HubEvent::Closed { reason, by_peer } => Some((reason, *by_peer)),
            _ => None,
        })
    }

    fn agent_closed(&self) -> Option<(&CloseReason, bool)> {
        self.agent_events.iter().find_map(|e| match e {
            AgentEvent::Closed { reason, by_peer } => Some((reason, *by_peer)),
            _ => None,
        })
    }

    /// The work frames the agent received, as `("update", uid, generation)` or
    /// `("delete", uid, 0)`, in order.
    fn work_frames(&self) -> Vec<(&'static str, String, i64)> {
        self.agent_received
            .iter()
            .filter_map(|f| match &f.frame {
                Some(hub_frame::Frame::WorkUpdate(u)) => {
                    Some(("update", u.uid.clone(), u.generation))
                }
                Some(hub_frame::Frame::WorkDelete(d)) => Some(("delete", d.uid.clone(), 0)),
                _ => None,
            })
            .collect()
    }

    fn synced_events(&self) -> Vec<u32> {
        self.agent_events
            .iter()
            .filter_map(|e| match e {
                AgentEvent::Synced { sent } => Some(*sent),
                _ => None,
            })
            .collect()
    }

    fn clear_logs(&mut self) {
        self.hub_events.clear();
        self.agent_events.clear();
        self.agent_received.clear();
        self.hub_received.clear();
    }
}

fn hello(version: u32, cluster: &str) -> wire::AgentFrame {
    wire::AgentFrame {
        frame: Some(agent_frame::Frame::Hello(wire::Hello {
            protocol_version: version,
            cluster_name: cluster.to_string(),
            ..Default::default()
        })),
    }
}

fn goodbye_reason(frame: Option<wire::HubFrame>) -> String {
    match frame.and_then(|f| f.frame) {
        Some(hub_frame::Frame::Goodbye(g)) => g.reason,
        other => panic!("expected a Goodbye frame, got {other:?}"),
    }
}

#[test]
fn handshake_establishes_both_sides() {
    let mut sim = Sim::new(CLUSTER, CLUSTER, vec![], vec![]);
    sim.settle();

    assert!(sim.hub.is_established() && sim.agent.is_established());
    let hello = sim
        .hub_events
        .iter()
        .find_map(|e| match e {
            HubEvent::Established { hello } => Some(hello),
            _ => None,
        })
        .expect("hub saw the hello");
    assert_eq!(hello.cluster_name, CLUSTER);
    assert_eq!(hello.protocol_version, PROTOCOL_VERSION);
    assert_eq!(hello.kubernetes_version, "v1.36.0");
    assert_eq!(hello.claims[0].value, "eu-west");
    assert_eq!(
        sim.agent_events[0],
        AgentEvent::Established {
            session_id: "session-1".to_string(),
            heartbeat_interval: INTERVAL,
            heartbeat_timeout: TIMEOUT,
        }
    );
    assert_eq!(sim.synced_events(), vec![0]);
    assert!(sim.hub_errors.is_empty() && sim.agent_errors.is_empty());
}

#[test]
fn identity_mismatch_closes_with_both_names() {
    let mut sim = Sim::new("store-0042", "store-0666", vec![], vec![]);
    sim.settle();

    let expected = CloseReason::IdentityMismatch {
        cert: "store-0042".to_string(),
        hello: "store-0666".to_string(),
    };
    assert_eq!(sim.hub_closed(), Some((&expected, false)));
    assert_eq!(
        expected.to_string(),
        "certificate identity store-0042 does not match hello cluster store-0666"
    );
    assert!(!sim.hub_errors[0].is_retryable());
    // The agent learns why, in words, and nothing else was sent to it.
    assert_eq!(
        sim.agent_closed(),
        Some((&CloseReason::PeerGoodbye(expected.to_string()), true))
    );
    assert_eq!(sim.agent_received.len(), 1);
    assert!(sim.hub.is_closed() && sim.agent.is_closed());
}

#[test]
fn wrong_protocol_version_is_refused_by_the_hub() {
    let now = Instant::now();
    let mut hub = HubSession::new(now, hub_config(), CLUSTER, "s");

    let err = hub.handle_frame(now, hello(99, CLUSTER)).unwrap_err();

    assert_eq!(
        err,
        ProtocolError::ProtocolVersion {
            got: 99,
            ours: PROTOCOL_VERSION
        }
    );
    assert!(!err.is_retryable());
    assert!(hub.is_closed());
    let reason = goodbye_reason(hub.poll_transmit());
    assert!(reason.contains("version 99"), "{reason}");
    assert_eq!(hub.poll_transmit(), None, "no welcome after a refusal");
    assert_eq!(
        hub.poll_event(),
        Some(HubEvent::Closed {
            reason: CloseReason::ProtocolVersion { got: 99 },
            by_peer: false
        })
    );
}

#[test]
fn wrong_protocol_version_is_refused_by_the_agent() {
    let now = Instant::now();
    let mut agent = AgentSession::new(now, agent_config(CLUSTER), vec![]);
    let welcome = wire::HubFrame {
        frame: Some(hub_frame::Frame::Welcome(wire::Welcome {
            protocol_version: 7,
            session_id: "s".to_string(),
            heartbeat_interval_ms: 10_000,
            heartbeat_timeout_ms: 30_000,
        })),
    };

    let err = agent.handle_frame(now, welcome).unwrap_err();

    assert!(matches!(err, ProtocolError::ProtocolVersion { got: 7, .. }));
    assert!(agent.is_closed());
    assert!(matches!(
        agent.poll_event(),
        Some(AgentEvent::Closed {
            reason: CloseReason::ProtocolVersion { got: 7 },
            by_peer: false
        })
    ));
}

#[test]
fn hello_timeout_closes_a_silent_connection() {
    let start = Instant::now();
    let mut hub = HubSession::new(start, hub_config(), CLUSTER, "s");
    assert_eq!(hub.poll_timeout(), Some(start + HELLO_TIMEOUT));

    hub.handle_timeout(start + HELLO_TIMEOUT - Duration::from_millis(1));
    assert!(!hub.is_closed(), "closed before the deadline");
    hub.handle_timeout(start + HELLO_TIMEOUT);

    assert!(hub.is_closed());
    assert_eq!(hub.poll_timeout(), None);
    assert_eq!(
        hub.poll_event(),
        Some(HubEvent::Closed {
            reason: CloseReason::HandshakeTimeout {
                waited: HELLO_TIMEOUT
            },
            by_peer: false
        })
    );
}

#[test]
fn agent_gives_up_when_no_welcome_comes() {
    let mut sim = Sim::new(CLUSTER, CLUSTER, vec![], vec![]);
    sim.to_agent.dropping = true;

    sim.run_for(WELCOME_TIMEOUT + Duration::from_secs(1));

    assert_eq!(
        sim.agent_closed(),
        Some((
            &CloseReason::HandshakeTimeout {
                waited: WELCOME_TIMEOUT
            },
            false
        ))
    );
}

#[test]
fn a_frame_before_hello_is_a_protocol_error() {
    let now = Instant::now();
    let mut hub = HubSession::new(now, hub_config(), CLUSTER, "s");
    let heartbeat = wire::AgentFrame {
        frame: Some(agent_frame::Frame::Heartbeat(wire::Heartbeat { seq: 1 })),
    };

    let err = hub.handle_frame(now, heartbeat).unwrap_err();

    assert_eq!(
        err.to_string(),
        "unexpected Heartbeat frame while waiting for hello"
    );
    assert!(err.is_retryable());
    assert!(hub.is_closed());
    // And a second hello on an established session is one too.
    let mut hub = HubSession::new(now, hub_config(), CLUSTER, "s");
    hub.handle_frame(now, hello(PROTOCOL_VERSION, CLUSTER))
        .unwrap();
    assert!(matches!(
        hub.handle_frame(now, hello(PROTOCOL_VERSION, CLUSTER)),
        Err(ProtocolError::UnexpectedFrame { frame: "Hello", .. })
    ));
}

#[test]
fn heartbeats_keep_a_quiet_session_alive() {
    let mut sim = Sim::synced(vec![], vec![]);
    let hours = Duration::from_secs(2 * 3600);

    sim.run_for(hours);

    assert!(!sim.hub.is_closed() && !sim.agent.is_closed());
    let alive = sim
        .hub_events
        .iter()
        .filter(|e| matches!(e, HubEvent::Alive { .. }))
        .count();
    let intervals = (hours.as_secs() / INTERVAL.as_secs()) as usize;
    assert!(
        (intervals - 1..=intervals).contains(&alive),
        "{alive} Alive events in {intervals} intervals"
    );
    let echoes = sim
        .agent_received
        .iter()
        .filter(|f| matches!(f.frame, Some(hub_frame::Frame::Heartbeat(_))))
        .count();
    assert_eq!(echoes, alive, "every heartbeat is echoed");
}

#[test]
fn alive_is_at_most_once_per_interval_however_often_the_agent_beats() {
    let start = Instant::now();
    let mut hub = HubSession::new(start, hub_config(), CLUSTER, "s");
    hub.handle_frame(start, hello(PROTOCOL_VERSION, CLUSTER))
        .unwrap();
    for i in 0..100u64 {
        let at = start + Duration::from_secs(i);
        let hb = wire::AgentFrame {
            frame: Some(agent_frame::Frame::Heartbeat(wire::Heartbeat { seq: i })),
        };
        hub.handle_frame(at, hb).unwrap();
    }
    let alive: Vec<Instant> = std::iter::from_fn(|| hub.poll_event())
        .filter_map(|e| match e {
            HubEvent::Alive { at } => Some(at),
            _ => None,
        })
        .collect();
    assert_eq!(alive.len(), 10);
    assert!(alive.windows(2).all(|w| w[1] - w[0] >= INTERVAL));
}

#[test]
fn lost_hub_frames_close_the_agent_then_the_hub_learns_why() {
    let mut sim = Sim::synced(vec![], vec![]);
    sim.to_agent.dropping = true;

    sim.run_for(TIMEOUT + INTERVAL);

    let timeout = CloseReason::HeartbeatTimeout {
        silent_for: TIMEOUT,
    };
    assert_eq!(sim.agent_closed(), Some((&timeout, false)));
    assert!(
        timeout
            .to_string()
            .starts_with("heartbeat timeout after 30s")
    );
    // The agent→hub direction still works: the hub gets the agent's goodbye.
    assert_eq!(
        sim.hub_closed(),
        Some((&CloseReason::PeerGoodbye(timeout.to_string()), true))
    );
}

#[test]
fn a_dead_link_closes_both_sides_by_heartbeat_timeout() {
    let mut sim = Sim::synced(vec![], vec![]);
    sim.to_agent.dropping = true;
    sim.to_hub.dropping = true;

    sim.run_for(TIMEOUT - Duration::from_secs(1));
    assert!(
        !sim.hub.is_closed() && !sim.agent.is_closed(),
        "closed early"
    );
    sim.run_for(INTERVAL);

    let timeout = CloseReason::HeartbeatTimeout {
        silent_for: TIMEOUT,
    };
    assert_eq!(sim.agent_closed(), Some((&timeout, false)));
    assert_eq!(sim.hub_closed(), Some((&timeout, false)));
}

#[test]
fn resume_up_to_date_agent_gets_only_sync_complete() {
    let desired = vec![work("a", 3), work("b", 1)];
    let sim = Sim::synced(vec![held("a", 3), held("b", 1)], desired);

    assert_eq!(sim.work_frames(), vec![]);
    assert_eq!(sim.synced_events(), vec![0]);
}

#[test]
fn resume_sends_exactly_what_differs() {
    let held = vec![
        held("stale", 1),
        held("gone", 4),
        held("current", 2),
        // Same generation, other content (say, the hub was restored): the hub is the truth.
        HeldWork {
            content_hash: "hash-from-elsewhere".to_string(),
            ..self::held("rewritten", 5)
        },
    ];
    let desired = vec![
        work("stale", 2),
        work("current", 2),
        work("new", 1),
        work("rewritten", 5),
    ];

    let sim = Sim::synced(held, desired);

    assert_eq!(
        sim.work_frames(),
        vec![
            ("update", "stale".to_string(), 2),
            ("update", "new".to_string(), 1),
            ("update", "rewritten".to_string(), 5),
            ("delete", "gone".to_string(), 0),
        ]
    );
    assert_eq!(sim.synced_events(), vec![4]);
    // SyncComplete comes after every work frame of the sync.
    assert!(matches!(
        sim.agent_received.last().and_then(|f| f.frame.as_ref()),
        Some(hub_frame::Frame::SyncComplete(_))
    ));
}

#[test]
fn live_changes_made_before_the_snapshot_arrives_are_not_undone_by_it() {
    // The gateway takes its snapshot asynchronously: a delete and an update that reached the
    // session in the meantime are newer than the snapshot and must survive it.
    let now = Instant::now();
    let mut hub = HubSession::new(now, hub_config(), CLUSTER, "s");
    let hello = wire::AgentFrame {
        frame: Some(agent_frame::Frame::Hello(wire::Hello {
            protocol_version: PROTOCOL_VERSION,
            cluster_name: CLUSTER.to_string(),
            held: vec![held("deleted", 1), held("updated", 1)],
            ..Default::default()
        })),
    };
    hub.handle_frame(now, hello).unwrap();
    hub.delete_work("deleted", CLUSTER, "work-deleted");
    hub.upsert_work(work("updated", 3));

    hub.begin_sync(vec![work("deleted", 1), work("updated", 2)]);

    let frames: Vec<_> = std::iter::from_fn(|| hub.poll_transmit())
        .filter_map(|f| f.frame)
        .collect();
    assert!(matches!(frames[0], hub_frame::Frame::Welcome(_)));
    assert!(matches!(&frames[1], hub_frame::Frame::WorkDelete(d) if d.uid == "deleted"));
    assert!(
        matches!(&frames[2], hub_frame::Frame::WorkUpdate(u) if u.uid == "updated" && u.generation == 3)
    );
    assert_eq!(
        frames[3],
        hub_frame::Frame::SyncComplete(wire::SyncComplete { sent: 2 })
    );
    assert_eq!(frames.len(), 4);
}

#[test]
fn updates_to_one_work_coalesce_while_the_link_is_stalled() {
    let mut sim = Sim::synced(vec![], vec![]);
    sim.clear_logs();
    sim.to_agent.stalled = true;

    for generation in 1..=10 {
        sim.hub.upsert_work(work("a", generation));
    }
    assert_eq!(sim.hub.pending_works(), 1);
    sim.to_agent.stalled = false;
    sim.settle();

    assert_eq!(sim.work_frames(), vec![("update", "a".to_string(), 10)]);
    // The agent acked it and the hub knows that is the generation it sent.
    assert!(sim.hub_events.contains(&HubEvent::WorkAcked {
        uid: "a".to_string(),
        generation: 10,
        current: true
    }));
}

#[test]
fn delete_supersedes_a_pending_update() {
    let mut sim = Sim::synced(vec![held("a", 1)], vec![work("a", 1)]);
    sim.clear_logs();
    sim.to_agent.stalled = true;

    sim.hub.upsert_work(work("a", 2));
    sim.hub.delete_work("a", CLUSTER, "work-a");
    sim.to_agent.stalled = false;
    sim.settle();

    assert_eq!(sim.work_frames(), vec![("delete", "a".to_string(), 0)]);
    assert!(sim.agent_events.contains(&AgentEvent::WorkDeleted {
        uid: "a".to_string(),
        namespace: CLUSTER.to_string(),
        name: "work-a".to_string(),
    }));
}

#[test]
fn coalescing_rules() {
    // (what the agent holds, the live changes while stalled, what the agent receives)
    type Change = (&'static str, i64); // ("up", generation) or ("del", 0)
    let check = |held_gen: Option<i64>, changes: &[Change], expected: &[(&str, i64)]| {
        let held = held_gen.map(|g| vec![held("w", g)]).unwrap_or_default();
        let desired = held_gen.map(|g| vec![work("w", g)]).unwrap_or_default();
        let mut sim = Sim::synced(held, desired);
        sim.clear_logs();
        sim.to_agent.stalled = true;
        for &(op, generation) in changes {
            match op {
                "up" => sim.hub.upsert_work(work("w", generation)),
                "del" => sim.hub.delete_work("w", CLUSTER, "work-w"),
                _ => unreachable!(),
            }
        }
        sim.to_agent.stalled = false;
        sim.settle();
        let got: Vec<(&str, i64)> = sim
            .work_frames()
            .into_iter()
            .map(|(k, _, g)| (k, g))
            .collect();
        assert_eq!(got, expected, "held {held_gen:?}, changes {changes:?}");
    };

    // An update after a pending delete replaces it.
    check(Some(1), &[("del", 0), ("up", 2)], &[("update", 2)]);
    // ... and if the agent already has that update, nothing is sent at all.
    check(Some(1), &[("del", 0), ("up", 1)], &[]);
    // A stale generation does not replace a newer pending one.
    check(Some(1), &[("up", 3), ("up", 2)], &[("update", 3)]);
    // A work the agent never received and that is deleted again costs nothing.
    check(None, &[("up", 1), ("del", 0)], &[]);
    // Deleting what the agent never had sends nothing.
    check(None, &[("del", 0)], &[]);
    // A live update the agent already holds is skipped.
    check(Some(4), &[("up", 4)], &[]);
}

#[test]
fn overflow_closes_so_the_agent_resyncs() {
    let mut sim = Sim::synced(vec![], vec![]);
    sim.to_agent.stalled = true;

    for i in 0..MAX_PENDING {
        sim.hub.upsert_work(work(&format!("w{i}"), 1));
    }
    assert!(!sim.hub.is_closed(), "the bound itself is allowed");
    sim.hub.upsert_work(work("one-too-many", 1));
    sim.pump();

    let overflow = CloseReason::QueueOverflow { limit: MAX_PENDING };
    assert_eq!(sim.hub_closed(), Some((&overflow, false)));
    assert!(overflow.to_string().contains("not keeping up"));
    sim.to_agent.stalled = false;
    sim.settle();
    assert_eq!(
        sim.work_frames(),
        vec![],
        "pending work is dropped, not flushed"
    );
    assert_eq!(
        sim.agent_closed(),
        Some((&CloseReason::PeerGoodbye(overflow.to_string()), true))
    );

    // The next session resumes and delivers the latest state in one sync.
    let desired: Vec<_> = (0..MAX_PENDING)
        .map(|i| work(&format!("w{i}"), 1))
        .collect();
    let sim = Sim::synced(vec![], desired);
    assert_eq!(sim.synced_events(), vec![MAX_PENDING as u32]);
}

#[test]
fn the_initial_sync_is_never_refused_by_the_bound() {
    let desired: Vec<_> = (0..3 * MAX_PENDING)
        .map(|i| work(&format!("w{i}"), 1))
        .collect();
    let sim = Sim::synced(vec![], desired);
    assert_eq!(sim.synced_events(), vec![3 * MAX_PENDING as u32]);
    assert!(!sim.hub.is_closed());
}

#[test]
fn drain_tells_the_agent_when_to_come_back() {
    let mut sim = Sim::synced(vec![], vec![]);
    let retry_after = Duration::from_secs(45);

    sim.hub.drain(retry_after, "gateway shutting down");
    sim.settle();

    let drained = CloseReason::Drained {
        retry_after,
        reason: "gateway shutting down".to_string(),
    };
    assert_eq!(sim.hub_closed(), Some((&drained, false)));
    assert!(sim.agent_events.contains(&AgentEvent::Drained {
        retry_after,
        reason: "gateway shutting down".to_string(),
        redirect: None,
    }));
    assert_eq!(sim.agent_closed(), Some((&drained, true)));
    assert_eq!(
        drained.to_string(),
        "drained by the hub (gateway shutting down); reconnect after 45s"
    );
    // Nothing more is asked of either side.
    assert_eq!(sim.hub.poll_timeout(), None);
    assert_eq!(sim.agent.poll_timeout(), None);
}

#[test]
fn a_redirect_names_the_owner_before_the_hello_and_after_it() {
    // Before the hello (admission: this gateway does not own the shard) and on a live session
    // (the shard moved away), the agent learns where to go and when.
    for established in [false, true] {
        let mut sim = if established {
            Sim::synced(vec![], vec![])
        } else {
            Sim::new(CLUSTER, CLUSTER, vec![], vec![])
        };
        sim.hub.redirect(
            Duration::ZERO,
            Some("10.0.0.7:9443".to_string()),
            "shard 12 is owned by gateway gw-2",
        );
        sim.settle();
        assert!(
            sim.agent_events.contains(&AgentEvent::Drained {
                retry_after: Duration::ZERO,
                reason: "shard 12 is owned by gateway gw-2".to_string(),
                redirect: Some("10.0.0.7:9443".to_string()),
            }),
            "established {established}: {:?}",
            sim.agent_events
        );
        assert!(sim.agent.is_closed() && sim.hub.is_closed());
    }
}

#[test]
fn agent_goodbye_closes_the_hub_side() {
    let mut sim = Sim::synced(vec![], vec![]);

    sim.agent.close("agent shutting down");
    sim.settle();

    assert_eq!(
        sim.hub_closed(),
        Some((
            &CloseReason::PeerGoodbye("closed locally: agent shutting down".to_string()),
            true
        ))
    );
    assert_eq!(
        sim.agent_closed(),
        Some((
            &CloseReason::Local("agent shutting down".to_string()),
            false
        ))
    );
}

#[test]
fn acks_and_status_round_trip() {
    let mut sim = Sim::synced(vec![], vec![work("a", 1)]);
    assert!(sim.hub_events.contains(&HubEvent::WorkAcked {
        uid: "a".to_string(),
        generation: 1,
        current: true
    }));

    sim.agent
        .report_status("a", 1, 6, b"{\"old\":true}".to_vec());
    sim.agent
        .report_status("a", 1, 7, b"{\"conditions\":[]}".to_vec());
    sim.settle();
    let reported: Vec<_> = sim
        .hub_events
        .iter()
        .filter(|e| matches!(e, HubEvent::StatusReported { .. }))
        .collect();
    assert_eq!(
        reported,
        vec![&HubEvent::StatusReported {
            uid: "a".to_string(),
            generation: 1,
            seq: 7,
            status_json: b"{\"conditions\":[]}".to_vec(),
        }],
        "statuses coalesce: only the newest is sent"
    );

    sim.hub.ack_status("a", 7);
    sim.settle();
    assert!(sim.agent_events.contains(&AgentEvent::StatusAcked {
        uid: "a".to_string(),
        seq: 7
    }));
}

#[test]
fn acks_that_do_not_match_what_was_sent_are_flagged() {
    let mut sim = Sim::synced(vec![], vec![work("a", 2)]);
    sim.clear_logs();

    sim.agent.ack_work("never-sent", 1);
    sim.agent.ack_work("a", 1);
    sim.settle();

    assert!(sim.hub_events.contains(&HubEvent::WorkAcked {
        uid: "never-sent".to_string(),
        generation: 1,
        current: false
    }));
    assert!(sim.hub_events.contains(&HubEvent::WorkAcked {
        uid: "a".to_string(),
        generation: 1,
        current: false
    }));
    assert!(!sim.hub.is_closed());
}

#[test]
fn tunnel_requests_reach_the_agent() {
    let mut sim = Sim::synced(vec![], vec![]);

    sim.hub.open_tunnel("tunnel-17");
    sim.settle();

    assert!(sim.agent_events.contains(&AgentEvent::TunnelRequested {
        id: "tunnel-17".to_string(),
        bytes: true,
    }));
}

#[test]
fn heartbeat_echoes_jump_a_work_backlog() {
    let now = Instant::now();
    let mut hub = HubSession::new(now, hub_config(), CLUSTER, "s");
    hub.handle_frame(now, hello(PROTOCOL_VERSION, CLUSTER))
        .unwrap();
    hub.begin_sync((0..5).map(|i| work(&format!("w{i}"), 1)));
    assert!(matches!(
        hub.poll_transmit().and_then(|f| f.frame),
        Some(hub_frame::Frame::Welcome(_))
    ));

    let hb = wire::AgentFrame {
        frame: Some(agent_frame::Frame::Heartbeat(wire::Heartbeat { seq: 9 })),
    };
    hub.handle_frame(now, hb).unwrap();

    assert_eq!(
        hub.poll_transmit().and_then(|f| f.frame),
        Some(hub_frame::Frame::Heartbeat(wire::Heartbeat { seq: 9 }))
    );
}

// ---- certificate rotation over the live session ----

fn renewal_requests(sim: &Sim) -> Vec<String> {
    sim.hub_events
        .iter()
        .filter_map(|e| match e {
            HubEvent::RenewalRequested { csr_pem } => Some(csr_pem.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn renewal_round_trip_keeps_the_session() {
    let mut sim = Sim::synced(vec![], vec![work("a", 1)]);
    sim.clear_logs();

    assert!(sim.agent.renew_certificate("CSR-1"));
    assert!(sim.agent.is_renewing());
    sim.settle();
    assert_eq!(renewal_requests(&sim), vec!["CSR-1".to_string()]);

    sim.hub.issue_certificate("CERT-2", "BUNDLE");
    sim.settle();
    assert!(sim.agent_events.contains(&AgentEvent::CertificateIssued {
        certificate_pem: "CERT-2".to_string(),
        ca_bundle_pem: "BUNDLE".to_string(),
    }));
    assert!(!sim.agent.is_renewing());

    // Well past several heartbeat timeouts: the session that renewed is the session that lives.
    sim.run_for(TIMEOUT * 4);
    assert!(sim.hub_closed().is_none() && sim.agent_closed().is_none());
    assert!(sim.hub.is_established() && sim.agent.is_established());
    assert!(sim.hub_errors.is_empty() && sim.agent_errors.is_empty());
}

#[test]
fn one_renewal_at_a_time_and_a_refusal_allows_the_next() {
    let mut sim = Sim::synced(vec![], vec![]);
    sim.clear_logs();

    assert!(sim.agent.renew_certificate("CSR-1"));
    assert!(
        !sim.agent.renew_certificate("CSR-2"),
        "a second request while one is outstanding is not sent"
    );
    sim.settle();
    assert_eq!(renewal_requests(&sim), vec!["CSR-1".to_string()]);

    sim.hub.refuse_renewal("cluster store-0042 is not accepted");
    sim.settle();
    assert!(sim.agent_events.contains(&AgentEvent::RenewalRefused {
        reason: "cluster store-0042 is not accepted".to_string()
    }));
    assert!(sim.agent.renew_certificate("CSR-3"));
    sim.settle();
    assert_eq!(
        renewal_requests(&sim),
        vec!["CSR-1".to_string(), "CSR-3".to_string()]
    );
    assert!(sim.agent.is_established());
}

#[test]
fn renewal_before_welcome_is_not_sent() {
    let now = Instant::now();
    let mut agent = AgentSession::new(now, agent_config(CLUSTER), vec![]);
    assert!(!agent.renew_certificate("CSR"));
}

#[test]
fn hub_drops_a_repeated_request_and_refuses_an_oversized_one() {
    let now = Instant::now();
    let mut hub = HubSession::new(now, hub_config(), CLUSTER, "s");
    hub.handle_frame(now, hello(PROTOCOL_VERSION, CLUSTER))
        .unwrap();
    while hub.poll_event().is_some() {}
    let renew = |csr: String| wire::AgentFrame {
        frame: Some(agent_frame::Frame::RenewCertificate(
            wire::RenewCertificate { csr_pem: csr },
        )),
    };

    hub.handle_frame(now, renew("CSR".into())).unwrap();
    hub.handle_frame(now, renew("CSR".into())).unwrap();
    assert_eq!(
        hub.poll_event(),
        Some(HubEvent::RenewalRequested {
            csr_pem: "CSR".into()
        })
    );
    assert_eq!(hub.poll_event(), None, "the repeat is dropped");

    hub.issue_certificate("CERT", "BUNDLE");
    hub.handle_frame(now, renew("x".repeat(MAX_CSR_BYTES + 1)))
        .unwrap();
    assert_eq!(hub.poll_event(), None);
    let refused = std::iter::from_fn(|| hub.poll_transmit())
        .filter_map(|f| f.frame)
        .find_map(|f| match f {
            hub_frame::Frame::RenewalRefused(r) => Some(r.reason),
            _ => None,
        })
        .expect("a refusal");
    assert!(refused.contains("exceeds the bound"), "{refused}");
    assert!(
        hub.is_established(),
        "an oversized request refuses, not closes"
    );
}

#[test]
fn an_unrequested_certificate_is_a_protocol_error() {
    let mut sim = Sim::synced(vec![], vec![]);
    sim.hub.issue_certificate("CERT", "BUNDLE");
    sim.settle();
    assert!(matches!(
        sim.agent_errors.as_slice(),
        [ProtocolError::UnexpectedFrame {
            frame: "CertificateIssued",
            ..
        }]
    ));
    assert!(sim.agent.is_closed());
}

#[test]
fn hello_carries_the_trusted_bundle_and_the_hub_can_send_a_new_one() {
    let now = Instant::now();
    let mut sim = Sim::new(CLUSTER, CLUSTER, vec![], vec![]);
    sim.agent = AgentSession::new(now, agent_config(CLUSTER), vec![]).with_ca_bundle_sha256("abc");
    sim.settle();
    let hello = sim
        .hub_events
        .iter()
        .find_map(|e| match e {
            HubEvent::Established { hello } => Some(hello.clone()),
            _ => None,
        })
        .expect("established");
    assert_eq!(hello.ca_bundle_sha256, "abc");

    sim.hub.send_trust_bundle("OLD+NEW");
    sim.settle();
    assert!(sim.agent_events.contains(&AgentEvent::TrustBundleUpdated {
        ca_bundle_pem: "OLD+NEW".to_string()
    }));
    assert!(sim.agent.is_established());
}

#[test]
fn renewal_is_due_two_thirds_into_the_lifetime() {
    use std::time::{Duration, SystemTime};
    let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
    let check = |lifetime_s: u64, due_after_s: u64| {
        let at = renew_at(t0, t0 + Duration::from_secs(lifetime_s));
        assert_eq!(
            at,
            t0 + Duration::from_secs(due_after_s),
            "lifetime {lifetime_s}s"
        );
    };
    check(30 * 24 * 3600, 20 * 24 * 3600);
    check(30, 20);
    check(3, 2);
    check(0, 0);
    // Inverted validity: due at once.
    assert_eq!(renew_at(t0, t0 - Duration::from_secs(5)), t0);
}

fn cluster_info(nodes: &str, claim: &str) -> wire::ClusterInfo {
    wire::ClusterInfo {
        claims: vec![
            wire::ClusterClaim {
                name: "nodecount.flotilla.dev".to_string(),
                value: nodes.to_string(),
            },
            wire::ClusterClaim {
                name: "region.example.com".to_string(),
                value: claim.to_string(),
            },
        ],
        kubernetes_version: "v1.36.0".to_string(),
        capacity: [("cpu".to_string(), nodes.to_string())].into(),
        allocatable: [("cpu".to_string(), nodes.to_string())].into(),
    }
}

fn reported_infos(sim: &Sim) -> Vec<wire::ClusterInfo> {
    sim.hub_events
        .iter()
        .filter_map(|e| match e {
            HubEvent::ClusterInfoReported { info } => Some(info.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn cluster_info_reaches_the_hub_and_only_the_latest_of_a_backlog_is_sent() {
    let mut sim = Sim::synced(vec![], vec![]);
    sim.clear_logs();

    // A claim changes on the spoke: the hub hears the whole new report.
    sim.agent.report_cluster_info(cluster_info("3", "eu-west"));
    sim.settle();
    assert_eq!(reported_infos(&sim), vec![cluster_info("3", "eu-west")]);

    // While the link is stalled the spoke changes three times; only the last report goes.
    sim.clear_logs();
    sim.to_hub.stalled = true;
    for nodes in ["4", "5", "6"] {
        sim.agent
            .report_cluster_info(cluster_info(nodes, "eu-north"));
    }
    sim.settle();
    assert!(reported_infos(&sim).is_empty());
    sim.to_hub.stalled = false;
    sim.settle();
    assert_eq!(reported_infos(&sim), vec![cluster_info("6", "eu-north")]);
    assert!(sim.hub.is_established() && sim.agent.is_established());
}

#[test]
fn cluster_info_after_close_is_not_sent() {
    let mut sim = Sim::synced(vec![], vec![]);
    sim.agent.close("shutting down");
    sim.agent.report_cluster_info(cluster_info("3", "eu-west"));
    sim.settle();
    assert!(reported_infos(&sim).is_empty());
}

fn renewals_due(sim: &Sim) -> usize {
    sim.agent_events
        .iter()
        .filter(|e| matches!(e, AgentEvent::RenewalDue))
        .count()
}

#[test]
fn the_session_asks_for_renewal_two_thirds_in_and_retries_a_refusal_on_its_own() {
    use std::time::SystemTime;
    let mut sim = Sim::synced(vec![], vec![]);
    sim.clear_logs();
    // A certificate issued now, valid for 120 s: due at 80 s.
    let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    sim.agent
        .set_certificate_validity(sim.now, wall, wall, wall + Duration::from_secs(120));
    sim.run_for(Duration::from_secs(79));
    assert_eq!(renewals_due(&sim), 0, "not before two thirds");
    sim.run_for(Duration::from_secs(2));
    assert_eq!(renewals_due(&sim), 1);
    sim.run_for(Duration::from_secs(10));
    assert_eq!(renewals_due(&sim), 1, "once, until the driver answers");

    // The driver made its request; the hub refuses.
    assert!(sim.agent.renew_certificate("CSR-1"));
    sim.settle();
    sim.hub.refuse_renewal("the hub's CA is rotating");
    sim.settle();
    let refused_at = sim.now;
    // About 28 s of life left: the next try a quarter of that later, not sooner.
    sim.run_for(Duration::from_secs(6));
    assert_eq!(renewals_due(&sim), 1);
    sim.run_for(Duration::from_secs(2));
    assert_eq!(
        renewals_due(&sim),
        2,
        "retried {:?} after the refusal",
        sim.now - refused_at
    );

    // Issued and stored: the next renewal follows the new certificate's lifetime.
    assert!(sim.agent.renew_certificate("CSR-2"));
    sim.settle();
    sim.hub.issue_certificate("CERT-2", "BUNDLE");
    sim.settle();
    let issued_wall = wall + (sim.now - refused_at) + Duration::from_secs(92);
    sim.agent.set_certificate_validity(
        sim.now,
        issued_wall,
        issued_wall,
        issued_wall + Duration::from_secs(300),
    );
    sim.run_for(Duration::from_secs(199));
    assert_eq!(renewals_due(&sim), 2);
    sim.run_for(Duration::from_secs(2));
    assert_eq!(renewals_due(&sim), 3);
    assert!(sim.agent.is_established() && sim.hub.is_established());
}

#[test]
fn a_driver_that_cannot_make_the_request_is_asked_again_later() {
    use std::time::SystemTime;
    let mut sim = Sim::synced(vec![], vec![]);
    let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    // Already past two thirds (an agent that was down): due at once, but never back to back.
    sim.agent.set_certificate_validity(
        sim.now,
        wall,
        wall - Duration::from_secs(90),
        wall + Duration::from_secs(30),
    );
    sim.run_for(Duration::from_millis(999));
    assert_eq!(renewals_due(&sim), 0, "not within the minimum interval");
    sim.run_for(Duration::from_millis(2));
    assert_eq!(renewals_due(&sim), 1);
    sim.agent.renewal_failed(sim.now);
    // 29 s left: retried after a quarter of it.
    sim.run_for(Duration::from_secs(7));
    assert_eq!(renewals_due(&sim), 1);
    sim.run_for(Duration::from_secs(1));
    assert_eq!(renewals_due(&sim), 2);
}

#[test]
fn renewal_waits_for_the_welcome() {
    use std::time::SystemTime;
    let mut sim = Sim::new(CLUSTER, CLUSTER, vec![], vec![]);
    sim.to_agent.dropping = true;
    let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    sim.agent
        .set_certificate_validity(sim.now, wall, wall - Duration::from_secs(100), wall);
    sim.run_for(WELCOME_TIMEOUT - Duration::from_secs(1));
    assert_eq!(
        renewals_due(&sim),
        0,
        "nothing to ask before the session is up"
    );
}

// ---- admission refusals ----

#[test]
fn an_admission_refusal_reaches_the_agent_with_its_kind() {
    for (refusal, reason) in [
        (
            wire::Refusal::ClusterDenied,
            "cluster store-0042 was denied by the hub: stolen",
        ),
        (
            wire::Refusal::ClusterNotRegistered,
            "cluster store-0042 is not registered",
        ),
        (
            wire::Refusal::KeyNotRegistered,
            "the certificate's key is not registered",
        ),
    ] {
        let mut sim = Sim::new(CLUSTER, CLUSTER, vec![], vec![]);
        // Refused as the stream opens, before the hello is even read.
        sim.hub.refuse(refusal, reason);
        sim.settle();
        let (closed, by_peer) = sim.agent_closed().expect("the agent's session closed");
        assert!(by_peer);
        assert_eq!(
            closed,
            &CloseReason::Refused {
                refusal,
                reason: reason.to_string()
            }
        );
        assert!(!sim.agent.is_established());
        assert!(matches!(
            sim.hub_closed(),
            Some((CloseReason::Refused { .. }, false))
        ));
    }
}

// ---- health: the grace period ----

#[test]
fn a_cluster_that_goes_silent_is_unreachable_after_timeout_and_grace_unless_it_returns() {
    use flotilla_proto::session::{Presence, PresenceEvent};
    const GRACE: Duration = Duration::from_secs(40);
    let mut presence = Presence::new(GRACE);
    let mut sim = Sim::synced(vec![], vec![]);
    presence.connected(CLUSTER, "session-1");

    // The agent's link dies silently: the hub closes at the heartbeat timeout.
    sim.to_hub.dropping = true;
    sim.to_agent.dropping = true;
    sim.run_for(TIMEOUT + Duration::from_secs(1));
    assert!(matches!(
        sim.hub_closed(),
        Some((CloseReason::HeartbeatTimeout { .. }, false))
    ));
    let closed_at = sim.now;
    presence.disconnected(closed_at, CLUSTER, "session-1");
    presence.handle_timeout(closed_at + GRACE - Duration::from_secs(1));
    assert_eq!(presence.poll_event(), None, "still within the grace period");

    // Back within the grace period: nothing to mark.
    let mut again = Sim::synced(vec![], vec![]);
    presence.connected(CLUSTER, "session-2");
    presence.handle_timeout(closed_at + GRACE * 2);
    assert_eq!(presence.poll_event(), None);

    // Gone again, for good this time.
    again.to_hub.dropping = true;
    again.to_agent.dropping = true;
    again.run_for(TIMEOUT + Duration::from_secs(1));
    let gone_at = closed_at + GRACE * 2;
    presence.disconnected(gone_at, CLUSTER, "session-2");
    presence.handle_timeout(gone_at + GRACE);
    assert_eq!(
        presence.poll_event(),
        Some(PresenceEvent::Unreachable {
            cluster: CLUSTER.to_string(),
            since: gone_at
        })
    );
}
