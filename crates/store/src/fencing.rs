//! The project's fencing high-water mark (`{project}/.automaton/fencing`): no token at or below
//! it is issued again. The CLI's local claim and the coordinator (which reserves blocks of
//! tokens) raise it durably before they hand a token out, so tokens never repeat after a crash.

use std::fs;

use crate::fsx::io_err;
use crate::{Error, Project};

impl Project {
    /// The project's fencing high-water mark: no token at or below it will be issued again.
    pub fn fencing_mark(&self) -> Result<u64, Error> {
        let path = self.meta.join("fencing");
        match self.read_optional(&path)? {
            None => Ok(0),
            Some(t) => t
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|m| *m <= crate::MAX_TOKEN)
                .ok_or(Error::CorruptFencing { path }),
        }
    }

    /// Persists a new high-water mark (durably: tokens must never repeat after a crash).
    pub fn set_fencing_mark(&self, mark: u64) -> Result<(), Error> {
        fs::create_dir_all(&self.meta).map_err(io_err("create", &self.meta))?;
        self.write(&self.meta.join("fencing"), format!("{mark}\n").as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::time::SystemTime;

    use automaton_workflow::AgentId;

    use crate::project::tests::{name, project};

    #[test]
    fn fencing_tokens_strictly_increase() {
        let (_d, p) = project();
        fs::write(p.root().join(".agent.md"), "Mode: multi-agent\n").expect("agent.md");
        p.create_task(&name("t")).expect("create");
        let now = SystemTime::now();
        p.transition(
            &name("t"),
            "research".parse().expect("valid"),
            None,
            None,
            now,
        )
        .expect("research");
        let a: AgentId = "a".parse().expect("valid");
        let mut last = 0;
        for _ in 0..5 {
            let (lease, renewed) = p.claim(&name("t"), &a, None, now).expect("claim");
            assert!(!renewed);
            assert!(lease.token > last);
            last = lease.token;
            p.release(&name("t"), &a, now).expect("release");
        }
    }
}
