//! TLS material on disk (the hub CA, issued certificates, an agent's identity), written so that
//! a crash or a power cut at any moment leaves either the old file or the new one, never a
//! torn or missing one: write a temporary file beside it, fsync it, rename it over the old one,
//! then fsync the directory so the rename itself is durable.

use std::fs;
use std::io::{self, Write};
use std::path::Path;

/// Who may read a file written by [`write_atomic`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Owner only (0600): private keys, token records.
    Private,
    /// Anyone may read (0644): certificates, CA bundles, configuration.
    Public,
}

/// Replaces `path` with `contents` atomically and durably (see the module doc). The directory
/// is created if missing. A `<name>.partial` left by an earlier crash is overwritten.
pub fn write_atomic(path: &Path, contents: &[u8], access: Access) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    fs::create_dir_all(dir)?;
    let tmp = path.with_extension("partial");
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(match access {
            Access::Private => 0o600,
            Access::Public => 0o644,
        });
    }
    let mut f = opts.open(&tmp)?;
    f.write_all(contents)?;
    f.sync_all()?;
    drop(f);
    fs::rename(&tmp, path)?;
    // The rename lives in the directory: without this a power cut can undo it, leaving the old
    // file (or none) although the caller was told the new one is stored.
    fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_whole_with_the_mode_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("certs").join("tls.key");
        // What a crash half-way through an earlier write leaves behind.
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path.with_extension("partial"), b"torn").unwrap();
        write_atomic(&path, b"first", Access::Private).unwrap();
        write_atomic(&path, b"second", Access::Private).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"second");
        assert!(!path.with_extension("partial").exists());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
    }
}
