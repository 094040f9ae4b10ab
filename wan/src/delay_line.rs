//! One direction's delay line, without IO: packets are offered with the time they arrived and
//! taken back once their hold is over. Each packet's hold is the link's one-way delay plus a
//! uniform offset within ± its one-way jitter, drawn from the RNG the line is given (seeded, so
//! a run is reproducible). Without `reorder`, a packet is never released before the one ahead
//! of it (its release is pushed back to that one's), as on a single path; with it, each keeps
//! its own hold and a short one overtakes. The line holds at most its bound of packets and of
//! bytes; a packet arriving when either is reached is dropped and counted, a tail drop.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use rand::Rng;
use tokio::time::Instant;

use crate::spec::{LinkSpec, QueueBound};

/// What became of an offered packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// Held until this time.
    Held(Instant),
    /// The line was full (in packets or bytes): dropped.
    Full,
}

/// One direction's delay line.
pub struct DelayLine<R> {
    hold: Duration,
    jitter: Duration,
    reorder: bool,
    bound: QueueBound,
    rng: R,
    held: BinaryHeap<Reverse<Held>>,
    bytes: usize,
    /// The latest release given so far, which a packet keeping order may not precede.
    last_release: Option<Instant>,
    /// Arrival order, which breaks ties between equal releases so they leave in order.
    next_seq: u64,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Held {
    release: Instant,
    seq: u64,
    packet: Vec<u8>,
}

impl<R: Rng> DelayLine<R> {
    /// The line of one direction of `spec`, drawing jitter from `rng`.
    pub fn new(spec: &LinkSpec, rng: R) -> DelayLine<R> {
        DelayLine {
            hold: spec.one_way_delay(),
            jitter: spec.one_way_jitter(),
            reorder: spec.reorder,
            bound: spec.queue,
            rng,
            held: BinaryHeap::new(),
            bytes: 0,
            last_release: None,
            next_seq: 0,
        }
    }

    /// Takes `packet`, arrived at `now`, unless the line is full.
    pub fn offer(&mut self, now: Instant, packet: Vec<u8>) -> Offer {
        if self.held.len() >= self.bound.packets || self.bytes + packet.len() > self.bound.bytes {
            return Offer::Full;
        }
        let mut release = now + self.draw_hold();
        if !self.reorder {
            release = release.max(self.last_release.unwrap_or(release));
        }
        self.last_release = Some(self.last_release.map_or(release, |l| l.max(release)));
        self.bytes += packet.len();
        self.held.push(Reverse(Held {
            release,
            seq: self.next_seq,
            packet,
        }));
        self.next_seq += 1;
        Offer::Held(release)
    }

    /// When the next packet is due, if any is held.
    pub fn next_release(&self) -> Option<Instant> {
        self.held.peek().map(|Reverse(h)| h.release)
    }

    /// The next packet whose hold is over at `now`.
    pub fn pop_due(&mut self, now: Instant) -> Option<Vec<u8>> {
        if self.next_release()? > now {
            return None;
        }
        let Reverse(h) = self.held.pop()?;
        self.bytes -= h.packet.len();
        Some(h.packet)
    }

    /// Packets held now.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The one-way delay ± jitter, uniform.
    fn draw_hold(&mut self) -> Duration {
        if self.jitter.is_zero() {
            return self.hold;
        }
        let span = 2 * self.jitter.as_nanos() as u64;
        // The spec keeps jitter at most the delay, so the hold never goes below zero.
        (self.hold - self.jitter) + Duration::from_nanos(self.rng.random_range(0..=span))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn line(spec: &str) -> DelayLine<StdRng> {
        DelayLine::new(&spec.parse().unwrap(), StdRng::seed_from_u64(7))
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Offers `n` packets 1 ms apart (packet i is `[i]`) and drains the line; returns the
    /// packets in the order released, each with its hold.
    fn run(line: &mut DelayLine<StdRng>, n: u8) -> Vec<(u8, Duration)> {
        let start = Instant::now();
        for i in 0..n {
            assert!(matches!(
                line.offer(start + ms(u64::from(i)), vec![i]),
                Offer::Held(_)
            ));
        }
        let mut out = Vec::new();
        while let Some(at) = line.next_release() {
            let p = line.pop_due(at).expect("due at its release");
            out.push((p[0], at - (start + ms(u64::from(p[0])))));
        }
        out
    }

    #[test]
    fn each_direction_holds_half_the_round_trip_within_half_the_jitter() {
        let mut l = line("delay=100ms,jitter=40ms,reorder");
        let out = run(&mut l, 200);
        assert_eq!(out.len(), 200);
        for (_, hold) in &out {
            assert!((ms(30)..=ms(70)).contains(hold), "{hold:?}");
        }
        // Jitter spreads them: not all the same hold.
        assert!(out.iter().any(|(_, h)| *h < ms(45)) && out.iter().any(|(_, h)| *h > ms(55)));
    }

    #[test]
    fn without_reorder_packets_leave_in_order_and_with_it_some_overtake() {
        let mut ordered = line("delay=100ms,jitter=60ms");
        let out = run(&mut ordered, 100);
        assert!(out.windows(2).all(|w| w[0].0 < w[1].0), "{out:?}");
        // Kept in order by waiting longer, never by leaving earlier than its own hold allows.
        assert!(out.iter().all(|(_, h)| *h >= ms(20)), "{out:?}");
        let mut reordering = line("delay=100ms,jitter=60ms,reorder");
        let out = run(&mut reordering, 100);
        assert!(out.windows(2).any(|w| w[0].0 > w[1].0), "{out:?}");
    }

    #[test]
    fn nothing_leaves_before_its_hold() {
        let mut l = line("delay=20ms");
        let now = Instant::now();
        assert_eq!(l.offer(now, vec![1; 100]), Offer::Held(now + ms(10)));
        assert_eq!(l.pop_due(now + ms(9)), None);
        assert_eq!(l.pop_due(now + ms(10)), Some(vec![1; 100]));
        assert!(l.is_empty());
    }

    #[test]
    fn the_bound_in_packets_and_in_bytes_holds_and_drops_the_excess() {
        let mut l = line("delay=100ms,queue=3");
        let now = Instant::now();
        let offers: Vec<Offer> = (0..5).map(|_| l.offer(now, vec![0; 10])).collect();
        assert_eq!(offers.iter().filter(|o| **o == Offer::Full).count(), 2);
        assert_eq!((l.len(), l.bytes()), (3, 30));
        // Room again once one has left.
        assert!(l.pop_due(now + ms(50)).is_some());
        assert!(matches!(l.offer(now, vec![0; 10]), Offer::Held(_)));

        let mut spec: LinkSpec = "delay=100ms".parse().unwrap();
        spec.queue.bytes = 3_000;
        let mut l = DelayLine::new(&spec, StdRng::seed_from_u64(1));
        let held = (0..10)
            .filter(|_| matches!(l.offer(now, vec![0; 1_400]), Offer::Held(_)))
            .count();
        assert_eq!((held, l.bytes()), (2, 2_800));
    }
}
