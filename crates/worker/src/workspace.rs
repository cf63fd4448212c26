//! The agent's working directory, built without a shared filesystem: code trees the
//! coordinator sent, cached by commit id (`Cache`), and one fresh directory per assignment
//! (`Workspace`) holding a copy of the tree plus the task's inputs under `.automaton-task/`.
//! After the run, `Workspace::changes` says what the agent did to the tree, as a patch the
//! coordinator can apply; `Workspace::discard` removes everything.
//!
//! The cache is shared by every worker of a user on a machine (one per GPU): a tree a worker
//! uses is pinned by a shared `flock`, and eviction takes the lock exclusively or skips the
//! tree; trees appear whole by rename; a tree evicted before it was pinned is a miss.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The folder inside a workspace that holds the task's inputs, the agent's log and the
/// artifact it writes. Never part of the tree, never reported as a change.
pub const TASK_DIR: &str = ".automaton-task";
/// How many trees `Cache` keeps unless told otherwise.
pub const DEFAULT_KEEP: usize = 8;
/// `changes()` refuses more changed files than this …
pub const MAX_CHANGED_FILES: usize = 10_000;
/// … or more changed content than this (bytes).
pub const MAX_CHANGED_BYTES: u64 = 256 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "invalid path '{path}' in {what}: use a relative '/'-separated path without '..', '.' or empty parts"
    )]
    BadPath { what: &'static str, path: String },
    #[error("invalid commit id '{0}': use 1 to 128 letters, digits, '-' or '_' (a git commit id)")]
    BadCommit(String),
    #[error(
        "invalid workspace name '{0}': use 1 to 100 letters, digits, '-', '_' or '.', not starting with '.'"
    )]
    BadName(String),
    #[error("unknown input kind '{kind}' for '{path}': use task, prompt, rules or contract")]
    BadInputKind { kind: String, path: String },
    #[error("'{path}' appears twice in {what}")]
    Duplicate { what: &'static str, path: String },
    #[error("commit {0} is not in the tree cache: store it first")]
    NotCached(String),
    #[error(
        "too many changes: more than {MAX_CHANGED_FILES} files or {MAX_CHANGED_BYTES} bytes changed in {dir}"
    )]
    TooManyChanges { dir: PathBuf },
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// One file of a code tree, as the coordinator sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeFile {
    /// Relative, `/`-separated.
    pub path: String,
    pub executable: bool,
    pub content: Vec<u8>,
}

/// One input of an assignment: `kind` is `task` (an artifact or file of the task folder,
/// placed at `.automaton-task/{path}`), `prompt` (`.automaton-task/prompt.md`), `rules`
/// (`.automaton-task/rules.md`) or `contract` (`.automaton-task/contracts/{path}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputFile {
    pub kind: String,
    pub path: String,
    pub content: Vec<u8>,
}

/// What the agent did to one file of the tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Relative, `/`-separated.
    pub path: String,
    /// The file is gone (`content` empty, `executable` false).
    pub deleted: bool,
    pub executable: bool,
    pub content: Vec<u8>,
}

/// Refuses anything that could land outside the directory it is joined to.
fn check_rel(what: &'static str, path: &str) -> Result<()> {
    let bad = path.is_empty()
        || path.starts_with('/')
        || path.contains('\0')
        || path
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..");
    if bad {
        return Err(Error::BadPath {
            what,
            path: path.to_string(),
        });
    }
    Ok(())
}

fn check_commit(commit: &str) -> Result<()> {
    let ok = !commit.is_empty()
        && commit.len() <= 128
        && commit
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(Error::BadCommit(commit.to_string()))
    }
}

/// A name no other call in this or an earlier process has produced (pid, clock, counter).
fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{}-{nanos:x}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

fn mode(executable: bool) -> fs::Permissions {
    fs::Permissions::from_mode(if executable { 0o755 } else { 0o644 })
}

/// Writes `content` at `root/rel`, creating parent folders.
fn write_file(root: &Path, rel: &str, executable: bool, content: &[u8]) -> Result<()> {
    let path = root.join(rel);
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(io_err("create", parent))?;
    }
    fs::write(&path, content).map_err(io_err("write", &path))?;
    fs::set_permissions(&path, mode(executable)).map_err(io_err("chmod", &path))
}

/// The tree cache's layout under its folder. A tree is `store/{commit}/tree/`, beside a
/// `boot` marker naming the boot it was written in; `locks/{commit}` is its lock;
/// `tmp/{pid}.{seq}.{what}` holds trees being written and trees being removed.
const STORE: &str = "store";
const LOCKS: &str = "locks";
const TMP: &str = "tmp";
const TREE: &str = "tree";
const BOOT: &str = "boot";

/// This boot of the machine (Linux's `boot_id`; `unknown` elsewhere). A tree is written
/// without a sync of its files, so one from an earlier boot may have lost data to a power
/// cut: it is never read, and is evicted.
fn boot_id() -> &'static str {
    static BOOT_ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BOOT_ID.get_or_init(|| {
        fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "unknown".into())
    })
}

/// A temporary name unique to this process and call, `{pid}.{seq}.{what}`: the pid lets a
/// later worker tell a dead writer's leftovers from a live one's work in progress.
fn temp_name(what: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}.{}.{what}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// Whether a temporary entry was left by a process that no longer runs (never this one's,
/// nor one whose pid cannot be read or checked).
fn left_by_dead_process(name: &str) -> bool {
    let Some(pid) = name.split('.').next().and_then(|p| p.parse::<u32>().ok()) else {
        return false;
    };
    let proc = Path::new("/proc");
    pid != std::process::id() && proc.is_dir() && !proc.join(pid.to_string()).exists()
}

/// Whether `f` is the file at `path` now (an evictor unlinks a tree's lock file while it
/// holds it exclusively: a lock taken on the unlinked file protects nothing).
fn is_file_at(f: &fs::File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (f.metadata(), fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// A cached tree held in use: while any `Pin` of it lives, in this process or another, no
/// worker sharing the cache evicts it (a shared `flock` on its lock file; eviction takes it
/// exclusively and skips a tree it cannot). Dropping it lets the tree go.
#[derive(Debug)]
pub struct Pin {
    commit: String,
    _lock: fs::File,
}

impl Pin {
    pub fn commit(&self) -> &str {
        &self.commit
    }
}

/// Code trees keyed by commit id, the most recently stored or used `keep` kept, safe to
/// share between workers (processes) of one user: a tree is written into `tmp/` and renamed
/// into place whole; a tree in use is pinned (`Pin`) and never evicted; a tree that is gone
/// reads as not cached, never as a torn one.
#[derive(Debug, Clone)]
pub struct Cache {
    dir: PathBuf,
    keep: usize,
}

impl Cache {
    /// Opens (creating) the cache at `dir`, keeping the default 8 trees. Removes what dead
    /// workers left half-written or half-removed in `tmp/`, and trees of an earlier boot.
    pub fn open(dir: &Path) -> Result<Cache> {
        for sub in [STORE, LOCKS, TMP] {
            let d = dir.join(sub);
            fs::create_dir_all(&d).map_err(io_err("create", &d))?;
        }
        let cache = Cache {
            dir: dir.to_path_buf(),
            keep: DEFAULT_KEEP,
        };
        if let Ok(entries) = fs::read_dir(dir.join(TMP)) {
            for e in entries.flatten() {
                if left_by_dead_process(&e.file_name().to_string_lossy()) {
                    let _ = fs::remove_dir_all(e.path());
                }
            }
        }
        cache.evict();
        Ok(cache)
    }

    /// Keep the `keep` most recently stored or used trees (at least 1). Trees in use are
    /// kept beyond it until they are let go.
    pub fn with_keep(mut self, keep: usize) -> Cache {
        self.keep = keep.max(1);
        self
    }

    fn entry_dir(&self, commit: &str) -> PathBuf {
        self.dir.join(STORE).join(commit)
    }

    fn tree_dir(&self, commit: &str) -> PathBuf {
        self.entry_dir(commit).join(TREE)
    }

    fn lock_path(&self, commit: &str) -> PathBuf {
        self.dir.join(LOCKS).join(commit)
    }

    /// Whether `commit`'s tree is here, whole, written in this boot.
    pub fn has(&self, commit: &str) -> bool {
        check_commit(commit).is_ok() && self.complete(commit)
    }

    fn complete(&self, commit: &str) -> bool {
        fs::read_to_string(self.entry_dir(commit).join(BOOT)).is_ok_and(|b| b == boot_id())
            && self.tree_dir(commit).is_dir()
    }

    /// Every tree folder, whole or not, with its last use.
    fn entries(&self) -> Vec<(SystemTime, String, bool)> {
        let Ok(entries) = fs::read_dir(self.dir.join(STORE)) else {
            return vec![];
        };
        let mut found: Vec<(SystemTime, String, bool)> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                check_commit(&name).ok()?;
                let meta = e.metadata().ok()?;
                meta.is_dir().then(|| {
                    let whole = self.complete(&name);
                    (meta.modified().unwrap_or(UNIX_EPOCH), name, whole)
                })
            })
            .collect();
        found.sort_by(|a, b| b.cmp(a));
        found
    }

    /// The cached commits, most recently stored or used first: what to tell the coordinator
    /// (not pinned: one may be evicted before `pin`, which then says so).
    pub fn commits(&self) -> Vec<String> {
        self.entries()
            .into_iter()
            .filter(|e| e.2)
            .map(|e| e.1)
            .collect()
    }

    /// Opens `commit`'s lock file and takes it shared (waiting out an eviction, which holds
    /// it only to move the tree away).
    fn lock_shared(&self, commit: &str) -> Result<fs::File> {
        let path = self.lock_path(commit);
        loop {
            let f = fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&path)
                .map_err(io_err("open", &path))?;
            f.lock_shared().map_err(io_err("lock", &path))?;
            if is_file_at(&f, &path) {
                return Ok(f);
            }
        }
    }

    /// Pins `commit`'s tree so that no worker evicts it while it is used; `None` when it is
    /// not cached (any more).
    pub fn pin(&self, commit: &str) -> Result<Option<Pin>> {
        check_commit(commit)?;
        if !self.has(commit) {
            return Ok(None);
        }
        let lock = self.lock_shared(commit)?;
        // Evicted between the look and the lock: not cached.
        if !self.has(commit) {
            return Ok(None);
        }
        Ok(Some(Pin {
            commit: commit.to_string(),
            _lock: lock,
        }))
    }

    /// Stores `files` as the tree of `commit` and pins it: every path is checked first (a
    /// bad one is an error and nothing is written), the tree is written into `tmp/` and
    /// renamed into place with its marker, so a reader sees all of it or none (a worker
    /// killed mid-write leaves only `tmp/` garbage, removed by the next `open`). Storing a
    /// cached commit again only marks it used. Then unpinned trees beyond `keep` are evicted,
    /// least recently used first.
    pub fn store(&self, commit: &str, files: Vec<TreeFile>) -> Result<Pin> {
        check_commit(commit)?;
        let mut seen = BTreeSet::new();
        for f in &files {
            check_rel("the code tree", &f.path)?;
            if f.path.split('/').next() == Some(TASK_DIR) {
                return Err(Error::BadPath {
                    what: "the code tree (reserved folder)",
                    path: f.path.clone(),
                });
            }
            if !seen.insert(f.path.as_str()) {
                return Err(Error::Duplicate {
                    what: "the code tree",
                    path: f.path.clone(),
                });
            }
        }
        if let Some(pin) = self.pin(commit)? {
            self.touch(commit);
            return Ok(pin);
        }
        // Pinned before it appears: no other worker can evict it before it is used.
        let lock = self.lock_shared(commit)?;
        let tmp = self.dir.join(TMP).join(temp_name(commit));
        let written = (|| {
            let tree = tmp.join(TREE);
            fs::create_dir_all(&tree).map_err(io_err("create", &tree))?;
            for f in &files {
                write_file(&tree, &f.path, f.executable, &f.content)?;
            }
            let marker = tmp.join(BOOT);
            fs::write(&marker, boot_id()).map_err(io_err("write", &marker))?;
            let dest = self.entry_dir(commit);
            if fs::rename(&tmp, &dest).is_ok() {
                return Ok(());
            }
            // Another worker stored it meanwhile (the same content) …
            if self.has(commit) {
                return Ok(());
            }
            // … or a stale one (an earlier boot's) is in the way: nobody can be using it.
            Self::remove_moved(self.move_out(commit));
            fs::rename(&tmp, &dest).map_err(io_err("rename into", &dest))
        })();
        if tmp.exists() {
            let _ = fs::remove_dir_all(&tmp);
        }
        written?;
        self.touch(commit);
        self.evict();
        Ok(Pin {
            commit: commit.to_string(),
            _lock: lock,
        })
    }

    /// Reads a pinned tree back (for `Workspace::changes`), in path order. `NotCached` when
    /// it is gone all the same (removed by hand): fetch it again.
    pub fn load(&self, pin: &Pin) -> Result<Vec<TreeFile>> {
        let commit = pin.commit();
        if !self.has(commit) {
            return Err(Error::NotCached(commit.to_string()));
        }
        let dir = self.tree_dir(commit);
        let mut out = Vec::new();
        walk(&dir, "", &mut |rel, path, meta| {
            let content = fs::read(path).map_err(io_err("read", path))?;
            out.push(TreeFile {
                path: rel.to_string(),
                executable: meta.permissions().mode() & 0o111 != 0,
                content,
            });
            Ok(())
        })
        .map_err(gone_is_not_cached(commit))?;
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    /// Marks a tree as just used, so eviction keeps it longest.
    fn touch(&self, commit: &str) {
        if let Ok(f) = fs::File::open(self.entry_dir(commit)) {
            let _ = f.set_modified(SystemTime::now());
        }
    }

    /// Moves `commit`'s folder out of `store/` at once (a reader never sees half of it);
    /// returns where it went, for `remove_moved` (outside the tree's lock: removing a large
    /// tree takes a while, and a worker pinning it again must not wait for that).
    fn move_out(&self, commit: &str) -> Option<PathBuf> {
        let gone = self.dir.join(TMP).join(temp_name("evicted"));
        match fs::rename(self.entry_dir(commit), &gone) {
            Ok(()) => Some(gone),
            // Another worker evicted it first.
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => {
                tracing::warn!(commit = %commit, error = %e, "cannot evict a cached tree");
                None
            }
        }
    }

    fn remove_moved(gone: Option<PathBuf>) {
        if let Some(gone) = gone
            && let Err(e) = fs::remove_dir_all(&gone)
        {
            tracing::warn!(path = %gone.display(), error = %e, "cannot remove an evicted tree");
        }
    }

    /// Evicts the trees beyond `keep` (and any not whole) that no worker is using: each
    /// under its lock taken exclusively, skipped when that would wait.
    fn evict(&self) {
        let mut whole = 0usize;
        for (_, commit, ok) in self.entries() {
            if ok {
                whole += 1;
                if whole <= self.keep {
                    continue;
                }
            }
            let path = self.lock_path(&commit);
            let Ok(f) = fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&path)
            else {
                continue;
            };
            match f.try_lock() {
                Ok(()) => {}
                // In use: kept until it is let go.
                Err(fs::TryLockError::WouldBlock) => continue,
                Err(fs::TryLockError::Error(e)) => {
                    tracing::warn!(commit = %commit, error = %e, "cannot lock a cached tree to evict it");
                    continue;
                }
            }
            // Someone evicted (and maybe stored) it since: leave it to the next round.
            if !is_file_at(&f, &path) {
                continue;
            }
            let gone = self.move_out(&commit);
            // Still holding it: a locker of this file sees it unlinked and takes the new one.
            let _ = fs::remove_file(&path);
            drop(f);
            Self::remove_moved(gone);
        }
    }
}

/// A tree found missing while it is read: not cached (so fetched again), not a failure.
fn gone_is_not_cached(commit: &str) -> impl FnOnce(Error) -> Error + '_ {
    move |e| match e {
        Error::Io { ref source, .. } if source.kind() == io::ErrorKind::NotFound => {
            Error::NotCached(commit.to_string())
        }
        e => e,
    }
}

/// Calls `f(relative path, path, metadata)` for every regular file under `dir`, skipping
/// symlinks and other special files, and `.git` folders at any depth.
fn walk(
    dir: &Path,
    prefix: &str,
    f: &mut dyn FnMut(&str, &Path, &fs::Metadata) -> Result<()>,
) -> Result<()> {
    let entries = fs::read_dir(dir).map_err(io_err("list", dir))?;
    let mut entries: Vec<_> = entries
        .collect::<io::Result<_>>()
        .map_err(io_err("list", dir))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let Ok(name) = e.file_name().into_string() else {
            tracing::warn!(path = %e.path().display(), "skipping a file whose name is not UTF-8");
            continue;
        };
        let rel = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}/{name}")
        };
        let path = e.path();
        // symlink_metadata: a symlink is reported as one, never followed.
        let meta = fs::symlink_metadata(&path).map_err(io_err("inspect", &path))?;
        if meta.is_dir() {
            if name != ".git" {
                walk(&path, &rel, f)?;
            }
        } else if meta.is_file() {
            f(&rel, &path, &meta)?;
        }
    }
    Ok(())
}

fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    walk(from, "", &mut |rel, path, _| {
        let dest = to.join(rel);
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent).map_err(io_err("create", parent))?;
        }
        // A copy, not a hard link: an agent editing in place must not change the cache.
        fs::copy(path, &dest).map_err(io_err("copy into", &dest))?;
        Ok(())
    })
}

/// One assignment's working directory: `{root}/{name}-{unique}`.
#[derive(Debug)]
pub struct Workspace {
    dir: PathBuf,
}

impl Workspace {
    /// A fresh directory holding a copy of the pinned tree `tree` (none: an empty tree) and
    /// the inputs under `.automaton-task/`. Every input path is checked before anything is
    /// created; on any error the directory is removed again. `NotCached` when the tree is
    /// gone all the same (removed by hand): fetch it again.
    pub fn create(
        root: &Path,
        name: &str,
        cache: &Cache,
        tree: Option<&Pin>,
        inputs: &[InputFile],
    ) -> Result<Workspace> {
        let commit = tree.map(Pin::commit);
        let name_ok = !name.is_empty()
            && name.len() <= 100
            && !name.starts_with('.')
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !name_ok {
            return Err(Error::BadName(name.to_string()));
        }
        let mut placed = BTreeMap::new();
        for input in inputs {
            let rel = match input.kind.as_str() {
                "task" => {
                    check_rel("the task inputs", &input.path)?;
                    input.path.clone()
                }
                "prompt" => "prompt.md".to_string(),
                "rules" => "rules.md".to_string(),
                "contract" => {
                    check_rel("the contracts", &input.path)?;
                    format!("contracts/{}", input.path)
                }
                _ => {
                    return Err(Error::BadInputKind {
                        kind: input.kind.clone(),
                        path: input.path.clone(),
                    });
                }
            };
            if placed.insert(rel.clone(), &input.content).is_some() {
                return Err(Error::Duplicate {
                    what: "the task inputs",
                    path: rel,
                });
            }
        }
        if let Some(c) = commit
            && !cache.has(c)
        {
            return Err(Error::NotCached(c.to_string()));
        }
        fs::create_dir_all(root).map_err(io_err("create", root))?;
        let dir = loop {
            let dir = root.join(format!("{name}-{}", unique_suffix()));
            match fs::create_dir(&dir) {
                Ok(()) => break dir,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err("create", &dir)(e)),
            }
        };
        let ws = Workspace { dir };
        let filled = (|| {
            if let Some(c) = commit {
                cache.touch(c);
                copy_tree(&cache.tree_dir(c), &ws.dir).map_err(gone_is_not_cached(c))?;
            }
            let task = ws.task_dir();
            fs::create_dir_all(&task).map_err(io_err("create", &task))?;
            for (rel, content) in &placed {
                write_file(&task, rel, false, content)?;
            }
            Ok(())
        })();
        match filled {
            Ok(()) => Ok(ws),
            Err(e) => {
                let _ = fs::remove_dir_all(&ws.dir);
                Err(e)
            }
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `{ws}/.automaton-task`.
    pub fn task_dir(&self) -> PathBuf {
        self.dir.join(TASK_DIR)
    }

    /// `{ws}/.automaton-task/prompt.md` (present when a `prompt` input was given).
    pub fn prompt_file(&self) -> PathBuf {
        self.task_dir().join("prompt.md")
    }

    /// Where the agent writes the artifact `name`: `{ws}/.automaton-task/{name}`.
    pub fn artifact_path(&self, name: &str) -> PathBuf {
        self.task_dir().join(name)
    }

    /// Every file of the tree whose content or executable bit differs from `base`, every new
    /// file and every deleted one, in path order. `.automaton-task/` and `.git/` are ignored,
    /// and so is anything that is not a regular file: a symlink the agent created is not
    /// reported, and a base file the agent replaced by a symlink reads as deleted. Refuses
    /// more than `MAX_CHANGED_FILES` changes or `MAX_CHANGED_BYTES` of changed content.
    pub fn changes(&self, base: &[TreeFile]) -> Result<Vec<Change>> {
        self.changes_excluding(base, crate::presets::DEFAULT_PATCH_EXCLUDES)
    }

    /// [`Workspace::changes`] leaving out the paths `exclude` names (an agent's tool state:
    /// `crate::presets::excluded`), new, changed or deleted alike.
    pub fn changes_excluding<P: AsRef<str>>(
        &self,
        base: &[TreeFile],
        exclude: &[P],
    ) -> Result<Vec<Change>> {
        let base: BTreeMap<&str, &TreeFile> = base
            .iter()
            .filter(|f| !crate::presets::excluded(&f.path, exclude))
            .map(|f| (f.path.as_str(), f))
            .collect();
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        let mut bytes = 0u64;
        let too_many = || Error::TooManyChanges {
            dir: self.dir.clone(),
        };
        walk(&self.dir, "", &mut |rel, path, meta| {
            if rel.split('/').next() == Some(TASK_DIR) || crate::presets::excluded(rel, exclude) {
                return Ok(());
            }
            let executable = meta.permissions().mode() & 0o111 != 0;
            let old = base.get(rel).copied();
            if let Some(old) = old {
                seen.insert(old.path.as_str());
            }
            // Only read what may differ; a size change alone proves a change.
            let same_size = old.is_some_and(|o| o.content.len() as u64 == meta.len());
            if !same_size && bytes + meta.len() > MAX_CHANGED_BYTES {
                return Err(too_many());
            }
            let content = fs::read(path).map_err(io_err("read", path))?;
            if old.is_some_and(|o| o.executable == executable && o.content == content) {
                return Ok(());
            }
            bytes += content.len() as u64;
            if out.len() >= MAX_CHANGED_FILES || bytes > MAX_CHANGED_BYTES {
                return Err(too_many());
            }
            out.push(Change {
                path: rel.to_string(),
                deleted: false,
                executable,
                content,
            });
            Ok(())
        })?;
        for path in base.keys().filter(|p| !seen.contains(*p)) {
            if out.len() >= MAX_CHANGED_FILES {
                return Err(too_many());
            }
            out.push(Change {
                path: path.to_string(),
                deleted: true,
                executable: false,
                content: vec![],
            });
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    /// Removes the directory and everything in it (a lost lease keeps nothing).
    pub fn discard(self) -> Result<()> {
        fs::remove_dir_all(&self.dir).map_err(io_err("remove", &self.dir))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn file(path: &str, content: &str) -> TreeFile {
        TreeFile {
            path: path.into(),
            executable: false,
            content: content.as_bytes().to_vec(),
        }
    }

    fn input(kind: &str, path: &str, content: &str) -> InputFile {
        InputFile {
            kind: kind.into(),
            path: path.into(),
            content: content.as_bytes().to_vec(),
        }
    }

    fn base() -> Vec<TreeFile> {
        vec![
            file("README.md", "hello\n"),
            file("src/lib.rs", "pub fn a() {}\n"),
            file("src/gone.rs", "// soon deleted\n"),
            TreeFile {
                path: "run.sh".into(),
                executable: true,
                content: b"#!/bin/sh\n".to_vec(),
            },
        ]
    }

    #[test]
    fn cache_stores_a_tree_and_reads_it_back() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = Cache::open(tmp.path()).unwrap();
        assert!(!cache.has("abc123"));
        let pin = cache.store("abc123", base()).unwrap();
        assert!(cache.has("abc123"));
        assert_eq!(cache.commits(), vec!["abc123".to_string()]);
        let root = tmp.path().join("store/abc123/tree");
        assert_eq!(
            fs::read_to_string(root.join("src/lib.rs")).unwrap(),
            "pub fn a() {}\n"
        );
        let mode = fs::metadata(root.join("run.sh"))
            .unwrap()
            .permissions()
            .mode();
        assert_ne!(mode & 0o111, 0, "run.sh keeps its executable bit");
        let mut want = base();
        want.sort_by(|a, b| a.path.cmp(&b.path));
        assert_eq!(cache.load(&pin).unwrap(), want);
        // Nothing left in the temporary folder.
        assert_eq!(fs::read_dir(tmp.path().join("tmp")).unwrap().count(), 0);
    }

    #[test]
    fn cache_refuses_bad_paths_and_writes_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = Cache::open(tmp.path()).unwrap();
        for bad in [
            "/etc/passwd",
            "../escape",
            "a/../../b",
            "a//b",
            "",
            "./a",
            "a/",
            ".automaton-task/x",
        ] {
            let files = vec![file("ok.txt", "fine"), file(bad, "evil")];
            let e = cache.store("c1", files).expect_err(bad);
            assert!(matches!(e, Error::BadPath { .. }), "{bad}: {e}");
            assert!(!cache.has("c1"), "{bad}: nothing cached");
        }
        assert!(matches!(
            cache.store("../c1", base()),
            Err(Error::BadCommit(_))
        ));
        assert!(matches!(
            cache.store("c1", vec![file("a", "1"), file("a", "2")]),
            Err(Error::Duplicate { .. })
        ));
        assert!(cache.commits().is_empty());
        assert_eq!(fs::read_dir(tmp.path().join("tmp")).unwrap().count(), 0);
        assert!(!tmp.path().join("escape").exists());
    }

    #[test]
    fn cache_evicts_the_least_recently_used_beyond_keep() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = Cache::open(tmp.path()).unwrap().with_keep(3);
        for c in ["c1", "c2", "c3"] {
            drop(cache.store(c, vec![file("f", c)]).unwrap());
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // Using c1 makes it recent again: c2 is now the oldest.
        let c1 = cache.pin("c1").unwrap().unwrap();
        let ws = Workspace::create(&tmp.path().join("ws"), "t", &cache, Some(&c1), &[]).unwrap();
        ws.discard().unwrap();
        drop(c1);
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(cache.store("c4", vec![file("f", "c4")]).unwrap());
        let mut got = cache.commits();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], "c4", "most recent first");
        got.sort();
        assert_eq!(got, vec!["c1", "c3", "c4"]);
        assert!(!cache.has("c2"));
        assert!(!tmp.path().join("store/c2").exists());
        assert!(!tmp.path().join("locks/c2").exists());
    }

    #[test]
    fn workspace_layout_holds_tree_and_inputs() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = Cache::open(&tmp.path().join("cache")).unwrap();
        let abc = cache.store("abc", base()).unwrap();
        let root = tmp.path().join("work");
        let inputs = vec![
            input("task", "SPEC.md", "# Spec\n"),
            input("prompt", "ignored-name", "Do the thing.\n"),
            input("rules", "x", "Be careful.\n"),
            input("contract", "api/v1.md", "contract\n"),
        ];
        let ws = Workspace::create(&root, "t-1", &cache, Some(&abc), &inputs).unwrap();
        let dir = ws.dir().to_path_buf();
        assert_eq!(dir.parent().unwrap(), root);
        let dir_name = dir.file_name().unwrap().to_str().unwrap();
        assert!(dir_name.starts_with("t-1-"), "{dir_name}");
        assert_eq!(
            fs::read_to_string(dir.join("README.md")).unwrap(),
            "hello\n"
        );
        assert_eq!(ws.task_dir(), dir.join(".automaton-task"));
        assert_eq!(
            fs::read_to_string(ws.artifact_path("SPEC.md")).unwrap(),
            "# Spec\n"
        );
        assert_eq!(ws.prompt_file(), dir.join(".automaton-task/prompt.md"));
        assert_eq!(
            fs::read_to_string(ws.prompt_file()).unwrap(),
            "Do the thing.\n"
        );
        assert_eq!(
            fs::read_to_string(dir.join(".automaton-task/rules.md")).unwrap(),
            "Be careful.\n"
        );
        assert_eq!(
            fs::read_to_string(dir.join(".automaton-task/contracts/api/v1.md")).unwrap(),
            "contract\n"
        );
        // A second assignment of the same task gets a fresh directory.
        let again = Workspace::create(&root, "t-1", &cache, Some(&abc), &[]).unwrap();
        assert_ne!(again.dir(), ws.dir());
        // A fresh copy: editing it leaves the cache alone.
        fs::write(dir.join("README.md"), "edited").unwrap();
        assert_eq!(cache.load(&abc).unwrap()[0].content, b"hello\n");
        ws.discard().unwrap();
        assert!(!dir.exists());
        assert!(again.dir().exists());
    }

    #[test]
    fn workspace_refuses_bad_inputs_and_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = Cache::open(&tmp.path().join("cache")).unwrap();
        let root = tmp.path().join("work");
        for (kind, path) in [("task", "../x"), ("contract", "/abs"), ("bogus", "a")] {
            let e = Workspace::create(&root, "t", &cache, None, &[input(kind, path, "x")])
                .expect_err(path);
            assert!(
                matches!(e, Error::BadPath { .. } | Error::BadInputKind { .. }),
                "{e}"
            );
        }
        assert!(matches!(
            Workspace::create(&root, "../t", &cache, None, &[]),
            Err(Error::BadName(_))
        ));
        // A pinned tree removed by hand all the same: not cached (fetch it again).
        let gone = cache.store("gone", base()).unwrap();
        fs::remove_dir_all(tmp.path().join("cache/store/gone")).unwrap();
        assert!(matches!(
            Workspace::create(&root, "t", &cache, Some(&gone), &[]),
            Err(Error::NotCached(_))
        ));
        assert!(matches!(cache.load(&gone), Err(Error::NotCached(_))));
        assert!(!root.exists() || fs::read_dir(&root).unwrap().count() == 0);
    }

    #[test]
    fn changes_finds_modified_new_deleted_and_exec_bit_files() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = Cache::open(&tmp.path().join("cache")).unwrap();
        let abc = cache.store("abc", base()).unwrap();
        let ws = Workspace::create(
            &tmp.path().join("work"),
            "t",
            &cache,
            Some(&abc),
            &[input("task", "SPEC.md", "spec")],
        )
        .unwrap();
        let d = ws.dir();
        assert_eq!(ws.changes(&base()).unwrap(), vec![], "an untouched copy");
        // An agent's tool state is no change.
        fs::write(d.join(".aider.chat.history.md"), "chat").unwrap();
        fs::create_dir_all(d.join(".aider.tags.cache.v4")).unwrap();
        fs::write(d.join(".aider.tags.cache.v4/cache.db"), [0u8, 1]).unwrap();
        fs::create_dir_all(d.join(".claude")).unwrap();
        fs::write(d.join(".claude/settings.json"), "{}").unwrap();
        assert_eq!(ws.changes(&base()).unwrap(), vec![], "tool state only");
        fs::write(d.join("src/lib.rs"), "pub fn b() {}\n").unwrap();
        fs::write(d.join("src/new.rs"), "new\n").unwrap();
        fs::remove_file(d.join("src/gone.rs")).unwrap();
        fs::set_permissions(d.join("README.md"), mode(true)).unwrap();
        // Ignored: the task folder, .git, symlinks.
        fs::write(ws.artifact_path("IMPLEMENTATION.md"), "done").unwrap();
        fs::create_dir_all(d.join(".git")).unwrap();
        fs::write(d.join(".git/HEAD"), "ref").unwrap();
        std::os::unix::fs::symlink("README.md", d.join("link")).unwrap();
        let got = ws.changes(&base()).unwrap();
        let summary: Vec<(String, bool, bool)> = got
            .iter()
            .map(|c| (c.path.clone(), c.deleted, c.executable))
            .collect();
        assert_eq!(
            summary,
            vec![
                ("README.md".to_string(), false, true),
                ("src/gone.rs".to_string(), true, false),
                ("src/lib.rs".to_string(), false, false),
                ("src/new.rs".to_string(), false, false),
            ]
        );
        assert_eq!(got[0].content, b"hello\n");
        assert_eq!(got[2].content, b"pub fn b() {}\n");
        assert_eq!(got[3].content, b"new\n");
    }

    #[test]
    fn changes_refuses_more_than_the_file_limit() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = Cache::open(&tmp.path().join("cache")).unwrap();
        let ws = Workspace::create(&tmp.path().join("work"), "t", &cache, None, &[]).unwrap();
        let many = ws.dir().join("many");
        fs::create_dir_all(&many).unwrap();
        for i in 0..MAX_CHANGED_FILES {
            fs::write(many.join(i.to_string()), "x").unwrap();
        }
        assert_eq!(ws.changes(&[]).unwrap().len(), MAX_CHANGED_FILES);
        fs::write(many.join("one-more"), "x").unwrap();
        assert!(matches!(ws.changes(&[]), Err(Error::TooManyChanges { .. })));
    }

    /// A tree whose files depend on `commit` (several, so a store takes a while).
    fn tree_of(commit: &str) -> Vec<TreeFile> {
        (0..16)
            .map(|i| {
                file(
                    &format!("d{}/f{i}.txt", i % 4),
                    &format!("{commit}:{i}:").repeat(64),
                )
            })
            .collect()
    }

    #[test]
    fn cache_pinned_tree_survives_other_workers_evictions_and_goes_once_let_go() {
        let tmp = tempfile::tempdir().unwrap();
        let a = Cache::open(tmp.path()).unwrap().with_keep(1);
        let b = Cache::open(tmp.path()).unwrap().with_keep(1);
        drop(a.store("c0", tree_of("c0")).unwrap());
        // Worker A was told c0 is its run's tree and pins it …
        let offered = vec![a.pin("c0").unwrap().unwrap()];
        // … and stores c1 for another run; worker B churns through trees meanwhile.
        let c1 = a.store("c1", tree_of("c1")).unwrap();
        for c in ["c2", "c3", "c4"] {
            drop(b.store(c, tree_of(c)).unwrap());
        }
        assert!(a.has("c0") && a.has("c1"), "{:?}", a.commits());
        assert_eq!(a.load(&offered[0]).unwrap(), {
            let mut t = tree_of("c0");
            t.sort_by(|x, y| x.path.cmp(&y.path));
            t
        });
        let ws = Workspace::create(&tmp.path().join("w"), "t", &a, Some(&c1), &[]).unwrap();
        assert!(ws.dir().join("d1/f1.txt").is_file());
        ws.discard().unwrap();
        // Let go: the next store evicts them.
        drop(offered);
        drop(c1);
        drop(b.store("c5", tree_of("c5")).unwrap());
        assert_eq!(a.commits(), vec!["c5".to_string()]);
        assert_eq!(fs::read_dir(tmp.path().join("tmp")).unwrap().count(), 0);
    }

    #[test]
    fn cache_tree_offered_then_evicted_by_another_worker_is_a_miss_never_a_torn_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let a = Cache::open(tmp.path()).unwrap().with_keep(1);
        let b = Cache::open(tmp.path()).unwrap().with_keep(1);
        drop(a.store("c0", tree_of("c0")).unwrap());
        // A offers c0 to the coordinator; B evicts it before A pins it.
        assert_eq!(a.commits(), vec!["c0".to_string()]);
        drop(b.store("c1", tree_of("c1")).unwrap());
        assert!(a.pin("c0").unwrap().is_none(), "a miss: fetch it again");
        // Fetched again in full, it is whole.
        let again = a.store("c0", tree_of("c0")).unwrap();
        assert_eq!(a.load(&again).unwrap().len(), 16);
    }

    #[test]
    fn cache_shared_by_threads_under_churn_never_finds_a_tree_missing_or_torn() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let failures = std::sync::Mutex::new(Vec::<String>::new());
        std::thread::scope(|scope| {
            for w in 0..4u64 {
                let (dir, failures) = (&dir, &failures);
                scope.spawn(move || {
                    // Each thread is a worker with its own handle on the one folder.
                    let cache = Cache::open(dir).unwrap().with_keep(2);
                    let root = dir.join(format!("work-{w}"));
                    for i in 0..60u64 {
                        let c = format!("c{}", (i * 7 + w * 3) % 10);
                        // What a run does: offer the cached commits, pin the one it gets
                        // (or store it when it was not cached, or evicted meanwhile).
                        let offered = cache.commits();
                        let pinned = offered
                            .contains(&c)
                            .then(|| cache.pin(&c).unwrap())
                            .flatten();
                        let pin = match pinned {
                            Some(p) => p,
                            None => cache.store(&c, tree_of(&c)).unwrap(),
                        };
                        std::thread::yield_now();
                        let mut want = tree_of(&c);
                        want.sort_by(|x, y| x.path.cmp(&y.path));
                        match Workspace::create(&root, "t", &cache, Some(&pin), &[]) {
                            Ok(ws) => {
                                let got = fs::read_to_string(ws.dir().join("d3/f7.txt"));
                                if got.ok().map(String::into_bytes).as_ref()
                                    != Some(&want[15].content)
                                {
                                    failures.lock().unwrap().push(format!("{c}: torn copy"));
                                }
                                ws.discard().unwrap();
                            }
                            Err(e) => failures.lock().unwrap().push(format!("create {c}: {e}")),
                        }
                        match cache.load(&pin) {
                            Ok(t) if t == want => {}
                            Ok(_) => failures.lock().unwrap().push(format!("{c}: torn load")),
                            Err(e) => failures.lock().unwrap().push(format!("load {c}: {e}")),
                        }
                    }
                });
            }
        });
        let failures = failures.into_inner().unwrap();
        assert!(
            failures.is_empty(),
            "{} failures: {:?}",
            failures.len(),
            &failures[..failures.len().min(10)]
        );
        // Nothing in use: one more store leaves `keep` trees and no garbage.
        let cache = Cache::open(&dir).unwrap().with_keep(2);
        drop(cache.store("last", tree_of("last")).unwrap());
        assert_eq!(cache.commits().len(), 2, "{:?}", cache.commits());
        assert_eq!(fs::read_dir(dir.join("tmp")).unwrap().count(), 0);
    }

    /// Run in a child process by the tests below (`AUTOMATON_CACHE_HELPER` says what to do).
    #[test]
    #[ignore = "a helper the cross-process tests run in a child"]
    fn cache_helper_process() {
        let (Ok(what), Ok(dir)) = (
            std::env::var("AUTOMATON_CACHE_HELPER"),
            std::env::var("AUTOMATON_CACHE_DIR"),
        ) else {
            return;
        };
        let cache = Cache::open(Path::new(&dir)).unwrap().with_keep(1);
        if let Some(c) = what.strip_prefix("pin:") {
            let _pin = cache.store(c, tree_of(c)).unwrap();
            fs::write(Path::new(&dir).join("pinned"), c).unwrap();
            std::thread::sleep(std::time::Duration::from_secs(60));
        } else if what == "store-big" {
            // Many files: slow enough to be killed halfway.
            let files: Vec<TreeFile> = (0..200_000)
                .map(|i| file(&format!("d{}/f{i}", i % 100), "x"))
                .collect();
            let _ = cache.store("big", files);
        }
    }

    fn helper(dir: &Path, what: &str) -> std::process::Child {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "workspace::tests::cache_helper_process",
                "--ignored",
            ])
            .env("AUTOMATON_CACHE_HELPER", what)
            .env("AUTOMATON_CACHE_DIR", dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    }

    fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !f() {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    #[test]
    fn cache_pin_in_another_process_blocks_eviction_until_it_dies() {
        let tmp = tempfile::tempdir().unwrap();
        let mut child = helper(tmp.path(), "pin:theirs");
        wait_for("the child's pin", || tmp.path().join("pinned").exists());
        let cache = Cache::open(tmp.path()).unwrap().with_keep(1);
        for c in ["m1", "m2", "m3"] {
            drop(cache.store(c, tree_of(c)).unwrap());
        }
        assert!(cache.has("theirs"), "evicted under another process's pin");
        child.kill().unwrap();
        child.wait().unwrap();
        // Its lock died with it: the tree may go now.
        drop(cache.store("m4", tree_of("m4")).unwrap());
        assert_eq!(cache.commits(), vec!["m4".to_string()]);
    }

    #[test]
    fn cache_store_killed_9_midway_leaves_nothing_readable_and_is_swept() {
        let tmp = tempfile::tempdir().unwrap();
        let mut child = helper(tmp.path(), "store-big");
        let staging = tmp.path().join("tmp");
        wait_for("the child to be writing", || {
            fs::read_dir(&staging).is_ok_and(|mut d| {
                d.next().is_some_and(|e| {
                    e.is_ok_and(|e| fs::read_dir(e.path().join("tree/d99")).is_ok())
                })
            })
        });
        child.kill().unwrap();
        child.wait().unwrap();
        let cache = Cache::open(tmp.path()).unwrap();
        assert!(!cache.has("big"), "a half-written tree reads as not cached");
        assert!(cache.commits().is_empty());
        assert!(!tmp.path().join("store/big").exists());
        assert_eq!(
            fs::read_dir(&staging).unwrap().count(),
            0,
            "the dead worker's leftovers are swept"
        );
    }

    #[test]
    fn cache_trees_of_an_earlier_boot_or_without_marker_are_not_cached_and_evicted() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = Cache::open(tmp.path()).unwrap();
        drop(cache.store("now", tree_of("now")).unwrap());
        for (c, marker) in [("old", Some("another-boot")), ("bare", None)] {
            let entry = tmp.path().join("store").join(c);
            fs::create_dir_all(entry.join("tree")).unwrap();
            fs::write(entry.join("tree/a"), "maybe torn").unwrap();
            if let Some(m) = marker {
                fs::write(entry.join("boot"), m).unwrap();
            }
            assert!(!cache.has(c));
            assert!(cache.pin(c).unwrap().is_none());
        }
        // A live process's work in progress in tmp/ stays (pid 1 always runs).
        fs::create_dir_all(tmp.path().join("tmp/1.0.busy")).unwrap();
        assert_eq!(cache.commits(), vec!["now".to_string()]);
        let again = Cache::open(tmp.path()).unwrap();
        assert!(!tmp.path().join("store/old").exists());
        assert!(!tmp.path().join("store/bare").exists());
        assert!(tmp.path().join("tmp/1.0.busy").exists());
        // Stored again, it is whole and fresh.
        let pin = again.store("old", tree_of("old")).unwrap();
        assert_eq!(again.load(&pin).unwrap().len(), 16);
    }
}
