//! Files the probe reads or runs from the project and from `~/.automaton`, with the store's
//! rule for links (`crates/store/src/layered.rs`): what comes with the project's repository
//! (its `.automaton/` layer, its root-level `.env` and `config.yaml`) is never read or run
//! through a symbolic link — a merged change could point one at `~/.ssh` or anywhere — while
//! `~/.automaton/` is the operator's own, where a dotfiles manager's links are common, and is
//! followed. Reads are capped and never block (a FIFO in a file's place is refused).

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// A file found for the probe, with the folder below which no link may be followed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub path: PathBuf,
    /// `Some(dir)`: the file belongs to the project; no link at or below `dir` is followed
    /// (the project's `.automaton/` itself may be one, as in the store). `None`: the
    /// operator's own `~/.automaton`, links followed.
    pub no_links_below: Option<PathBuf>,
}

impl Found {
    pub fn users(path: PathBuf) -> Found {
        Found {
            path,
            no_links_below: None,
        }
    }

    pub fn projects(path: PathBuf, below: &Path) -> Found {
        Found {
            path,
            no_links_below: Some(below.to_path_buf()),
        }
    }

    /// The first symbolic link on the way from `no_links_below` (exclusive) to the file
    /// (inclusive), if any.
    pub fn link(&self) -> Option<PathBuf> {
        let root = self.no_links_below.as_ref()?;
        let rel = self.path.strip_prefix(root).ok()?;
        let mut p = root.clone();
        for c in rel.components() {
            p.push(c);
            if p.symlink_metadata()
                .is_ok_and(|m| m.file_type().is_symlink())
            {
                return Some(p);
            }
        }
        None
    }

    /// Refuses a project file reached through a link, naming the link.
    pub fn check_links(&self) -> Result<(), String> {
        match self.link() {
            Some(l) => Err(format!(
                "{} is a symbolic link in the project (the project's files are never followed through links)",
                l.display()
            )),
            None => Ok(()),
        }
    }
}

/// At most `cap` bytes of a file, and the file's whole size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capped {
    pub bytes: Vec<u8>,
    pub size: u64,
}

impl Capped {
    pub fn truncated(&self) -> bool {
        self.size > self.bytes.len() as u64
    }
}

/// The first `cap` bytes of `f`. `Ok(None)` when nothing is there; `Err` (one line) for a link
/// in the project, something that is not a regular file, or a read error.
pub fn read_capped(f: &Found, cap: u64) -> Result<Option<Capped>, String> {
    f.check_links()?;
    let mut o = std::fs::OpenOptions::new();
    o.read(true).custom_flags(libc::O_NONBLOCK);
    if f.no_links_below.is_some() {
        // Closes the window between the check above and the open for the last component.
        o.custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW);
    }
    let file = match o.open(&f.path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: cannot open ({e})", f.path.display())),
    };
    read_open(file, &f.path, cap).map(Some)
}

fn read_open(file: File, path: &Path, cap: u64) -> Result<Capped, String> {
    let meta = file
        .metadata()
        .map_err(|e| format!("{}: cannot stat ({e})", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{}: not a regular file", path.display()));
    }
    let mut bytes = Vec::new();
    file.take(cap)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{}: cannot read ({e})", path.display()))?;
    Ok(Capped {
        bytes,
        size: meta.len(),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn project_files_refuse_links_and_users_files_follow_them() {
        let d = tempfile::tempdir().unwrap();
        let meta = d.path().join(".automaton");
        std::fs::create_dir_all(meta.join("real")).unwrap();
        std::fs::write(meta.join("real/f"), "0123456789").unwrap();
        symlink(meta.join("real"), meta.join("linked")).unwrap();
        symlink(meta.join("real/f"), meta.join("f")).unwrap();

        let own = Found::projects(meta.join("real/f"), &meta);
        let got = read_capped(&own, 4).unwrap().unwrap();
        assert_eq!((got.bytes.as_slice(), got.size), (&b"0123"[..], 10));
        assert!(got.truncated());

        for linked in [meta.join("linked/f"), meta.join("f")] {
            let e = read_capped(&Found::projects(linked.clone(), &meta), 4).unwrap_err();
            assert!(e.contains("symbolic link"), "{linked:?}: {e}");
        }
        let users = Found::users(meta.join("linked/f"));
        assert_eq!(read_capped(&users, 100).unwrap().unwrap().size, 10);
        assert_eq!(
            read_capped(&Found::users(meta.join("absent")), 4).unwrap(),
            None
        );
        let e = read_capped(&Found::users(meta.join("real")), 4).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
    }
}
