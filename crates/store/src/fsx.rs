//! Durable file primitives: atomic replacement, directory sync, the project and task locks,
//! and the reads of the task store, which follow no symbolic link below `.automaton/`.

use std::fs::{self, File};
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, CWD, FileType, Mode, OFlags, openat, statat};
use rustix::io::Errno;

use crate::Error;

pub(crate) fn io_err<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// Makes a rename or unlink in `dir` durable. On ext4 without a journal a rename survives a
/// crash only once the directory itself is synced.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), Error> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("sync directory", dir))
}

/// A temporary file name unique to this write: `{pid}.{seq}.{what}.tmp`. Unique per write
/// because one process (the coordinator) writes many files at once; prefixed with the pid so
/// that cleanup can tell a dead writer's leftovers from a live writer's work in progress.
pub(crate) fn temp_name(what: &str) -> String {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{}.{seq}.{what}.tmp", std::process::id())
}

/// Whether a temporary entry was left by a process that no longer runs. Entries of this
/// process, of a live process, or with no readable pid are kept.
fn left_by_dead_process(name: &str) -> bool {
    let Some(pid) = name.split('.').next().and_then(|p| p.parse::<u32>().ok()) else {
        return false;
    };
    let proc = Path::new("/proc");
    pid != std::process::id() && proc.is_dir() && !proc.join(pid.to_string()).exists()
}

/// Replaces `target` with `bytes` so that a crash at any instant leaves the old or the new
/// content, never a torn file: write a temporary file in `tmp_dir` (same filesystem, outside
/// the task folder so no `.tmp` is ever left beside `.state`), fsync it, rename it over the
/// target, fsync the target's directory.
pub(crate) fn atomic_write(tmp_dir: &Path, target: &Path, bytes: &[u8]) -> Result<(), Error> {
    fs::create_dir_all(tmp_dir).map_err(io_err("create", tmp_dir))?;
    let name = target
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("file");
    let tmp = tmp_dir.join(temp_name(name));
    let result = (|| {
        let mut f = File::create(&tmp).map_err(io_err("create", &tmp))?;
        f.write_all(bytes).map_err(io_err("write", &tmp))?;
        f.sync_all().map_err(io_err("sync", &tmp))?;
        fs::rename(&tmp, target).map_err(io_err("rename into place", target))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result?;
    sync_dir(target.parent().unwrap_or(Path::new(".")))
}

/// Replaces `target` atomically (no reader sees a torn file) but without syncing: for files
/// that a durable log can rebuild. Temporary names are unique per write, so concurrent writers
/// in one process do not collide.
pub(crate) fn replace_unsynced(tmp_dir: &Path, target: &Path, bytes: &[u8]) -> Result<(), Error> {
    fs::create_dir_all(tmp_dir).map_err(io_err("create", tmp_dir))?;
    let tmp = tmp_dir.join(temp_name("view"));
    let result = fs::write(&tmp, bytes)
        .map_err(io_err("write", &tmp))
        .and_then(|()| fs::rename(&tmp, target).map_err(io_err("rename into place", target)));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Removes `path` durably; a file already gone is fine.
pub(crate) fn remove_durably(path: &Path) -> Result<(), Error> {
    match fs::remove_file(path) {
        Ok(()) => sync_dir(path.parent().unwrap_or(Path::new("."))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("remove", path)(e)),
    }
}

/// The largest state file (`.state`, `.state.approvals`, `.state.holders`, …) read whole.
pub(crate) const MAX_STATE_FILE: u64 = 64 << 20;

/// A folder opened to read or lock, never blocking (a FIFO put in a folder's place is refused
/// by `O_DIRECTORY` before anything waits on it).
const DIR: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NONBLOCK)
    .union(OFlags::CLOEXEC);
/// A file opened to read, never blocking: a FIFO opens at once, and is then refused.
const FILE: OFlags = OFlags::RDONLY
    .union(OFlags::NONBLOCK)
    .union(OFlags::CLOEXEC);

/// Opens `path` with `last` on its final component, and every component below `root` with
/// `O_NOFOLLOW`, one `openat` at a time from `root`'s descriptor: nothing below `root` is
/// reached through a symbolic link, and nothing swapped in between two steps is followed.
/// `root` itself is opened as given (`.automaton` may be a link: `~/.automaton` kept
/// elsewhere); `path == root` opens just it, links followed (the operator's own file).
/// `Ok(None)`: absent (or a file where a folder should be). A link is [`Error::Symlink`],
/// naming it.
fn open_below(root: &Path, path: &Path, last: OFlags) -> Result<Option<OwnedFd>, Error> {
    let outside = || io_err("open", path)(std::io::Error::other("not inside the task store"));
    let parts = path
        .strip_prefix(root)
        .map_err(|_| outside())?
        .components()
        .map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(outside)?;
    let first = if parts.is_empty() { last } else { DIR };
    let mut fd = match openat(CWD, root, first, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::NOENT | Errno::NOTDIR) => return Ok(None),
        Err(e) => return Err(io_err("open", root)(e.into())),
    };
    let mut at = root.to_path_buf();
    for (i, name) in parts.iter().enumerate() {
        at.push(name);
        let flags = if i + 1 == parts.len() { last } else { DIR };
        let next = match openat(&fd, *name, flags | OFlags::NOFOLLOW, Mode::empty()) {
            Ok(next) => next,
            Err(Errno::NOENT) => return Ok(None),
            // ELOOP (Linux, macOS) or EMLINK (FreeBSD): a link at the end; ENOTDIR: a link
            // or a file where a folder should be. Which, the entry itself says.
            Err(e @ (Errno::LOOP | Errno::MLINK | Errno::NOTDIR)) => {
                let link = statat(&fd, *name, AtFlags::SYMLINK_NOFOLLOW)
                    .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Symlink);
                if link {
                    return Err(Error::Symlink { path: at });
                }
                if e == Errno::NOTDIR {
                    return Ok(None);
                }
                return Err(io_err("open", &at)(e.into()));
            }
            Err(e) => return Err(io_err("open", &at)(e.into())),
        };
        fd = next;
    }
    Ok(Some(fd))
}

/// What a read found at a path.
pub(crate) enum Found {
    Absent,
    File(File),
    /// A folder, a FIFO, a device: never read.
    Other,
}

/// Opens `path` for reading without following a link below `root` ([`open_below`]) and
/// without ever blocking: a FIFO or a device put in a file's place is found on the opened
/// handle (so nothing can be swapped in between), never read.
pub(crate) fn open_found(root: &Path, path: &Path) -> Result<Found, Error> {
    let Some(fd) = open_below(root, path, FILE)? else {
        return Ok(Found::Absent);
    };
    let f = File::from(fd);
    if f.metadata().map_err(io_err("stat", path))?.is_file() {
        Ok(Found::File(f))
    } else {
        Ok(Found::Other)
    }
}

/// [`open_found`], where anything but a regular file is an error. `Ok(None)`: absent.
pub(crate) fn open_regular(root: &Path, path: &Path) -> Result<Option<File>, Error> {
    match open_found(root, path)? {
        Found::Absent => Ok(None),
        Found::File(f) => Ok(Some(f)),
        Found::Other => Err(io_err("read", path)(std::io::Error::other(
            "not a regular file: replace it with one, or remove it",
        ))),
    }
}

/// Reads a regular file of at most `cap` bytes whole, through no link below `root`;
/// `Ok(None)` when absent.
pub(crate) fn read_capped(root: &Path, path: &Path, cap: u64) -> Result<Option<Vec<u8>>, Error> {
    use std::io::Read;
    let Some(f) = open_regular(root, path)? else {
        return Ok(None);
    };
    let mut bytes = Vec::new();
    f.take(cap.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io_err("read", path))?;
    if bytes.len() as u64 > cap {
        return Err(io_err("read", path)(std::io::Error::other(format!(
            "larger than {cap} bytes: not a file this store writes"
        ))));
    }
    Ok(Some(bytes))
}

/// Reads a state file that may be absent, through no link below `root`.
pub(crate) fn read_optional(root: &Path, path: &Path) -> Result<Option<String>, Error> {
    match read_capped(root, path, MAX_STATE_FILE)? {
        None => Ok(None),
        Some(bytes) => String::from_utf8(bytes)
            .map(Some)
            .map_err(|_| Error::NotUtf8 {
                path: path.to_path_buf(),
            }),
    }
}

/// Opens a folder below `root` to lock or read it, never blocking and never through a link
/// ([`open_below`]): a task folder that is a link (or lies under one) is refused, naming the
/// link, and `O_DIRECTORY` refuses a FIFO swapped into its place before anything is opened.
/// `Ok(None)`: not a folder (absent, a file, a FIFO).
pub(crate) fn open_dir(root: &Path, path: &Path) -> Result<Option<File>, Error> {
    Ok(open_below(root, path, DIR)?.map(File::from))
}

/// Whether `path` is a real folder below `root`, reached through no link: what a write into
/// a task folder checks first, so that no write lands outside the task store.
pub(crate) fn is_real_dir(root: &Path, path: &Path) -> Result<bool, Error> {
    Ok(open_dir(root, path)?.is_some())
}

/// Opens the project's `.automaton/` folder to lock it (it may itself be a link: `~/.automaton`
/// kept elsewhere), never blocking.
fn open_meta(meta: &Path) -> Result<File, Error> {
    openat(CWD, meta, DIR, Mode::empty())
        .map(File::from)
        .map_err(|e| io_err("open", meta)(e.into()))
}

/// (device, inode) of an open file.
fn identity(f: &File, path: &Path) -> Result<(u64, u64), Error> {
    use std::os::unix::fs::MetadataExt;
    let m = f.metadata().map_err(io_err("stat", path))?;
    Ok((m.dev(), m.ino()))
}

/// The project's writer lock: an exclusive fs4 lock (flock) on the `{meta}` directory itself,
/// held while a command changes the project's shape (creates tasks, upgrades every task, bumps
/// the fencing counter). Every task writer holds the same lock shared ([`TaskLock`]), so this
/// one waits for their writes in flight and keeps new ones out. Locking the directory rather
/// than a lock file means a refused command creates nothing. Dropping it unlocks.
pub(crate) struct ProjectLock {
    _dir: File,
}

/// The writer lock of one task: the project lock shared, the parent's folder shared (for a
/// sub-task), then an exclusive flock on the task's own folder, held while one command reads,
/// checks and writes that task's files. Writes to different tasks run in parallel, so their
/// syncs overlap; writes to one task, and any change to the project's shape, still exclude
/// each other; a sub-task is written only while its parent is not being changed (its
/// creation, not yet durable, or its parent's `complete`). Always taken in that order
/// (project, parent, task, then — for a parent's `complete` — its sub-tasks shared), so no two
/// writers wait on each other. Fields drop in order: the task, the parent, the project.
pub(crate) struct TaskLock {
    _task: File,
    _parent: Option<File>,
    _project: File,
}

impl TaskLock {
    /// Locks the task at `task_dir` (a sub-task: under `parent_dir`) in the project `meta`.
    /// `None`: no such task folder (absent, a file, or the project's own folder); nothing was
    /// created. A folder that is a link, or under one, is [`Error::Symlink`].
    pub(crate) fn acquire(
        meta: &Path,
        tmp_dir: &Path,
        parent_dir: Option<&Path>,
        task_dir: &Path,
    ) -> Result<Option<TaskLock>, Error> {
        sweep_once(meta, tmp_dir);
        let project = open_meta(meta)?;
        fs4::FileExt::lock_shared(&project).map_err(io_err("lock", meta))?;
        let mut taken = vec![identity(&project, meta)?];
        let parent = match parent_dir {
            None => None,
            Some(p) => {
                let Some(f) = open_dir(meta, p)? else {
                    return Ok(None);
                };
                if taken.contains(&identity(&f, p)?) {
                    return Ok(None);
                }
                fs4::FileExt::lock_shared(&f).map_err(io_err("lock", p))?;
                taken.push(identity(&f, p)?);
                Some(f)
            }
        };
        // A folder replaced between the open and the lock would leave this lock on the old
        // one: lock again until the locked folder is the one at the path.
        loop {
            let Some(dir) = open_dir(meta, task_dir)? else {
                return Ok(None);
            };
            let held = identity(&dir, task_dir)?;
            // The project's (or the parent's) own folder reached some other way: locking it
            // exclusively through a second descriptor would wait for this lock forever.
            if taken.contains(&held) {
                return Ok(None);
            }
            fs4::FileExt::lock(&dir).map_err(io_err("lock", task_dir))?;
            match fs::symlink_metadata(task_dir) {
                Ok(now) => {
                    use std::os::unix::fs::MetadataExt;
                    if (now.dev(), now.ino()) == held {
                        return Ok(Some(TaskLock {
                            _task: dir,
                            _parent: parent,
                            _project: project,
                        }));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(io_err("stat", task_dir)(e)),
            }
        }
    }
}

/// A shared flock on a task's folder, for reading its state while its writers (who hold it
/// exclusively through their syncs) are kept out: a value read under it is durable. `None`
/// when it is not a real folder below `root`.
pub(crate) fn read_lock(root: &Path, dir: &Path) -> Option<File> {
    let f = open_dir(root, dir).ok()??;
    fs4::FileExt::lock_shared(&f).ok()?;
    Some(f)
}

impl ProjectLock {
    /// Locks `meta`, which must exist.
    pub(crate) fn acquire(meta: &Path, tmp_dir: &Path) -> Result<ProjectLock, Error> {
        let dir = open_meta(meta)?;
        // std::fs::File has an inherent `lock` since Rust 1.89; call fs4's explicitly.
        fs4::FileExt::lock(&dir).map_err(io_err("lock", meta))?;
        sweep_temporaries(tmp_dir);
        Ok(ProjectLock { _dir: dir })
    }
}

/// Removes what writers that died left in `tmp_dir` (a temporary file or a sub-task folder
/// being built, never renamed into place). Only dead processes' leftovers are removed: other
/// writers and a coordinator's lease views work there at the same time, and their work in
/// progress must survive.
fn sweep_temporaries(tmp_dir: &Path) {
    if let Ok(entries) = fs::read_dir(tmp_dir) {
        for e in entries.flatten() {
            if !left_by_dead_process(&e.file_name().to_string_lossy()) {
                continue;
            }
            let p = e.path();
            let _ = if p.is_dir() {
                fs::remove_dir_all(&p)
            } else {
                fs::remove_file(&p)
            };
        }
    }
}

/// Sweeps `tmp_dir` once per process, at its first task write: a command run from a shell
/// cleans up after a killed one, a coordinator after its killed predecessor, without every
/// task write listing the folder. Only while the whole project can be locked at once (no
/// other writer is at work, so no staging folder is being built or renamed): when it cannot,
/// a later write tries again.
fn sweep_once(meta: &Path, tmp_dir: &Path) {
    static SWEPT: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    let done = |swept: &Vec<PathBuf>| swept.iter().any(|p| p == tmp_dir);
    if done(&SWEPT.lock().unwrap_or_else(|p| p.into_inner())) {
        return;
    }
    let Ok(whole) = open_meta(meta) else {
        return;
    };
    if fs4::FileExt::try_lock(&whole).is_err() {
        return;
    }
    let mut swept = SWEPT.lock().unwrap_or_else(|p| p.into_inner());
    if !done(&swept) {
        sweep_temporaries(tmp_dir);
        swept.push(tmp_dir.to_path_buf());
    }
}

/// Lists a directory's entry names (sorted), or nothing when it does not exist.
pub(crate) fn list_dir(dir: &Path) -> Result<Vec<(String, PathBuf, fs::FileType)>, Error> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("read directory", dir)(e)),
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e.map_err(io_err("read directory", dir))?;
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        let ft = e.file_type().map_err(io_err("stat", &e.path()))?;
        out.push((name, e.path(), ft));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tmp = dir.path().join("tmp");
        let target = dir.path().join(".state");
        atomic_write(&tmp, &target, b"new\n").expect("write");
        atomic_write(&tmp, &target, b"research\n").expect("write");
        assert_eq!(fs::read_to_string(&target).expect("read"), "research\n");
        assert_eq!(fs::read_dir(&tmp).expect("tmp").count(), 0);
        let names: Vec<_> = fs::read_dir(dir.path())
            .expect("dir")
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn temp_names_are_unique_and_only_dead_writers_leftovers_are_garbage() {
        let (a, b) = (temp_name(".state"), temp_name(".state"));
        assert_ne!(a, b);
        assert!(!left_by_dead_process(&a), "this process is alive");
        assert!(!left_by_dead_process("1.0.x.tmp"), "pid 1 is alive");
        assert!(left_by_dead_process("4194303999.0.x.tmp") || !Path::new("/proc").is_dir());
        assert!(!left_by_dead_process("no-pid.tmp"));
    }

    #[test]
    fn atomic_write_failure_keeps_old_content() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("missing-dir").join(".state");
        assert!(atomic_write(&dir.path().join("tmp"), &target, b"x").is_err());
        assert_eq!(
            fs::read_dir(dir.path().join("tmp")).expect("tmp").count(),
            0
        );
    }
}
