//! Seed 002's layered lookup of framework files (`{project}/.automaton/…` over
//! `~/.automaton/…`), the `.agent.md` that sets the project's policy (and a misplaced one at
//! the project root), and that policy.
//!
//! Links: the project's layer comes with its repository (a merged change can add a link), and
//! its prompts, rules and contracts are served to agents, so nothing below the project's
//! `.automaton/` is read through a symbolic link ([`Error::Symlink`]); a link there is found,
//! and refused, never passed over for the user's file. `~/.automaton/` is the operator's own
//! (a dotfiles manager's links are common there): its links are followed, as is
//! `.automaton/` itself being one.

use std::path::{Component, Path, PathBuf};

use automaton_workflow::{Policy, PolicyFile};

use crate::fsx;
use crate::project::AGENT_MD;
use crate::{Error, Project};

impl Project {
    /// Seed 002's layered lookup of a framework file: `{project}/.automaton/{relative}` if
    /// anything is there (a link too: its reader refuses it), else `~/.automaton/{relative}`
    /// if that exists (file-level precedence: the first found is the whole answer). Read what
    /// it finds through no link below [`Project::links_stop_at`]. For `.agent.md`, `.rules.md`, `prompts/…`, `contracts/…`,
    /// `scripts/…`. A path that is absolute or climbs out with `..` is never looked up.
    pub fn layered(&self, relative: impl AsRef<Path>) -> Option<PathBuf> {
        let rel = relative.as_ref();
        if rel.as_os_str().is_empty()
            || !rel.components().all(|c| matches!(c, Component::Normal(_)))
        {
            return None;
        }
        let own = self.meta.join(rel);
        if present(&own) {
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
        if present(&own) {
            return Some(own);
        }
        match self.misplaced_agent_md() {
            Some((legacy, true)) => Some(legacy),
            _ => self.layered(AGENT_MD),
        }
    }

    /// Below which folder links are not followed for a file the layered lookup found: the
    /// project's `.automaton/` for its own layer (see the module's header); none for the
    /// user's `~/.automaton/` (the file itself is returned: links followed), which is also the
    /// project's layer when the project is `~/.automaton` itself.
    pub(crate) fn links_stop_at<'a>(&'a self, path: &'a Path) -> &'a Path {
        if self.meta != self.root && path.starts_with(&self.meta) {
            &self.meta
        } else {
            path
        }
    }

    /// The project's policy, from the one `.agent.md` that [`Project::policy_file`] names
    /// (defaults when there is none).
    pub fn policy(&self) -> Result<Policy, Error> {
        let Some(path) = self.policy_file() else {
            return Ok(Policy::default());
        };
        let file = match fsx::read_optional(self.links_stop_at(&path), &path)? {
            None => PolicyFile::default(),
            Some(text) => {
                PolicyFile::parse(&text).map_err(|source| Error::Policy { source, path })?
            }
        };
        Ok(Policy::layered(&file, &PolicyFile::default()))
    }
}

/// Whether something is at `path` (a link counts, even a dangling one).
fn present(path: &Path) -> bool {
    path.symlink_metadata().is_ok()
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
