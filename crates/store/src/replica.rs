//! A second home for the task store's durable writes: with a [`Replica`] attached
//! ([`Project::with_replica`]), every file the store makes durable — states, approvals,
//! holders, implementers, run and completion records, artifacts, the fencing mark — is handed
//! to the replica first, and written locally only once the replica has it. A coordinator in
//! etcd mode attaches one that writes each file as a key under its project, in a transaction
//! fenced by its leadership: a deposed leader's write fails there, before it touches a file.
//! The local folder is then a view that the next leader rebuilds from the replica
//! ([`Project::restore_view`]). Lease views (`.state.lock` from a coordinator) are not
//! handed over: the lease log rebuilds them.
//!
//! The replica holds files, not rules: everything about what may be written stays in this
//! crate, in one place for every backend.

use std::fs;
use std::path::{Path, PathBuf};

use crate::fsx::{self, io_err};
use crate::{Error, Project};

/// Where the store's durable writes go before the local files. Called from the blocking
/// threads that run store changes; `path` is relative to the store's folder (`.automaton/`),
/// `/`-separated.
pub trait Replica: Send + Sync {
    /// Makes these files durable (all or none), each replacing what the replica had.
    fn put(&self, files: &[(&str, &[u8])]) -> Result<(), String>;

    /// Removes a file (absent is fine).
    fn remove(&self, path: &str) -> Result<(), String>;
}

/// The files a replica holds and a view is rebuilt from: under `tasks/` and `completions/`,
/// and the fencing mark. Never lease views, temporary files, or the lease log.
pub fn replicated(path: &str) -> bool {
    let leaf = path.rsplit('/').next().unwrap_or(path);
    let under = |dir: &str| path.starts_with(dir) && path.len() > dir.len();
    (path == "fencing" || under("tasks/") || under("completions/"))
        && leaf != crate::project::LOCK
        && !path
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
}

/// The replica a project writes through (its own type: `Project` is `Debug`).
#[derive(Clone)]
pub(crate) struct Attached(pub(crate) std::sync::Arc<dyn Replica>);

impl std::fmt::Debug for Attached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Replica")
    }
}

impl Project {
    /// This project with `replica` receiving every durable write before the local files.
    pub fn with_replica(mut self, replica: std::sync::Arc<dyn Replica>) -> Project {
        self.replica = Some(Attached(replica));
        self
    }

    /// `target` relative to the store's folder, as a replica names it.
    fn replica_path(&self, target: &Path) -> Result<String, Error> {
        let rel = target
            .strip_prefix(&self.meta)
            .ok()
            .and_then(|r| {
                r.components()
                    .map(|c| match c {
                        std::path::Component::Normal(s) => s.to_str(),
                        _ => None,
                    })
                    .collect::<Option<Vec<&str>>>()
            })
            .map(|parts| parts.join("/"));
        rel.ok_or_else(|| Error::Replica {
            path: target.to_path_buf(),
            detail: "the path is outside the task store".into(),
        })
    }

    /// Hands `files` (full paths) to the replica, if there is one and they are replicated.
    pub(crate) fn replicate(&self, files: &[(&Path, &[u8])]) -> Result<(), Error> {
        let Some(Attached(replica)) = &self.replica else {
            return Ok(());
        };
        let mut named = Vec::with_capacity(files.len());
        for (path, bytes) in files {
            let rel = self.replica_path(path)?;
            if replicated(&rel) {
                named.push((rel, *bytes));
            }
        }
        if named.is_empty() {
            return Ok(());
        }
        let refs: Vec<(&str, &[u8])> = named.iter().map(|(p, b)| (p.as_str(), *b)).collect();
        replica.put(&refs).map_err(|detail| Error::Replica {
            path: files[0].0.to_path_buf(),
            detail,
        })
    }

    /// Removes `path` durably, from the replica first.
    pub(crate) fn remove_durably(&self, path: &Path) -> Result<(), Error> {
        if let Some(Attached(replica)) = &self.replica {
            let rel = self.replica_path(path)?;
            if replicated(&rel) {
                replica.remove(&rel).map_err(|detail| Error::Replica {
                    path: path.to_path_buf(),
                    detail,
                })?;
            }
        }
        fsx::remove_durably(path)
    }

    /// Every replicated file of the local store, as a replica names it: what a first leader
    /// seeds an empty replica with.
    pub fn replicated_files(&self) -> Result<Vec<(String, Vec<u8>)>, Error> {
        let mut out = Vec::new();
        let mut stack: Vec<PathBuf> = vec![self.meta.join("tasks"), self.meta.join("completions")];
        let fencing = self.meta.join("fencing");
        if let Some(bytes) = fsx::read_capped(&self.meta, &fencing, 64)? {
            out.push(("fencing".to_string(), bytes));
        }
        while let Some(dir) = stack.pop() {
            if !fsx::is_real_dir(&self.meta, &dir)? {
                continue;
            }
            for (_, path, ft) in fsx::list_dir(&dir)? {
                if ft.is_dir() {
                    stack.push(path);
                } else if ft.is_file() {
                    let rel = self.replica_path(&path)?;
                    if replicated(&rel)
                        && let Some(bytes) =
                            fsx::read_capped(&self.meta, &path, crate::MAX_REPLICATED_BYTES)?
                    {
                        out.push((rel, bytes));
                    }
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// Makes the local store a view of `files` (what the replica holds): each written where
    /// it differs (temporary file, synced, renamed), and every replicated local file the
    /// replica does not hold removed. Writes nothing to the replica. Returns how many files
    /// were written and removed.
    pub fn restore_view(&self, files: &[(String, Vec<u8>)]) -> Result<(usize, usize), Error> {
        let mut written = 0;
        let wanted: std::collections::HashSet<&str> =
            files.iter().map(|(p, _)| p.as_str()).collect();
        for (rel, bytes) in files {
            if !replicated(rel) {
                continue;
            }
            let target = self.meta.join(rel);
            if fsx::read_capped(&self.meta, &target, crate::MAX_REPLICATED_BYTES)?.as_deref()
                == Some(bytes.as_slice())
            {
                continue;
            }
            if let Some(dir) = target.parent() {
                fs::create_dir_all(dir).map_err(io_err("create", dir))?;
                // A link in the way would write outside the store.
                if !fsx::is_real_dir(&self.meta, dir)? {
                    return Err(Error::Symlink {
                        path: dir.to_path_buf(),
                    });
                }
            }
            fsx::atomic_write(&self.tmp_dir(), &target, bytes)?;
            written += 1;
        }
        let mut removed = 0;
        for (rel, _) in self.replicated_files()? {
            if !wanted.contains(rel.as_str()) {
                fsx::remove_durably(&self.meta.join(&rel))?;
                removed += 1;
            }
        }
        Ok((written, removed))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};
    use std::time::SystemTime;

    use automaton_workflow::Artifact;

    use super::*;
    use crate::DispatchRecord;
    use crate::project::tests::name;

    /// A replica in memory; `fail` refuses every write.
    #[derive(Default)]
    struct Memory {
        files: Mutex<BTreeMap<String, Vec<u8>>>,
        fail: std::sync::atomic::AtomicBool,
    }

    impl Replica for Memory {
        fn put(&self, files: &[(&str, &[u8])]) -> Result<(), String> {
            if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
                return Err("not the leader".into());
            }
            let mut m = self.files.lock().expect("lock");
            for (p, b) in files {
                m.insert(p.to_string(), b.to_vec());
            }
            Ok(())
        }

        fn remove(&self, path: &str) -> Result<(), String> {
            if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
                return Err("not the leader".into());
            }
            self.files.lock().expect("lock").remove(path);
            Ok(())
        }
    }

    fn replicated_project() -> (tempfile::TempDir, Project, Arc<Memory>) {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join(".agent.md"), "Mode: multi-agent\n").expect("agent.md");
        let memory = Arc::new(Memory::default());
        let p = Project::open(dir.path(), None).with_replica(memory.clone());
        (dir, p, memory)
    }

    /// A task's whole life through the store: created, moved, approved, held, recorded.
    fn lifecycle(p: &Project) {
        let now = SystemTime::now();
        let t = name("t");
        p.create_task(&t).expect("create");
        p.transition(&t, "research".parse().expect("state"), None, None, now)
            .expect("research");
        let agent = "agent-a".parse().expect("agent");
        p.record_holder(&t, &agent, "research".parse().expect("state"))
            .expect("holder");
        p.write_artifact(&t, Artifact::Spec, b"# spec\n")
            .expect("artifact");
        p.transition(
            &t,
            "research:awaiting_approval".parse().expect("state"),
            None,
            None,
            now,
        )
        .expect("to the gate");
        p.approve(&t, "alice", None, now)
            .expect("approved: to design");
        let record = DispatchRecord {
            iterations: 2,
            ..DispatchRecord::default()
        };
        p.write_dispatch(&t, &record).expect("dispatch");
        p.write_dispatch(&t, &DispatchRecord::default())
            .expect("dispatch removed");
        p.set_fencing_mark(4096).expect("mark");
        p.create_task(&name("u")).expect("create u");
    }

    #[test]
    fn every_durable_write_reaches_the_replica_and_a_view_is_rebuilt_from_it() {
        let (_d, p, memory) = replicated_project();
        lifecycle(&p);
        let local: BTreeMap<String, Vec<u8>> =
            p.replicated_files().expect("walk").into_iter().collect();
        let held = memory.files.lock().expect("lock").clone();
        assert_eq!(held, local, "the replica holds exactly the local store");
        assert!(held.contains_key("tasks/t/.state"), "{:?}", held.keys());
        assert!(held.contains_key("fencing"));
        assert!(
            !held.contains_key("tasks/t/.state.dispatch"),
            "an emptied record is removed from the replica too"
        );
        // Another machine's view: built from the replica alone.
        let other = tempfile::tempdir().expect("tempdir");
        let q = Project::open(other.path(), None);
        let files: Vec<(String, Vec<u8>)> = held.clone().into_iter().collect();
        let (written, removed) = q.restore_view(&files).expect("restore");
        assert_eq!((written, removed), (held.len(), 0));
        let rebuilt: BTreeMap<String, Vec<u8>> =
            q.replicated_files().expect("walk").into_iter().collect();
        assert_eq!(rebuilt, held);
        assert_eq!(
            q.read_state(&name("t")).expect("read"),
            Some("research:approved".parse().expect("state"))
        );
        // Again: nothing to do. Then a file the replica no longer has goes.
        assert_eq!(q.restore_view(&files).expect("again"), (0, 0));
        let fewer: Vec<(String, Vec<u8>)> = files
            .iter()
            .filter(|(p, _)| !p.starts_with("tasks/u/"))
            .cloned()
            .collect();
        let (_, removed) = q.restore_view(&fewer).expect("fewer");
        assert!(removed >= 1);
        assert!(!q.task_dir(&name("u")).join(".state").exists());
    }

    #[test]
    fn a_refused_replica_write_changes_no_file() {
        let (_d, p, memory) = replicated_project();
        lifecycle(&p);
        let before = p.replicated_files().expect("walk");
        memory
            .fail
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let e = p
            .transition(
                &name("t"),
                "implement".parse().expect("state"),
                None,
                None,
                SystemTime::now(),
            )
            .expect_err("refused");
        assert!(e.to_string().contains("not the leader"), "{e}");
        assert!(p.create_task(&name("v")).is_err());
        assert!(p.set_fencing_mark(9999).is_err());
        assert_eq!(p.replicated_files().expect("walk"), before);
        assert!(!p.task_dir(&name("v")).exists());
    }

    #[test]
    fn a_view_is_never_written_through_a_link_or_outside_the_store() {
        let outside = tempfile::tempdir().expect("outside");
        let dir = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(dir.path().join(".automaton")).expect("meta");
        std::os::unix::fs::symlink(outside.path(), dir.path().join(".automaton/tasks"))
            .expect("link");
        let p = Project::open(dir.path(), None);
        let files = vec![("tasks/t/.state".to_string(), b"new\n".to_vec())];
        assert!(p.restore_view(&files).is_err());
        let escape = vec![
            ("../escape".to_string(), b"x".to_vec()),
            ("leases.wal".to_string(), b"x".to_vec()),
            ("tasks/t/.state.lock".to_string(), b"x".to_vec()),
        ];
        let q = Project::open(outside.path(), None);
        assert_eq!(q.restore_view(&escape).expect("skipped"), (0, 0));
        assert_eq!(
            fs::read_dir(outside.path()).expect("list").count(),
            0,
            "nothing written outside"
        );
    }
}
