//! The agent's working directory, built without a shared filesystem: code trees the
//! coordinator sent, cached by commit id (`Cache`), and one fresh directory per assignment
//! (`Workspace`) holding a copy of the tree plus the task's inputs under `.automaton-task/`.
//! After the run, `Workspace::changes` says what the agent did to the tree, as a patch the
//! coordinator can apply; `Workspace::discard` removes everything.

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

/// Code trees keyed by commit id under `{dir}/trees/{commit}/`, the most recent `keep` kept.
#[derive(Debug, Clone)]
pub struct Cache {
    dir: PathBuf,
    keep: usize,
}

impl Cache {
    /// Opens (creating) the cache at `dir`, keeping the default 8 trees.
    pub fn open(dir: &Path) -> Result<Cache> {
        for sub in ["trees", "tmp"] {
            let d = dir.join(sub);
            fs::create_dir_all(&d).map_err(io_err("create", &d))?;
        }
        Ok(Cache {
            dir: dir.to_path_buf(),
            keep: DEFAULT_KEEP,
        })
    }

    /// Keep the `keep` most recently stored or used trees (at least 1).
    pub fn with_keep(mut self, keep: usize) -> Cache {
        self.keep = keep.max(1);
        self
    }

    fn tree_dir(&self, commit: &str) -> PathBuf {
        self.dir.join("trees").join(commit)
    }

    pub fn has(&self, commit: &str) -> bool {
        check_commit(commit).is_ok() && self.tree_dir(commit).is_dir()
    }

    /// The cached commits, most recently stored or used first: what to tell the coordinator.
    pub fn commits(&self) -> Vec<String> {
        let Ok(entries) = fs::read_dir(self.dir.join("trees")) else {
            return vec![];
        };
        let mut found: Vec<(SystemTime, String)> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                check_commit(&name).ok()?;
                let meta = e.metadata().ok()?;
                meta.is_dir()
                    .then(|| (meta.modified().unwrap_or(UNIX_EPOCH), name))
            })
            .collect();
        found.sort_by(|a, b| b.cmp(a));
        found.into_iter().map(|(_, c)| c).collect()
    }

    /// Stores `files` as the tree of `commit`: every path is checked first (a bad one is an
    /// error and nothing is written), the tree is written into a temporary folder and renamed
    /// into place, so a reader sees all of it or none. Storing a cached commit again only
    /// marks it used. Then trees beyond `keep` are evicted, least recently used first.
    pub fn store(&self, commit: &str, files: Vec<TreeFile>) -> Result<()> {
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
        if self.has(commit) {
            self.touch(commit);
            return Ok(());
        }
        let tmp = self
            .dir
            .join("tmp")
            .join(format!("{commit}-{}", unique_suffix()));
        fs::create_dir_all(&tmp).map_err(io_err("create", &tmp))?;
        let written = files
            .iter()
            .try_for_each(|f| write_file(&tmp, &f.path, f.executable, &f.content))
            .and_then(|()| {
                let dest = self.tree_dir(commit);
                match fs::rename(&tmp, &dest) {
                    Ok(()) => Ok(()),
                    // Another store of the same commit won the race: same content.
                    Err(_) if dest.is_dir() => Ok(()),
                    Err(e) => Err(io_err("rename into", &dest)(e)),
                }
            });
        if tmp.exists() {
            let _ = fs::remove_dir_all(&tmp);
        }
        written?;
        self.touch(commit);
        self.evict();
        Ok(())
    }

    /// Reads a cached tree back (for `Workspace::changes`), in path order.
    pub fn load(&self, commit: &str) -> Result<Vec<TreeFile>> {
        check_commit(commit)?;
        let dir = self.tree_dir(commit);
        if !dir.is_dir() {
            return Err(Error::NotCached(commit.to_string()));
        }
        let mut out = Vec::new();
        walk(&dir, "", &mut |rel, path, meta| {
            let content = fs::read(path).map_err(io_err("read", path))?;
            out.push(TreeFile {
                path: rel.to_string(),
                executable: meta.permissions().mode() & 0o111 != 0,
                content,
            });
            Ok(())
        })?;
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    /// Marks a tree as just used, so eviction keeps it longest.
    fn touch(&self, commit: &str) {
        if let Ok(f) = fs::File::open(self.tree_dir(commit)) {
            let _ = f.set_modified(SystemTime::now());
        }
    }

    fn evict(&self) {
        for old in self.commits().into_iter().skip(self.keep) {
            let dir = self.tree_dir(&old);
            if let Err(e) = fs::remove_dir_all(&dir) {
                tracing::warn!(commit = %old, error = %e, "cannot evict a cached tree");
            }
        }
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
    /// A fresh directory holding a copy of `commit`'s cached tree (none: an empty tree) and
    /// the inputs under `.automaton-task/`. Every input path is checked before anything is
    /// created; on any error the directory is removed again.
    pub fn create(
        root: &Path,
        name: &str,
        cache: &Cache,
        commit: Option<&str>,
        inputs: Vec<InputFile>,
    ) -> Result<Workspace> {
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
        for input in &inputs {
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
        if let Some(c) = commit {
            check_commit(c)?;
            if !cache.has(c) {
                return Err(Error::NotCached(c.to_string()));
            }
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
                copy_tree(&cache.tree_dir(c), &ws.dir)?;
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
        let base: BTreeMap<&str, &TreeFile> = base.iter().map(|f| (f.path.as_str(), f)).collect();
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        let mut bytes = 0u64;
        let too_many = || Error::TooManyChanges {
            dir: self.dir.clone(),
        };
        walk(&self.dir, "", &mut |rel, path, meta| {
            if rel.split('/').next() == Some(TASK_DIR) {
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
        cache.store("abc123", base()).unwrap();
        assert!(cache.has("abc123"));
        assert_eq!(cache.commits(), vec!["abc123".to_string()]);
        let root = tmp.path().join("trees/abc123");
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
        assert_eq!(cache.load("abc123").unwrap(), want);
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
            cache.store(c, vec![file("f", c)]).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // Using c1 makes it recent again: c2 is now the oldest.
        let ws =
            Workspace::create(&tmp.path().join("ws"), "t", &cache, Some("c1"), vec![]).unwrap();
        ws.discard().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        cache.store("c4", vec![file("f", "c4")]).unwrap();
        let mut got = cache.commits();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], "c4", "most recent first");
        got.sort();
        assert_eq!(got, vec!["c1", "c3", "c4"]);
        assert!(!cache.has("c2"));
        assert!(!tmp.path().join("trees/c2").exists());
    }

    #[test]
    fn workspace_layout_holds_tree_and_inputs() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = Cache::open(&tmp.path().join("cache")).unwrap();
        cache.store("abc", base()).unwrap();
        let root = tmp.path().join("work");
        let inputs = vec![
            input("task", "SPEC.md", "# Spec\n"),
            input("prompt", "ignored-name", "Do the thing.\n"),
            input("rules", "x", "Be careful.\n"),
            input("contract", "api/v1.md", "contract\n"),
        ];
        let ws = Workspace::create(&root, "t-1", &cache, Some("abc"), inputs).unwrap();
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
        let again = Workspace::create(&root, "t-1", &cache, Some("abc"), vec![]).unwrap();
        assert_ne!(again.dir(), ws.dir());
        // A fresh copy: editing it leaves the cache alone.
        fs::write(dir.join("README.md"), "edited").unwrap();
        assert_eq!(cache.load("abc").unwrap()[0].content, b"hello\n");
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
            let e = Workspace::create(&root, "t", &cache, None, vec![input(kind, path, "x")])
                .expect_err(path);
            assert!(
                matches!(e, Error::BadPath { .. } | Error::BadInputKind { .. }),
                "{e}"
            );
        }
        assert!(matches!(
            Workspace::create(&root, "../t", &cache, None, vec![]),
            Err(Error::BadName(_))
        ));
        assert!(matches!(
            Workspace::create(&root, "t", &cache, Some("nope"), vec![]),
            Err(Error::NotCached(_))
        ));
        assert!(!root.exists() || fs::read_dir(&root).unwrap().count() == 0);
    }

    #[test]
    fn changes_finds_modified_new_deleted_and_exec_bit_files() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = Cache::open(&tmp.path().join("cache")).unwrap();
        cache.store("abc", base()).unwrap();
        let ws = Workspace::create(
            &tmp.path().join("work"),
            "t",
            &cache,
            Some("abc"),
            vec![input("task", "SPEC.md", "spec")],
        )
        .unwrap();
        let d = ws.dir();
        assert_eq!(ws.changes(&base()).unwrap(), vec![], "an untouched copy");
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
        let ws = Workspace::create(&tmp.path().join("work"), "t", &cache, None, vec![]).unwrap();
        let many = ws.dir().join("many");
        fs::create_dir_all(&many).unwrap();
        for i in 0..MAX_CHANGED_FILES {
            fs::write(many.join(i.to_string()), "x").unwrap();
        }
        assert_eq!(ws.changes(&[]).unwrap().len(), MAX_CHANGED_FILES);
        fs::write(many.join("one-more"), "x").unwrap();
        assert!(matches!(ws.changes(&[]), Err(Error::TooManyChanges { .. })));
    }
}
