//! `.vram_cache.json` (seed 002): the last probe, reused while its inputs are the same, for
//! at most `MAX_AGE` (free VRAM moves), and until a task is created or a decomposition is
//! triggered. Written atomically; a corrupt or unreadable cache is simply not used.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::Probe;

pub const FILE: &str = ".vram_cache.json";
/// Free VRAM changes as model servers come and go: a cached probe older than this is stale.
pub const MAX_AGE: Duration = Duration::from_secs(600);

#[derive(Serialize, Deserialize)]
struct Entry {
    key: String,
    written_ms: u64,
    probe: Probe,
}

fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The cached probe if it is still good, else why not (one line).
pub fn load(path: &Path, key: &str, task_dirs: &[PathBuf]) -> Result<Probe, String> {
    let text = fs::read_to_string(path).map_err(|_| "none yet".to_string())?;
    let e: Entry = serde_json::from_str(&text).map_err(|e| format!("corrupt, ignored ({e})"))?;
    if e.key != key {
        return Err("inputs changed".into());
    }
    let written = UNIX_EPOCH + Duration::from_millis(e.written_ms);
    let age = SystemTime::now()
        .duration_since(written)
        .unwrap_or(Duration::ZERO);
    if age > MAX_AGE {
        return Err(format!(
            "expired ({}s old, max {}s)",
            age.as_secs(),
            MAX_AGE.as_secs()
        ));
    }
    if let Some(what) = task_dirs.iter().find_map(|d| newer(d, written)) {
        return Err(format!("invalidated: {what} since it was written"));
    }
    Ok(e.probe)
}

/// A task folder created or a `DECOMPOSITION.md` written after `t`, under a tasks folder
/// (`tasks/{task}`, `tasks/{task}/subtasks/{sub}`).
fn newer(tasks: &Path, t: SystemTime) -> Option<String> {
    let after = |p: &Path| {
        fs::metadata(p)
            .and_then(|m| m.modified())
            .is_ok_and(|m| m > t)
    };
    // A new entry in a folder moves the folder's mtime.
    if after(tasks) {
        return Some(format!("a task folder created in {}", tasks.display()));
    }
    for task in fs::read_dir(tasks).ok()?.flatten() {
        let task = task.path();
        if !task.is_dir() {
            continue;
        }
        let subtasks = task.join("subtasks");
        if after(&task.join("DECOMPOSITION.md")) {
            return Some(format!(
                "{} written",
                task.join("DECOMPOSITION.md").display()
            ));
        }
        if after(&subtasks) {
            return Some(format!(
                "a sub-task folder created in {}",
                subtasks.display()
            ));
        }
        for sub in fs::read_dir(&subtasks).into_iter().flatten().flatten() {
            let d = sub.path().join("DECOMPOSITION.md");
            if after(&d) {
                return Some(format!("{} written", d.display()));
            }
        }
    }
    None
}

/// Temp file in the same folder, fsync, rename: a reader sees the old cache or the new one.
pub fn store(path: &Path, key: &str, probe: &Probe) -> Result<(), String> {
    let dir = path.parent().ok_or("no folder")?;
    fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let e = Entry {
        key: key.to_string(),
        written_ms: millis(SystemTime::now()),
        probe: probe.clone(),
    };
    let bytes = serde_json::to_vec_pretty(&e).map_err(|e| e.to_string())?;
    let mut tmp = tempfile_in(dir)?;
    tmp.1.write_all(&bytes).map_err(|e| e.to_string())?;
    tmp.1.sync_all().map_err(|e| e.to_string())?;
    fs::rename(&tmp.0, path).map_err(|e| {
        let _ = fs::remove_file(&tmp.0);
        e.to_string()
    })
}

fn tempfile_in(dir: &Path) -> Result<(PathBuf, fs::File), String> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let p = dir.join(format!(".vram_cache.{}.{nanos}.tmp", std::process::id()));
    let f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&p)
        .map_err(|e| e.to_string())?;
    Ok((p, f))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::probe::tests::sample;

    #[test]
    fn cache_round_trips_and_refuses_other_keys_and_corrupt_files() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(FILE);
        assert_eq!(load(&p, "k", &[]).unwrap_err(), "none yet");
        store(&p, "k", &sample()).unwrap();
        assert_eq!(load(&p, "k", &[]).unwrap(), sample());
        assert_eq!(load(&p, "other", &[]).unwrap_err(), "inputs changed");
        fs::write(&p, "{not json").unwrap();
        assert!(load(&p, "k", &[]).unwrap_err().starts_with("corrupt"));
    }

    #[test]
    fn cache_is_invalidated_by_a_new_task_folder_or_decomposition() {
        let d = tempfile::tempdir().unwrap();
        let tasks = d.path().join("tasks");
        fs::create_dir_all(tasks.join("t1/subtasks")).unwrap();
        let p = d.path().join(FILE);
        std::thread::sleep(Duration::from_millis(30));
        store(&p, "k", &sample()).unwrap();
        assert!(load(&p, "k", std::slice::from_ref(&tasks)).is_ok());
        std::thread::sleep(Duration::from_millis(30));
        fs::write(tasks.join("t1/DECOMPOSITION.md"), "x").unwrap();
        let e = load(&p, "k", std::slice::from_ref(&tasks)).unwrap_err();
        assert!(e.contains("DECOMPOSITION.md"), "{e}");
        store(&p, "k", &sample()).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        fs::create_dir(tasks.join("t2")).unwrap();
        let e = load(&p, "k", &[tasks]).unwrap_err();
        assert!(e.contains("task folder"), "{e}");
    }

    #[test]
    fn cache_older_than_ten_minutes_expires() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(FILE);
        let old = Entry {
            key: "k".into(),
            written_ms: millis(SystemTime::now() - MAX_AGE - Duration::from_secs(1)),
            probe: sample(),
        };
        fs::write(&p, serde_json::to_vec(&old).unwrap()).unwrap();
        assert!(load(&p, "k", &[]).unwrap_err().starts_with("expired"));
    }
}
