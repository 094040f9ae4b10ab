//! The fault point of fenced writes: a place in every fenced write, after the gateway checked
//! its fence and right before the store call, where a test can hold the write. It proves what
//! the store's own fencing is for: a gateway held there past its lease while another takes the
//! shard and writes has its write refused when it goes on (`flotilla_proto::contract::fence`).
//!
//! Only builds with `debug_assertions` (tests, `cargo build` without `--release`) have a way to
//! arm it: in a release build [`HoldPoint`] does not exist, [`FaultPoint`] is an empty struct
//! whose `pass` does nothing, and no flag or environment variable reaches either.
//!
//! Two ways to arm it:
//! * in process: a test builds a [`HoldPoint`], names the clusters whose writes it holds
//!   ([`HoldPoint::hold`]), waits until one is parked ([`HoldPoint::parked`]) and lets it go
//!   ([`HoldPoint::release`]);
//! * in the `flotilla-gateway` binary: the environment variable [`FAULT_DIR_ENV`] names a
//!   directory; fenced writes of the clusters listed in its file `hold` (one name per line) are
//!   parked, the gateway writes the file `held` (the cluster and object, one line per write)
//!   when one is, and they go on once the file `release` exists.

#[cfg(debug_assertions)]
use std::sync::Arc;

/// Where a fenced write may be held before its store call (see the module docs). Cheap to
/// clone; the default holds nothing.
#[derive(Clone, Default)]
pub struct FaultPoint {
    #[cfg(debug_assertions)]
    hold: Option<Arc<HoldPoint>>,
}

impl std::fmt::Debug for FaultPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        #[cfg(debug_assertions)]
        if self.hold.is_some() {
            return f.write_str("FaultPoint(armed)");
        }
        f.write_str("FaultPoint")
    }
}

impl FaultPoint {
    /// Passes the point with a write of `object` (for `cluster`): at once, unless a test holds
    /// this cluster's writes.
    pub(crate) async fn pass(&self, cluster: &str, object: &str) {
        #[cfg(debug_assertions)]
        if let Some(hold) = &self.hold {
            hold.pass(cluster, object).await;
        }
        #[cfg(not(debug_assertions))]
        let _ = (cluster, object);
    }
}

/// The name of the environment variable that arms the fault point of a `flotilla-gateway`
/// built with `debug_assertions` (see the module docs).
#[cfg(debug_assertions)]
pub const FAULT_DIR_ENV: &str = "FLOTILLA_GATEWAY_FAULT_DIR";

#[cfg(debug_assertions)]
pub use armed::HoldPoint;

#[cfg(debug_assertions)]
mod armed {
    use std::collections::BTreeSet;
    use std::path::PathBuf;
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::sync::watch;
    use tracing::warn;

    use super::FaultPoint;

    /// How often a write parked by the fault directory looks for `release`.
    const RELEASE_POLL: Duration = Duration::from_millis(50);

    /// Holds the fenced writes of chosen clusters before their store calls until released.
    pub struct HoldPoint {
        how: How,
    }

    enum How {
        InProcess(watch::Sender<Holding>),
        Directory(PathBuf),
    }

    #[derive(Default)]
    struct Holding {
        /// Clusters whose writes are held.
        held: BTreeSet<String>,
        /// Writes parked now: (cluster, object).
        parked: Vec<(String, String)>,
    }

    impl HoldPoint {
        /// A hold point a test arms in process; it holds nothing until told.
        pub fn new() -> Arc<HoldPoint> {
            Arc::new(HoldPoint {
                how: How::InProcess(watch::Sender::new(Holding::default())),
            })
        }

        /// A hold point armed from the files of `dir` (see the module docs).
        pub fn in_directory(dir: impl Into<PathBuf>) -> Arc<HoldPoint> {
            Arc::new(HoldPoint {
                how: How::Directory(dir.into()),
            })
        }

        /// The fault point of writes that pass here.
        pub fn point(self: &Arc<Self>) -> FaultPoint {
            FaultPoint {
                hold: Some(self.clone()),
            }
        }

        /// Holds the fenced writes of `cluster` from now on (in process only).
        pub fn hold(&self, cluster: &str) {
            if let How::InProcess(state) = &self.how {
                state.send_modify(|s| {
                    s.held.insert(cluster.to_owned());
                });
            }
        }

        /// Waits until a write of `cluster` is parked here, and says which object it writes
        /// (in process only; at once for a directory).
        pub async fn parked(&self, cluster: &str) -> String {
            let How::InProcess(state) = &self.how else {
                return String::new();
            };
            let mut rx = state.subscribe();
            let parked = rx
                .wait_for(|s| s.parked.iter().any(|(c, _)| c == cluster))
                .await
                .expect("the hold point's sender lives as long as it");
            parked
                .parked
                .iter()
                .find(|(c, _)| c == cluster)
                .map(|(_, object)| object.clone())
                .unwrap_or_default()
        }

        /// Lets the parked writes of `cluster` go, and holds its later ones no more (in
        /// process only).
        pub fn release(&self, cluster: &str) {
            if let How::InProcess(state) = &self.how {
                state.send_modify(|s| {
                    s.held.remove(cluster);
                });
            }
        }

        pub(super) async fn pass(&self, cluster: &str, object: &str) {
            match &self.how {
                How::InProcess(state) => {
                    if !state.borrow().held.contains(cluster) {
                        return;
                    }
                    let entry = (cluster.to_owned(), object.to_owned());
                    state.send_modify(|s| s.parked.push(entry.clone()));
                    let mut rx = state.subscribe();
                    let _ = rx.wait_for(|s| !s.held.contains(cluster)).await;
                    state.send_modify(|s| {
                        if let Some(i) = s.parked.iter().position(|p| *p == entry) {
                            s.parked.remove(i);
                        }
                    });
                }
                How::Directory(dir) => {
                    let held = tokio::fs::read_to_string(dir.join("hold"))
                        .await
                        .unwrap_or_default();
                    if !held.lines().any(|line| line.trim() == cluster) {
                        return;
                    }
                    let release = dir.join("release");
                    if tokio::fs::try_exists(&release).await.unwrap_or(false) {
                        return;
                    }
                    warn!(cluster, object, dir = %dir.display(), "fault point: fenced write parked until `release` appears");
                    let line = format!("{cluster} {object}\n");
                    if let Err(e) = append(&dir.join("held"), &line).await {
                        warn!(error = %e, "fault point: cannot write `held`");
                    }
                    while !tokio::fs::try_exists(&release).await.unwrap_or(false) {
                        tokio::time::sleep(RELEASE_POLL).await;
                    }
                    warn!(cluster, object, "fault point: fenced write released");
                }
            }
        }
    }

    async fn append(path: &std::path::Path, line: &str) -> std::io::Result<()> {
        use tokio::io::AsyncWriteExt as _;
        let mut file = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .await?;
        file.write_all(line.as_bytes()).await?;
        file.flush().await
    }
}

#[cfg(all(test, debug_assertions))]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_held_cluster_waits_and_others_pass() {
        let hold = HoldPoint::new();
        let point = hold.point();
        point.pass("store-2", "x").await;
        hold.hold("store-1");
        let parked = tokio::spawn({
            let point = point.clone();
            async move { point.pass("store-1", "ManifestWork store-1/web").await }
        });
        assert_eq!(hold.parked("store-1").await, "ManifestWork store-1/web");
        point.pass("store-2", "y").await;
        assert!(!parked.is_finished());
        hold.release("store-1");
        tokio::time::timeout(Duration::from_secs(10), parked)
            .await
            .expect("released")
            .unwrap();
        point.pass("store-1", "z").await;
    }

    #[tokio::test]
    async fn a_directory_parks_the_clusters_it_names_until_release_appears() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("hold"), "store-1\n").unwrap();
        let point = HoldPoint::in_directory(dir.path()).point();
        point.pass("store-2", "x").await;
        assert!(!dir.path().join("held").exists(), "store-2 is not held");
        let parked = tokio::spawn({
            let point = point.clone();
            async move { point.pass("store-1", "ManagedCluster store-1").await }
        });
        let held = dir.path().join("held");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !held.exists() {
            assert!(tokio::time::Instant::now() < deadline, "never parked");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            std::fs::read_to_string(&held).unwrap(),
            "store-1 ManagedCluster store-1\n"
        );
        assert!(!parked.is_finished());
        std::fs::write(dir.path().join("release"), "").unwrap();
        tokio::time::timeout(Duration::from_secs(10), parked)
            .await
            .expect("released")
            .unwrap();
    }
}
