//! Headless Chromium, as an operator's browser reading a page: the DOM it built and a
//! screenshot of the window. `scripts/test.sh` installs Chromium (Debian's `chromium`) when
//! it is missing.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};

/// The longest one browser run may take.
pub const BROWSER_TIMEOUT: Duration = Duration::from_secs(60);

/// A headless Chromium with its own throwaway profile.
pub struct Browser {
    program: PathBuf,
    profile: tempfile::TempDir,
}

impl Browser {
    /// Chromium from `$CHROMIUM`, else `chromium` or `chromium-browser` on the PATH.
    pub fn find() -> anyhow::Result<Browser> {
        let candidates = std::env::var_os("CHROMIUM")
            .map(PathBuf::from)
            .into_iter()
            .chain(["chromium", "chromium-browser"].map(PathBuf::from));
        for program in candidates {
            let found = std::process::Command::new(&program)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success());
            if found {
                return Ok(Browser {
                    program,
                    profile: tempfile::tempdir()?,
                });
            }
        }
        bail!(
            "no headless Chromium: install Debian's chromium (scripts/test.sh does) or set \
             CHROMIUM to its path"
        )
    }

    async fn run(&self, args: &[String], url: &str) -> anyhow::Result<std::process::Output> {
        let mut cmd = tokio::process::Command::new(&self.program);
        cmd.args([
            "--headless",
            // Tests may run as root, where Chromium's sandbox cannot start.
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-extensions",
        ])
        .arg(format!("--user-data-dir={}", self.profile.path().display()))
        .args(args)
        .arg(url)
        .kill_on_drop(true);
        let output = tokio::time::timeout(BROWSER_TIMEOUT, cmd.output())
            .await
            .with_context(|| format!("chromium did not finish with {url} in {BROWSER_TIMEOUT:?}"))?
            .with_context(|| format!("starting {}", self.program.display()))?;
        if !output.status.success() {
            bail!(
                "chromium failed on {url} ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(output)
    }

    /// The DOM Chromium built from `url`, serialized (`--dump-dom`).
    pub async fn dump_dom(&self, url: &str) -> anyhow::Result<String> {
        let output = self.run(&["--dump-dom".to_string()], url).await?;
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// A screenshot of `url` in a window of `width` × `height` pixels, as a PNG at `out`.
    pub async fn screenshot(
        &self,
        url: &str,
        out: &Path,
        (width, height): (u32, u32),
    ) -> anyhow::Result<()> {
        self.run(
            &[
                format!("--screenshot={}", out.display()),
                format!("--window-size={width},{height}"),
            ],
            url,
        )
        .await?;
        Ok(())
    }
}

/// The width and height of a PNG file, read from its header; an error if it is not a PNG.
pub fn png_size(path: &Path) -> anyhow::Result<(u32, u32)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    const SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
    // Signature, then the IHDR chunk: length (4), type (4), width (4), height (4).
    if bytes.len() < 24 || &bytes[..8] != SIGNATURE || &bytes[12..16] != b"IHDR" {
        bail!("{} is not a PNG", path.display());
    }
    let be =
        |at: usize| u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    Ok((be(16), be(20)))
}
