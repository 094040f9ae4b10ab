//! Faults done to real processes from outside, the way the world does them: a listening socket
//! that fails under a running process.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};

/// The descriptor number, in process `pid`, of the TCP socket listening on `port`: found by
/// matching the socket's inode in `/proc/<pid>/net/tcp` (and tcp6) against `/proc/<pid>/fd`.
pub fn listening_fd(pid: u32, port: u16) -> anyhow::Result<u32> {
    let mut inode = None;
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}"))?;
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // local_address is ADDR:PORT in hex; state 0A is LISTEN; column 9 is the inode.
            let (Some(local), Some(state), Some(ino)) = (cols.get(1), cols.get(3), cols.get(9))
            else {
                continue;
            };
            let local_port = local
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if *state == "0A" && local_port == Some(port) {
                inode = Some(ino.to_string());
            }
        }
    }
    let inode = inode.with_context(|| format!("no socket of process {pid} listens on {port}"))?;
    let wanted = format!("socket:[{inode}]");
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let entry = entry?;
        if std::fs::read_link(entry.path())?.to_string_lossy() == wanted {
            return entry
                .file_name()
                .to_string_lossy()
                .parse()
                .context("fd name");
        }
    }
    bail!("process {pid} holds no descriptor for {wanted}")
}

/// Shuts down descriptor `fd` of process `pid` (a listening socket) from outside, as if the
/// socket failed under it: its next `accept` returns EINVAL. Takes a copy of the descriptor
/// with pidfd_getfd(2) (Linux 5.6+; the caller must be allowed to ptrace the process, which a
/// parent is) and calls shutdown(2) on it. Python's ctypes makes the two syscalls, so the test
/// crate needs no unsafe code.
pub fn shut_down_socket(pid: u32, fd: u32) -> anyhow::Result<()> {
    const SCRIPT: &str = "import ctypes, os, socket, sys\n\
        pid, fd = int(sys.argv[1]), int(sys.argv[2])\n\
        pidfd = os.pidfd_open(pid)\n\
        libc = ctypes.CDLL(None, use_errno=True)\n\
        copy = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd\n\
        if copy < 0: raise OSError(ctypes.get_errno(), 'pidfd_getfd')\n\
        socket.socket(fileno=copy).shutdown(socket.SHUT_RDWR)\n";
    let out = Command::new(python())
        .args(["-c", SCRIPT, &pid.to_string(), &fd.to_string()])
        .output()
        .context("running python3 to shut the socket down")?;
    anyhow::ensure!(
        out.status.success(),
        "shutting down fd {fd} of process {pid} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn python() -> &'static str {
    if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}
