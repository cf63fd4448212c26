//! Task names, task addresses (`parent/sub`) and agent ids.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Longest task name (each part of `parent/sub`).
pub const MAX_NAME_LEN: usize = 64;

/// A name or id that cannot be used; the message says what a valid one looks like.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error(
        "Invalid task name '{0}': use kebab-case (lowercase letters and digits joined by single hyphens, at most 64 characters), e.g. 'add-user-auth', or 'parent/sub' for a sub-task"
    )]
    Task(String),
    #[error(
        "Invalid agent id '{0}': use 1-64 characters from letters, digits, '.', '_', '@' and '-', starting with a letter or digit"
    )]
    Agent(String),
}

/// A caller's string as an error may repeat it: at most 64 bytes (cut on a character
/// boundary) and its length, so a 1 MiB name is never echoed back whole, nor logged.
pub fn excerpt(s: &str) -> String {
    const SHOWN: usize = 64;
    if s.len() <= SHOWN {
        return s.to_string();
    }
    let mut end = SHOWN;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &s[..end], s.len())
}

fn is_kebab(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME_LEN
        && s.split('-').all(|w| {
            !w.is_empty()
                && w.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        })
}

/// A task's address: `name` or `parent/sub`. Validation is what keeps it inside the tasks
/// folder: no `/` beyond the one separator, no `.`, no `..`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskName {
    parent: Option<String>,
    name: String,
}

impl TaskName {
    /// The git branch the task's code is on: `automaton/NAME`, a sub-task's
    /// `automaton/PARENT--SUB` (one level, so that a parent's branch and its sub-tasks'
    /// never nest as git refs).
    pub fn branch(&self) -> String {
        match &self.parent {
            Some(parent) => format!("automaton/{parent}--{}", self.name),
            None => format!("automaton/{}", self.name),
        }
    }

    pub fn parent(&self) -> Option<TaskName> {
        self.parent.as_ref().map(|p| TaskName {
            parent: None,
            name: p.clone(),
        })
    }

    /// The last part: the folder's own name.
    pub fn leaf(&self) -> &str {
        &self.name
    }

    /// `[parent, sub]` or `[name]`: the folder names from the tasks folder down.
    pub fn parts(&self) -> Vec<&str> {
        match &self.parent {
            Some(p) => vec![p.as_str(), self.name.as_str()],
            None => vec![self.name.as_str()],
        }
    }

    pub fn is_subtask(&self) -> bool {
        self.parent.is_some()
    }

    pub fn subtask(&self, sub: &str) -> Result<TaskName, NameError> {
        if self.parent.is_some() || !is_kebab(sub) {
            return Err(NameError::Task(format!("{self}/{sub}")));
        }
        Ok(TaskName {
            parent: Some(self.name.clone()),
            name: sub.to_string(),
        })
    }
}

impl FromStr for TaskName {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || NameError::Task(excerpt(s));
        match s.split_once('/') {
            None if is_kebab(s) => Ok(TaskName {
                parent: None,
                name: s.to_string(),
            }),
            Some((p, sub)) if is_kebab(p) && is_kebab(sub) => Ok(TaskName {
                parent: Some(p.to_string()),
                name: sub.to_string(),
            }),
            _ => Err(err()),
        }
    }
}

impl fmt::Display for TaskName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.parent {
            Some(p) => write!(f, "{p}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

impl Serialize for TaskName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for TaskName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// An agent's id, as written into `.state.lock`, `.state.implementer` and approvals. The
/// character set keeps it one token in every one of those line formats.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct AgentId(String);

impl<'de> Deserialize<'de> for AgentId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl AgentId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for AgentId {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ok = (1..=64).contains(&s.len())
            && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._@-".contains(&b));
        if ok {
            Ok(AgentId(s.to_string()))
        } else {
            Err(NameError::Agent(excerpt(s)))
        }
    }
}

impl fmt::Display for AgentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_names_accept_kebab_case_and_one_level_of_subtask() {
        for ok in ["a", "add-user-auth", "v2", "a1-b2-c3", "parent/sub-a"] {
            assert!(ok.parse::<TaskName>().is_ok(), "{ok}");
        }
        let t: TaskName = "parent/sub-a".parse().expect("valid");
        assert_eq!(t.parts(), vec!["parent", "sub-a"]);
        assert_eq!(t.parent().map(|p| p.to_string()), Some("parent".into()));
    }

    #[test]
    fn task_names_reject_escapes_and_malformed() {
        let long = "a".repeat(300);
        let exactly_65 = "a".repeat(65);
        for bad in [
            "",
            "../x",
            "..",
            ".",
            "A_B",
            "Add",
            "a_b",
            "a--b",
            "-a",
            "a-",
            "a b",
            "a/b/c",
            "/a",
            "a/",
            "a/../b",
            &long,
            &exactly_65,
            "é",
            "a\nb",
        ] {
            assert!(
                bad.parse::<TaskName>().is_err(),
                "{bad:?} should be refused"
            );
        }
        assert!("a".repeat(64).parse::<TaskName>().is_ok());
    }

    #[test]
    fn agent_ids_are_single_tokens() {
        let long = "x".repeat(1 << 20);
        let e = long.parse::<TaskName>().expect_err("too long").to_string();
        assert!(
            e.len() < 400,
            "a 1 MiB name is not echoed whole: {} bytes",
            e.len()
        );
        assert!(e.contains("(1048576 bytes)"), "{e}");
        let long = "é".repeat(100);
        assert!(excerpt(&long).ends_with("(200 bytes)"));
        for ok in ["agent-1", "a", "bob@gpu-b.example", "w_3.x"] {
            assert!(ok.parse::<AgentId>().is_ok(), "{ok}");
        }
        for bad in ["", "-a", "a b", "a|b", "a:b", "a\nb", &"a".repeat(65)] {
            assert!(bad.parse::<AgentId>().is_err(), "{bad:?}");
        }
    }
}
