//! One owner per project: an exclusive fs4 lock on `.automaton/coordinator.lock`, held for
//! the coordinator's lifetime, with its pid and address written inside for the CLI.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::Error;

pub struct Ownership {
    file: File,
    path: PathBuf,
}

impl Ownership {
    pub fn acquire(meta: &Path) -> Result<Ownership, Error> {
        std::fs::create_dir_all(meta)
            .map_err(|e| Error::Internal(format!("cannot create {}: {e}", meta.display())))?;
        let path = meta.join("coordinator.lock");
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::Internal(format!("cannot open {}: {e}", path.display())))?;
        if fs4::FileExt::try_lock(&file).is_err() {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.lines().collect::<Vec<_>>().join(", ");
            return Err(Error::Owned { path, holder });
        }
        Ok(Ownership { file, path })
    }

    /// Writes who owns the project and where it listens.
    pub fn publish(&mut self, address: &str) -> Result<(), Error> {
        let text = format!(
            "pid: {}\naddress: {address}\nstarted: {}\n",
            std::process::id(),
            automaton_store::format_time(std::time::SystemTime::now())
        );
        let io = |e: std::io::Error| {
            Error::Internal(format!("cannot write {}: {e}", self.path.display()))
        };
        self.file.set_len(0).map_err(io)?;
        self.file.seek(SeekFrom::Start(0)).map_err(io)?;
        self.file.write_all(text.as_bytes()).map_err(io)?;
        self.file.sync_all().map_err(io)
    }
}
