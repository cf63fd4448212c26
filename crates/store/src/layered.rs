//! Seed 002's layered lookup of framework files (`{project}/.automaton/…` over
//! `~/.automaton/…`), the `.agent.md` that sets the project's policy (and a misplaced one at
//! the project root), and that policy.

use std::path::{Component, Path, PathBuf};

use automaton_workflow::{Policy, PolicyFile};

use crate::fsx::read_optional;
use crate::project::AGENT_MD;
use crate::{Error, Project};

impl Project {
    /// Seed 002's layered lookup of a framework file: `{project}/.automaton/{relative}` if it
    /// exists, else `~/.automaton/{relative}` if that exists (file-level precedence: the first
    /// found is the whole answer). For `.agent.md`, `.rules.md`, `prompts/…`, `contracts/…`,
    /// `scripts/…`. A path that is absolute or climbs out with `..` is never looked up.
    pub fn layered(&self, relative: impl AsRef<Path>) -> Option<PathBuf> {
        let rel = relative.as_ref();
        if rel.as_os_str().is_empty()
            || !rel.components().all(|c| matches!(c, Component::Normal(_)))
        {
            return None;
        }
        let own = self.meta.join(rel);
        if own.exists() {
            return Some(own);
        }
        let user = self.home.as_ref()?.join(".automaton").join(rel);
        user.exists().then_some(user)
    }

    /// A `.agent.md` at the project root, where seed 002 does not look (it belongs in
    /// `{project}/.automaton/`), with whether it is still honoured: it is when the project has
    /// no `.automaton/.agent.md`. Callers warn about it.
    pub fn misplaced_agent_md(&self) -> Option<(PathBuf, bool)> {
        let legacy = self.root.join(AGENT_MD);
        if self.meta == self.root || !legacy.is_file() {
            return None;
        }
        Some((legacy, !self.meta.join(AGENT_MD).exists()))
    }

    /// The `.agent.md` that sets this project's policy, if any: the layered lookup, with a
    /// root-level `{project}/.agent.md` still honoured in place of `~/.automaton/.agent.md`
    /// when the project has no `.automaton/.agent.md`.
    pub fn policy_file(&self) -> Option<PathBuf> {
        let own = self.meta.join(AGENT_MD);
        if own.exists() {
            return Some(own);
        }
        match self.misplaced_agent_md() {
            Some((legacy, true)) => Some(legacy),
            _ => self.layered(AGENT_MD),
        }
    }

    /// The project's policy, from the one `.agent.md` that [`Project::policy_file`] names
    /// (defaults when there is none).
    pub fn policy(&self) -> Result<Policy, Error> {
        let Some(path) = self.policy_file() else {
            return Ok(Policy::default());
        };
        let file = match read_optional(&path)? {
            None => PolicyFile::default(),
            Some(text) => {
                PolicyFile::parse(&text).map_err(|source| Error::Policy { source, path })?
            }
        };
        Ok(Policy::layered(&file, &PolicyFile::default()))
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use crate::Project;
    use crate::project::tests::project;

    #[test]
    fn layered_lookup_prefers_the_project_file_then_the_users() {
        let home = tempfile::tempdir().expect("home");
        let (d, _) = project();
        let p = Project::open(d.path(), Some(home.path()));
        let user = home.path().join(".automaton");
        let own = d.path().join(".automaton");
        assert_eq!(p.layered("prompts/research.md"), None, "neither exists");
        fs::create_dir_all(user.join("prompts")).expect("mkdir");
        fs::write(user.join("prompts/research.md"), "user").expect("write");
        fs::write(user.join(".rules.md"), "user").expect("write");
        assert_eq!(
            p.layered("prompts/research.md"),
            Some(user.join("prompts/research.md"))
        );
        fs::create_dir_all(own.join("prompts")).expect("mkdir");
        fs::write(own.join("prompts/research.md"), "project").expect("write");
        assert_eq!(
            p.layered("prompts/research.md"),
            Some(own.join("prompts/research.md")),
            "the project's file wins"
        );
        assert_eq!(
            p.layered(".rules.md"),
            Some(user.join(".rules.md")),
            "file by file: the project has no .rules.md"
        );
        for outside in ["../x", "/etc/passwd", "", "prompts/../../x"] {
            assert_eq!(p.layered(outside), None, "{outside:?}");
        }
        let no_home = Project::open(d.path(), None);
        assert_eq!(no_home.layered(".rules.md"), None);
    }
}
