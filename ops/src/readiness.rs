//! `/readyz`: a process is ready when every one of its conditions holds. Each part of a
//! process that must have done something before it can serve (a watch cache listed, the cache
//! opened, the first apply done) holds a [`ReadyFlag`] and raises it; the probe reads them all.
//! A flag is one atomic: raising and reading it never waits.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

/// One condition of readiness, raised by the part that meets it. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ReadyFlag {
    /// What is missing while the flag is down, as `/readyz` says it: "the ManifestWork watch
    /// cache has not listed from the store yet".
    missing: &'static str,
    ready: Source,
}

#[derive(Clone, Debug)]
enum Source {
    Flag(Arc<AtomicBool>),
    /// A part that already keeps its readiness in a watch channel (for its own waiters).
    Watch(watch::Receiver<bool>),
    /// Ready while the channel says false (a process draining is not ready).
    Unless(watch::Receiver<bool>),
}

impl ReadyFlag {
    /// A flag that is down, described by what is missing until it is raised.
    pub fn new(missing: &'static str) -> ReadyFlag {
        ReadyFlag {
            missing,
            ready: Source::Flag(Arc::new(AtomicBool::new(false))),
        }
    }

    /// A condition that holds while `ready` says true.
    pub fn watching(missing: &'static str, ready: watch::Receiver<bool>) -> ReadyFlag {
        ReadyFlag {
            missing,
            ready: Source::Watch(ready),
        }
    }

    /// A condition that holds while `not_ready` says false: "draining" for instance.
    pub fn unless(missing: &'static str, not_ready: watch::Receiver<bool>) -> ReadyFlag {
        ReadyFlag {
            missing,
            ready: Source::Unless(not_ready),
        }
    }

    /// Raises (or lowers) the flag; a flag that follows a watch channel ignores this.
    pub fn set(&self, ready: bool) {
        if let Source::Flag(flag) = &self.ready {
            flag.store(ready, Ordering::Release);
        }
    }

    pub fn is_ready(&self) -> bool {
        match &self.ready {
            Source::Flag(flag) => flag.load(Ordering::Acquire),
            Source::Watch(rx) => *rx.borrow(),
            Source::Unless(rx) => !*rx.borrow(),
        }
    }

    /// What is missing while the flag is down.
    pub fn missing(&self) -> &'static str {
        self.missing
    }
}

/// Every condition of one process.
#[derive(Clone, Debug, Default)]
pub struct Readiness {
    flags: Vec<ReadyFlag>,
}

impl Readiness {
    pub fn new(flags: impl IntoIterator<Item = ReadyFlag>) -> Readiness {
        Readiness {
            flags: flags.into_iter().collect(),
        }
    }

    /// Adds conditions.
    pub fn with(mut self, flags: impl IntoIterator<Item = ReadyFlag>) -> Readiness {
        self.flags.extend(flags);
        self
    }

    /// What is missing, in the order the flags were given; empty when ready.
    pub fn missing(&self) -> Vec<&'static str> {
        self.flags
            .iter()
            .filter(|f| !f.is_ready())
            .map(ReadyFlag::missing)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_ready_once_every_flag_is_raised() {
        let cache = ReadyFlag::new("the cache is not open");
        let apply = ReadyFlag::new("the first apply has not finished");
        let readiness = Readiness::new([cache.clone(), apply.clone()]);
        assert_eq!(
            readiness.missing(),
            ["the cache is not open", "the first apply has not finished"]
        );
        cache.set(true);
        assert_eq!(readiness.missing(), ["the first apply has not finished"]);
        apply.set(true);
        assert!(readiness.missing().is_empty());
    }
}
