//! What a report says about the machine, and what the harness reads about processes from
//! `/proc`: resident memory and CPU time.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The machine a run was measured on.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Machine {
    /// `std::thread::available_parallelism` (respects cgroup and affinity limits).
    pub cores: usize,
    /// `MemTotal` from /proc/meminfo.
    pub memory_bytes: u64,
    /// `uname -r`, from /proc/sys/kernel/osrelease.
    pub kernel: String,
    /// RLIMIT_NOFILE of the harness process (soft, hard).
    pub open_files_soft: u64,
    pub open_files_hard: u64,
    /// 1-minute load average when the run started: a shared machine is noisy.
    pub load_average_1m: f64,
}

impl Machine {
    pub fn read() -> Machine {
        let (soft, hard) = open_files_limit();
        Machine {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_bytes: meminfo_kib("MemTotal").unwrap_or(0) * 1024,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            open_files_soft: soft,
            open_files_hard: hard,
            load_average_1m: std::fs::read_to_string("/proc/loadavg")
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse().ok())
                .unwrap_or(0.0),
        }
    }
}

fn meminfo_kib(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// RLIMIT_NOFILE (soft, hard) of this process.
pub fn open_files_limit() -> (u64, u64) {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .unwrap_or((1024, 1024))
}

/// Raises the soft RLIMIT_NOFILE to the hard limit (allowed without privileges) and returns
/// the new soft limit.
pub fn raise_open_files_limit() -> u64 {
    let (soft, hard) = open_files_limit();
    if soft < hard
        && nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard)
            .is_ok()
    {
        return hard;
    }
    soft
}

/// Resident set size and CPU time of one process, from /proc.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ProcStats {
    pub rss_bytes: u64,
    /// User + system CPU seconds since the process started.
    pub cpu_seconds: f64,
}

impl ProcStats {
    /// Stats of process `pid` ("self" for this one); `None` once it is gone.
    pub fn read(pid: &str) -> Option<ProcStats> {
        let base = Path::new("/proc").join(pid);
        let status = std::fs::read_to_string(base.join("status")).ok()?;
        let rss_kib: u64 = status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        let stat = std::fs::read_to_string(base.join("stat")).ok()?;
        // Fields after the command name (which may hold spaces) start after the last ')'.
        let rest = &stat[stat.rfind(')')? + 2..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // utime and stime are fields 14 and 15 of stat, i.e. 11 and 12 after the state field.
        let ticks: u64 =
            fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        Some(ProcStats {
            rss_bytes: rss_kib * 1024,
            cpu_seconds: ticks as f64 / clock_ticks_per_second(),
        })
    }
}

fn clock_ticks_per_second() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .map_or(100.0, |t| t as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_machine_and_this_process_are_readable() {
        let m = Machine::read();
        assert!(
            m.cores >= 1 && m.memory_bytes > 0 && !m.kernel.is_empty(),
            "{m:?}"
        );
        let me = ProcStats::read("self").expect("own /proc entry");
        assert!(me.rss_bytes > 0);
        assert!(ProcStats::read("999999999").is_none());
    }
}
