//! The machine-readable part of `DECOMPOSITION.md`: the sub-task table, its dependencies and
//! the waves they make (seed 002, "Sub-Task Creation Rules" and "Wave Management").
//! `docs/decomposition.md` is the user's description of the format; keep the two in step.

use std::collections::{HashMap, HashSet};

use crate::names::{MAX_NAME_LEN, excerpt};

/// Most sub-tasks one decomposition may list.
pub const MAX_SUBTASKS: usize = 200;

/// Largest estimate a row may carry: 10,000k tokens.
pub const MAX_ESTIMATE_TOKENS: u64 = 10_000_000;

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubtaskSpec {
    /// The kebab-case leaf name (`auth-gateway`), the sub-task's folder.
    pub name: String,
    /// The name as written, markdown emphasis removed (`Auth gateway`).
    pub title: String,
    /// Kebab-case names of the sub-tasks this one waits for, in the order written.
    pub depends_on: Vec<String>,
    pub peak_context_tokens: u64,
    /// The scope / acceptance cell, as written.
    pub scope: String,
    /// 1-based line of the row in `DECOMPOSITION.md`.
    pub line: usize,
}

/// The sub-tasks of a `DECOMPOSITION.md`, in table order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Decomposition {
    pub subtasks: Vec<SubtaskSpec>,
}

/// What is wrong with a `DECOMPOSITION.md`; each message says what to change, and names the
/// 1-based line of the offending row.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecompositionError {
    #[error(
        "DECOMPOSITION.md has no sub-task table: add a markdown table whose header has the columns 'sub-task', 'depends on' (or 'wave'), 'estimated peak context (k tokens)' and 'scope / acceptance', e.g. `| sub-task | depends on | estimated peak context (k tokens) | scope / acceptance |` `| --- | --- | --- | --- |` `| auth-core | - | 12 | tokens are issued; unit tests pass |` `| auth-api | auth-core | 8 | login endpoint; an API test passes |`"
    )]
    NoTable,
    #[error(
        "line {line}: the sub-task table has no {missing} column: the header needs 'sub-task', 'depends on' (or 'wave'), 'estimated peak context (k tokens)' and 'scope / acceptance'"
    )]
    MissingColumns { line: usize, missing: String },
    #[error("line {line}: the sub-task table has no rows: add one row per sub-task")]
    EmptyTable { line: usize },
    #[error(
        "line {line}: the row has {found} cells but the header has {expected}: write one cell per column (a '|' inside a cell is written '\\|')"
    )]
    Cells {
        line: usize,
        found: usize,
        expected: usize,
    },
    #[error("line {line}: the sub-task name is empty: name every sub-task, e.g. 'auth-gateway'")]
    EmptyName { line: usize },
    #[error(
        "line {line}: '{name}' cannot be made a task name: use ASCII letters, digits and spaces or hyphens, at most 64 characters in kebab-case, e.g. 'Auth gateway' or 'auth-gateway'"
    )]
    InvalidName { line: usize, name: String },
    #[error(
        "line {line}: estimated peak context '{value}' is not a positive number: write k tokens, e.g. '12' or '12k' for 12,000 tokens (a number of 1000 or more is read as raw tokens)"
    )]
    Estimate { line: usize, value: String },
    #[error(
        "line {line}: estimated peak context {tokens} tokens is above the limit of 10000k tokens: split the sub-task"
    )]
    EstimateTooLarge { line: usize, tokens: u64 },
    #[error(
        "line {line}: wave '{value}' is not a whole number of 1 or more: write 1 for the first wave, 2 for the next, …"
    )]
    Wave { line: usize, value: String },
    #[error(
        "line {line}: sub-task '{name}' has no scope: write what it is responsible for and how it is accepted (PARENT_SPEC.md carries it to the sub-task)"
    )]
    EmptyScope { line: usize, name: String },
    #[error(
        "line {line}: sub-task '{name}' depends on '{dependency}', which is not in the table: name a sub-task of this table, or write '-' for none"
    )]
    UnknownDependency {
        line: usize,
        name: String,
        dependency: String,
    },
    #[error(
        "line {line}: sub-task '{name}' depends on itself: remove it from its own 'depends on'"
    )]
    SelfDependency { line: usize, name: String },
    #[error(
        "lines {first} and {second}: sub-task '{name}' is listed twice: give each sub-task its own name (names are compared in kebab-case)"
    )]
    Duplicate {
        name: String,
        first: usize,
        second: usize,
    },
    #[error(
        "lines {lines}: the dependencies form a cycle {cycle} (each depends on the next): remove one of these dependencies"
    )]
    Cycle { cycle: String, lines: String },
    #[error(
        "the table lists {count} sub-tasks, more than the limit of 200: group them into fewer, larger sub-tasks (each may decompose further)"
    )]
    TooMany { count: usize },
}

impl DecompositionError {
    /// The 1-based line the error points at (the first, for a duplicate or a cycle).
    pub fn line(&self) -> Option<usize> {
        use DecompositionError::*;
        match self {
            NoTable | TooMany { .. } => None,
            MissingColumns { line, .. }
            | EmptyTable { line }
            | Cells { line, .. }
            | EmptyName { line }
            | InvalidName { line, .. }
            | Estimate { line, .. }
            | EstimateTooLarge { line, .. }
            | Wave { line, .. }
            | EmptyScope { line, .. }
            | UnknownDependency { line, .. }
            | SelfDependency { line, .. } => Some(*line),
            Duplicate { first, .. } => Some(*first),
            Cycle { lines, .. } => lines.split(", ").next().and_then(|l| l.parse().ok()),
        }
    }
}

/// The decomposition in `text`, or its first error. [`check_decomposition`] returns them all.
pub fn parse_decomposition(text: &str) -> Result<Decomposition, DecompositionError> {
    check_decomposition(text).map_err(|mut errors| errors.swap_remove(0))
}

/// The decomposition in `text`, or every error found, in line order: all row errors
/// (cells, names, estimates, waves, scopes), then duplicates and dependency errors. A cycle is
/// looked for only when there is nothing else to fix. Never an empty `Vec`.
pub fn check_decomposition(text: &str) -> Result<Decomposition, Vec<DecompositionError>> {
    let lines: Vec<&str> = text.lines().collect();
    let table = find_table(&lines).map_err(|e| vec![e])?;
    let rows: Vec<(usize, Vec<String>)> = table_rows(&lines, table.header_at + 2).collect();
    if rows.is_empty() {
        return Err(vec![DecompositionError::EmptyTable {
            line: table.header_at + 1,
        }]);
    }
    // Checked first, so that a huge table costs one pass, not a quadratic check.
    if rows.len() > MAX_SUBTASKS {
        return Err(vec![DecompositionError::TooMany { count: rows.len() }]);
    }

    let mut errors = Vec::new();
    let mut parsed: Vec<(SubtaskSpec, Option<u64>)> = Vec::new();
    for (line, cells) in rows {
        match parse_row(&table.columns, line, &cells) {
            Ok(row) => parsed.push(row),
            Err(mut e) => errors.append(&mut e),
        }
    }

    // The `wave` form: every sub-task of an earlier wave is a dependency.
    if table.columns.depends.is_none() {
        let waves: Vec<(String, u64)> = parsed
            .iter()
            .filter_map(|(s, w)| w.map(|w| (s.name.clone(), w)))
            .collect();
        for (spec, wave) in &mut parsed {
            if let Some(wave) = *wave {
                spec.depends_on = waves
                    .iter()
                    .filter(|(_, w)| *w < wave)
                    .map(|(n, _)| n.clone())
                    .collect();
            }
        }
    }
    let subtasks: Vec<SubtaskSpec> = parsed.into_iter().map(|(s, _)| s).collect();

    let mut first_line: HashMap<&str, usize> = HashMap::new();
    for s in &subtasks {
        if let Some(&first) = first_line.get(s.name.as_str()) {
            errors.push(DecompositionError::Duplicate {
                name: s.name.clone(),
                first,
                second: s.line,
            });
        } else {
            first_line.insert(&s.name, s.line);
        }
    }
    for s in &subtasks {
        for d in &s.depends_on {
            if *d == s.name {
                errors.push(DecompositionError::SelfDependency {
                    line: s.line,
                    name: s.name.clone(),
                });
            } else if !first_line.contains_key(d.as_str()) {
                errors.push(DecompositionError::UnknownDependency {
                    line: s.line,
                    name: s.name.clone(),
                    dependency: d.clone(),
                });
            }
        }
    }
    if !errors.is_empty() {
        errors.sort_by_key(|e| e.line().unwrap_or(0));
        return Err(errors);
    }
    let decomposition = Decomposition { subtasks };
    if let Some(cycle) = decomposition.find_cycle() {
        return Err(vec![cycle]);
    }
    Ok(decomposition)
}

impl Decomposition {
    /// Wave 1: the sub-tasks with no dependencies; wave N+1: those whose dependencies are all
    /// in waves 1..=N. Table order within a wave. A sub-task on a cycle or waiting for a name
    /// not in the list (possible only in a hand-built value) is in no wave.
    pub fn waves(&self) -> Vec<Vec<String>> {
        let mut placed: HashSet<&str> = HashSet::new();
        let mut out: Vec<Vec<String>> = Vec::new();
        loop {
            let wave: Vec<&str> = self
                .subtasks
                .iter()
                .filter(|s| !placed.contains(s.name.as_str()))
                .filter(|s| s.depends_on.iter().all(|d| placed.contains(d.as_str())))
                .map(|s| s.name.as_str())
                .collect();
            if wave.is_empty() {
                return out;
            }
            placed.extend(wave.iter().copied());
            out.push(wave.into_iter().map(str::to_string).collect());
        }
    }

    /// The 1-based wave of `name`; `None` for a name not in any wave.
    pub fn wave_of(&self, name: &str) -> Option<usize> {
        self.waves()
            .iter()
            .position(|w| w.iter().any(|n| n == name))
            .map(|i| i + 1)
    }

    pub fn get(&self, name: &str) -> Option<&SubtaskSpec> {
        self.subtasks.iter().find(|s| s.name == name)
    }

    /// A cycle among the sub-tasks left out of every wave, in dependency order.
    fn find_cycle(&self) -> Option<DecompositionError> {
        let placed: HashSet<String> = self.waves().into_iter().flatten().collect();
        let left: HashMap<&str, &SubtaskSpec> = self
            .subtasks
            .iter()
            .filter(|s| !placed.contains(&s.name))
            .map(|s| (s.name.as_str(), s))
            .collect();
        let start = self.subtasks.iter().find(|s| !placed.contains(&s.name))?;
        // Each unplaced sub-task waits for at least one other unplaced one, so the walk
        // always reaches a sub-task it has seen: the cycle starts there.
        let mut path: Vec<&SubtaskSpec> = vec![start];
        loop {
            let last = path[path.len() - 1];
            let next = last
                .depends_on
                .iter()
                .find_map(|d| left.get(d.as_str()).copied())?;
            if let Some(at) = path.iter().position(|s| s.name == next.name) {
                let on_cycle = &path[at..];
                let mut names: Vec<&str> = on_cycle.iter().map(|s| s.name.as_str()).collect();
                names.push(&next.name);
                let lines: Vec<String> = on_cycle.iter().map(|s| s.line.to_string()).collect();
                return Some(DecompositionError::Cycle {
                    cycle: names.join(" -> "),
                    lines: lines.join(", "),
                });
            }
            path.push(next);
        }
    }
}

/// Which cell of a row holds what.
#[derive(Debug, Default)]
struct Columns {
    count: usize,
    name: Option<usize>,
    depends: Option<usize>,
    wave: Option<usize>,
    estimate: Option<usize>,
    scope: Option<usize>,
}

struct Table {
    /// 0-based index of the header line.
    header_at: usize,
    columns: Columns,
}

enum Column {
    Name,
    Depends,
    Wave,
    Estimate,
    Scope,
}

/// What a header cell names, by its wording: lower case, letters and digits only.
fn classify(cell: &str) -> Option<Column> {
    let w: String = clean(cell)
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_lowercase())
        .collect();
    if w.contains("depend") || w.starts_with("after") || w.starts_with("prerequisite") {
        Some(Column::Depends)
    } else if w.starts_with("wave") {
        Some(Column::Wave)
    } else if w.contains("estimat") || w.contains("peak") || w.contains("context") {
        Some(Column::Estimate)
    } else if w.contains("scope") || w.contains("acceptance") {
        Some(Column::Scope)
    } else if w.starts_with("subtask") || w == "name" || w == "task" {
        Some(Column::Name)
    } else {
        None
    }
}

fn columns(header: &[String]) -> Columns {
    let mut c = Columns {
        count: header.len(),
        ..Columns::default()
    };
    for (i, cell) in header.iter().enumerate() {
        let slot = match classify(cell) {
            Some(Column::Name) => &mut c.name,
            Some(Column::Depends) => &mut c.depends,
            Some(Column::Wave) => &mut c.wave,
            Some(Column::Estimate) => &mut c.estimate,
            Some(Column::Scope) => &mut c.scope,
            None => continue,
        };
        // The first column of a kind wins.
        slot.get_or_insert(i);
    }
    c
}

fn missing(c: &Columns) -> Vec<&'static str> {
    let mut m = Vec::new();
    if c.name.is_none() {
        m.push("'sub-task'");
    }
    if c.depends.is_none() && c.wave.is_none() {
        m.push("'depends on' (or 'wave')");
    }
    if c.estimate.is_none() {
        m.push("'estimated peak context (k tokens)'");
    }
    if c.scope.is_none() {
        m.push("'scope / acceptance'");
    }
    m
}

/// The first table whose header has every column; else an error for the first table with a
/// sub-task column (saying what it lacks), else [`DecompositionError::NoTable`].
fn find_table(lines: &[&str]) -> Result<Table, DecompositionError> {
    let mut partial: Option<DecompositionError> = None;
    for (at, pair) in lines.windows(2).enumerate() {
        if !is_row(pair[0]) || !is_separator(pair[1]) {
            continue;
        }
        let columns = columns(&split_row(pair[0]));
        let lacking = missing(&columns);
        if lacking.is_empty() {
            return Ok(Table {
                header_at: at,
                columns,
            });
        }
        if columns.name.is_some() && partial.is_none() {
            partial = Some(DecompositionError::MissingColumns {
                line: at + 1,
                missing: lacking.join(" or "),
            });
        }
    }
    Err(partial.unwrap_or(DecompositionError::NoTable))
}

fn is_row(line: &str) -> bool {
    line.trim_start().starts_with('|')
}

fn is_separator(line: &str) -> bool {
    is_row(line)
        && split_row(line).iter().all(|c| {
            let c = c.trim_start_matches(':').trim_end_matches(':');
            !c.is_empty() && c.bytes().all(|b| b == b'-')
        })
}

/// The data rows from line index `from` to the first line that is not a table row, with
/// their 1-based line numbers. Rows whose cells are all empty are skipped.
fn table_rows<'a>(
    lines: &'a [&'a str],
    from: usize,
) -> impl Iterator<Item = (usize, Vec<String>)> + 'a {
    lines
        .iter()
        .enumerate()
        .skip(from)
        .take_while(|(_, l)| is_row(l))
        .map(|(i, l)| (i + 1, split_row(l)))
        .filter(|(_, cells)| cells.iter().any(|c| !c.is_empty()))
}

/// The trimmed cells of `| a | b |` (the outer pipes optional at the end); `\|` is a pipe
/// inside a cell.
fn split_row(line: &str) -> Vec<String> {
    let line = line.trim();
    let line = line.strip_prefix('|').unwrap_or(line);
    let mut cells = Vec::new();
    let mut cell = String::new();
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                cell.push('|');
                chars.next();
            }
            '|' => cells.push(std::mem::take(&mut cell).trim().to_string()),
            _ => cell.push(c),
        }
    }
    if !cell.trim().is_empty() {
        cells.push(cell.trim().to_string());
    }
    cells
}

/// A cell without markdown emphasis and code marks, whitespace collapsed.
fn clean(cell: &str) -> String {
    let stripped: String = cell.chars().filter(|c| !matches!(c, '*' | '`')).collect();
    let mut s = stripped.trim();
    while s.len() > 2 && s.starts_with('_') && s.ends_with('_') {
        s = &s[1..s.len() - 1];
    }
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Lower-case ASCII letters and digits, every other run of characters one hyphen; `'` is
/// dropped (`User's` → `users`).
pub(crate) fn kebab(s: &str) -> String {
    let mut out = String::new();
    let mut gap = false;
    for c in s.chars().filter(|c| !matches!(c, '\'' | '’')) {
        if c.is_ascii_alphanumeric() {
            if gap && !out.is_empty() {
                out.push('-');
            }
            gap = false;
            out.push(c.to_ascii_lowercase());
        } else {
            gap = true;
        }
    }
    out
}

/// The kebab-case name for a name cell: `None` when the cell has letters outside ASCII
/// (they would be lost), nothing usable, or more than 64 characters.
fn task_name(title: &str) -> Option<String> {
    if title.chars().any(|c| !c.is_ascii() && c.is_alphanumeric()) {
        return None;
    }
    let name = kebab(title);
    (!name.is_empty() && name.len() <= MAX_NAME_LEN).then_some(name)
}

fn is_none_word(s: &str) -> bool {
    matches!(
        s.to_ascii_lowercase().as_str(),
        "" | "-" | "—" | "–" | "none" | "n/a" | "na" | "nothing"
    )
}

/// Tokens from an estimate cell: `12`, `12k`, `12 k tokens`, `~1.5k`, `12,000`. Below 1000
/// the number is k tokens; 1000 and above, raw tokens.
fn estimate_tokens(cell: &str) -> Option<f64> {
    let s = cell.to_ascii_lowercase();
    let s = s.trim().trim_start_matches(['~', '≈']).trim();
    let s = s.strip_suffix("tokens").unwrap_or(s).trim();
    let (num, k) = match s.strip_suffix('k') {
        Some(n) => (n.trim(), true),
        None => (s, false),
    };
    let digits: String = num.chars().filter(|c| !matches!(c, ',' | '_')).collect();
    let well_formed = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && digits.bytes().filter(|&b| b == b'.').count() <= 1
        && digits.bytes().any(|b| b.is_ascii_digit());
    if !well_formed {
        return None;
    }
    let n: f64 = digits.parse().ok()?;
    Some(if k || n < 1000.0 { n * 1000.0 } else { n })
}

fn parse_wave(cell: &str) -> Option<u64> {
    let s = cell.to_ascii_lowercase();
    let s = s.trim();
    let s = s.strip_prefix("wave").unwrap_or(s).trim();
    let s = s.strip_prefix('w').unwrap_or(s).trim();
    s.parse::<u64>().ok().filter(|&w| w >= 1)
}

/// One row: the spec and its wave (when the table has a wave column), or its errors.
fn parse_row(
    columns: &Columns,
    line: usize,
    cells: &[String],
) -> Result<(SubtaskSpec, Option<u64>), Vec<DecompositionError>> {
    if cells.len() != columns.count {
        return Err(vec![DecompositionError::Cells {
            line,
            found: cells.len(),
            expected: columns.count,
        }]);
    }
    let cell = |i: Option<usize>| i.and_then(|i| cells.get(i)).map_or("", String::as_str);
    let mut errors = Vec::new();

    let title = clean(cell(columns.name));
    let name = if title.is_empty() {
        errors.push(DecompositionError::EmptyName { line });
        String::new()
    } else {
        task_name(&title).unwrap_or_else(|| {
            errors.push(DecompositionError::InvalidName {
                line,
                name: excerpt(&title),
            });
            String::new()
        })
    };

    let raw_estimate = clean(cell(columns.estimate));
    let peak_context_tokens = match estimate_tokens(&raw_estimate) {
        Some(t) if t > MAX_ESTIMATE_TOKENS as f64 => {
            errors.push(DecompositionError::EstimateTooLarge {
                line,
                tokens: if t >= u64::MAX as f64 {
                    u64::MAX
                } else {
                    t.round() as u64
                },
            });
            0
        }
        Some(t) if t >= 1.0 => t.round() as u64,
        _ => {
            errors.push(DecompositionError::Estimate {
                line,
                value: excerpt(&raw_estimate),
            });
            0
        }
    };

    let mut depends_on = Vec::new();
    let mut seen = HashSet::new();
    let mut wave = None;
    if let Some(i) = columns.depends {
        for part in cell(Some(i)).split([',', ';']) {
            let part = clean(part);
            if is_none_word(&part) {
                continue;
            }
            let dep = kebab(&part);
            if dep.is_empty() {
                errors.push(DecompositionError::UnknownDependency {
                    line,
                    name: name.clone(),
                    dependency: excerpt(&part),
                });
            } else if seen.insert(dep.clone()) {
                depends_on.push(dep);
            }
        }
    } else {
        let raw = clean(cell(columns.wave));
        match parse_wave(&raw) {
            Some(w) => wave = Some(w),
            None => errors.push(DecompositionError::Wave {
                line,
                value: excerpt(&raw),
            }),
        }
    }

    let scope = cell(columns.scope).trim().to_string();
    if scope.is_empty() && !name.is_empty() {
        errors.push(DecompositionError::EmptyScope {
            line,
            name: name.clone(),
        });
    }

    if !errors.is_empty() {
        return Err(errors);
    }
    Ok((
        SubtaskSpec {
            name,
            title,
            depends_on,
            peak_context_tokens,
            scope,
            line,
        },
        wave,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzz::{Rng, assert_no_panics, iterations, run};

    /// Exactly what `crates/worker/src/scripted.rs` (`artifact_text`, phase decomposition)
    /// writes for task `big`; the worker crate depends on this one, so it is copied here. A
    /// change there must be mirrored here.
    const SCRIPTED: &str = "# DECOMPOSITION — big\n\n\
        ## Sub-tasks\n\n\
        | sub-task | depends on | estimated peak context (k tokens) | scope / acceptance |\n\
        | --- | --- | --- | --- |\n\
        | big-core | — | 12 | the core change; its unit tests pass |\n\
        | big-api | big-core | 8 | expose the change; an API test passes |\n\
        | big-docs | big-api | 4 | document the change; the docs build |\n\
        _Written by the scripted agent (phase decomposition, fencing token 3); deterministic, for tests and demos._\n";

    fn names(d: &Decomposition) -> Vec<&str> {
        d.subtasks.iter().map(|s| s.name.as_str()).collect()
    }

    fn err(text: &str) -> String {
        parse_decomposition(text).expect_err(text).to_string()
    }

    const HEAD: &str = "| sub-task | depends on | estimate | scope |\n|---|---|---|---|\n";

    #[test]
    fn parses_the_scripted_agents_decomposition() {
        let d = parse_decomposition(SCRIPTED).expect("the scripted agent's table parses");
        assert_eq!(names(&d), ["big-core", "big-api", "big-docs"]);
        let core = &d.subtasks[0];
        assert_eq!(core.depends_on, Vec::<String>::new(), "'—' means none");
        assert_eq!(core.peak_context_tokens, 12_000);
        assert_eq!(core.scope, "the core change; its unit tests pass");
        assert_eq!(core.line, 7);
        assert_eq!(d.subtasks[1].depends_on, ["big-core"]);
        assert_eq!(d.subtasks[2].peak_context_tokens, 4_000);
        assert_eq!(
            d.waves(),
            vec![vec!["big-core"], vec!["big-api"], vec!["big-docs"]]
        );
        assert_eq!(d.wave_of("big-docs"), Some(3));
        assert_eq!(d.wave_of("nope"), None);
    }

    #[test]
    fn natural_language_table_with_extra_spaces_bold_names_and_k_estimates() {
        let text = "Intro prose.\n\n\
            | Task | Value |\n|---|---|\n| a | b |\n\n\
            |  **Sub-task Name**  | Dependencies |  Estimated Peak Context  | Scope / Acceptance Criteria |\n\
            |:---|:---:|---:|---|\n\
            |   **Auth gateway**   |   none   |   12k   |  Issues tokens;   tests pass  |\n\
            | `User's profile page` | **Auth gateway** , auth-gateway | ~1.5k tokens | Shows the user |\n\
            | Billing v2.1 | Auth Gateway; User's profile page | 12,000 | Charges \\| refunds |\n";
        let d = parse_decomposition(text).expect("parses");
        assert_eq!(
            names(&d),
            ["auth-gateway", "users-profile-page", "billing-v2-1"]
        );
        assert_eq!(d.subtasks[0].title, "Auth gateway");
        assert_eq!(d.subtasks[0].peak_context_tokens, 12_000);
        assert_eq!(d.subtasks[0].scope, "Issues tokens;   tests pass");
        assert_eq!(d.subtasks[0].line, 9);
        assert_eq!(d.subtasks[1].title, "User's profile page");
        assert_eq!(d.subtasks[1].depends_on, ["auth-gateway"], "deduplicated");
        assert_eq!(d.subtasks[1].peak_context_tokens, 1_500);
        assert_eq!(
            d.subtasks[2].depends_on,
            ["auth-gateway", "users-profile-page"]
        );
        assert_eq!(d.subtasks[2].peak_context_tokens, 12_000, "≥1000 is raw");
        assert_eq!(d.subtasks[2].scope, "Charges | refunds");
    }

    #[test]
    fn estimates_are_k_tokens_below_1000_and_raw_tokens_from_1000() {
        for (cell, tokens) in [
            ("12", 12_000),
            ("12k", 12_000),
            ("12K", 12_000),
            ("12 k", 12_000),
            ("**12k tokens**", 12_000),
            ("0.5", 500),
            ("999", 999_000),
            ("1000", 1_000),
            ("12000", 12_000),
            ("1000k", 1_000_000),
            ("10000k", 10_000_000),
        ] {
            let text = format!("{HEAD}| a | - | {cell} | s |\n");
            let d = parse_decomposition(&text).expect(cell);
            assert_eq!(d.subtasks[0].peak_context_tokens, tokens, "{cell}");
        }
        for cell in ["", "twelve", "1e3", "-5", "0", "1.2.3", "12m", "k"] {
            let text = format!("{HEAD}| a | - | {cell} | s |\n");
            assert_eq!(
                err(&text),
                format!(
                    "line 3: estimated peak context '{cell}' is not a positive number: write k tokens, e.g. '12' or '12k' for 12,000 tokens (a number of 1000 or more is read as raw tokens)"
                )
            );
        }
        let text = format!("{HEAD}| a | - | 10001k | s |\n");
        assert_eq!(
            err(&text),
            "line 3: estimated peak context 10001000 tokens is above the limit of 10000k tokens: split the sub-task"
        );
    }

    #[test]
    fn wave_column_makes_every_earlier_wave_a_dependency() {
        let text = "| Sub-task | Wave | Peak context (k) | Acceptance |\n|--|--|--|--|\n\
            | a | 1 | 4 | x |\n| b | Wave 1 | 4 | x |\n| c | 2 | 4 | x |\n| d | 5 | 4 | x |\n";
        let d = parse_decomposition(text).expect("parses");
        assert!(d.subtasks[0].depends_on.is_empty());
        assert!(d.subtasks[1].depends_on.is_empty());
        assert_eq!(d.subtasks[2].depends_on, ["a", "b"]);
        assert_eq!(d.subtasks[3].depends_on, ["a", "b", "c"]);
        assert_eq!(d.waves(), vec![vec!["a", "b"], vec!["c"], vec!["d"]]);
        for bad in ["0", "x", "", "-1", "1.5"] {
            let text = format!(
                "| Sub-task | Wave | Peak context | Scope |\n|--|--|--|--|\n| a | {bad} | 4 | x |\n"
            );
            assert_eq!(
                err(&text),
                format!(
                    "line 3: wave '{bad}' is not a whole number of 1 or more: write 1 for the first wave, 2 for the next, …"
                )
            );
        }
    }

    #[test]
    fn the_documented_example_parses_as_documented() {
        let doc = include_str!("../../../docs/decomposition.md");
        let start = doc
            .find("```markdown\n# DECOMPOSITION")
            .expect("the example")
            + 12;
        let example = &doc[start..start + doc[start..].find("```").expect("its end")];
        let d = parse_decomposition(example).expect("the documented example parses");
        assert_eq!(
            d.waves(),
            vec![
                vec!["auth-core", "user-store"],
                vec!["auth-gateway"],
                vec!["docs"]
            ]
        );
        let gateway = d.get("auth-gateway").expect("listed");
        assert_eq!(gateway.line, 11, "PARENT_SPEC.md's example says line 11");
        assert_eq!(gateway.depends_on, ["auth-core", "user-store"]);
        assert_eq!(
            d.get("user-store").expect("listed").peak_context_tokens,
            8_000
        );
    }

    #[test]
    fn diamond_dependencies_make_three_waves() {
        let text = format!(
            "{HEAD}| top | - | 1 | s |\n| left | top | 1 | s |\n| right | top | 1 | s |\n| bottom | left, right | 1 | s |\n| side | - | 1 | s |\n"
        );
        let d = parse_decomposition(&text).expect("parses");
        assert_eq!(
            d.waves(),
            vec![vec!["top", "side"], vec!["left", "right"], vec!["bottom"]]
        );
        assert_eq!(d.wave_of("bottom"), Some(3));
        assert_eq!(d.wave_of("side"), Some(1));
    }

    #[test]
    fn malformed_row_is_refused_with_its_line() {
        let text = format!("# D\n\n{HEAD}| a | - | 1 | s |\n| b | a | 1 |\n");
        assert_eq!(
            err(&text),
            "line 6: the row has 3 cells but the header has 4: write one cell per column (a '|' inside a cell is written '\\|')"
        );
        let e = parse_decomposition(&text).expect_err("bad");
        assert_eq!(e.line(), Some(6));
    }

    #[test]
    fn unknown_dependency_is_named_with_its_row() {
        let text = format!("{HEAD}| a | - | 1 | s |\n| b | a, Ghost task | 1 | s |\n");
        assert_eq!(
            err(&text),
            "line 4: sub-task 'b' depends on 'ghost-task', which is not in the table: name a sub-task of this table, or write '-' for none"
        );
    }

    #[test]
    fn duplicate_names_give_both_lines() {
        let text = format!(
            "{HEAD}| Auth gateway | - | 1 | s |\n| b | - | 1 | s |\n| auth-gateway | - | 1 | s |\n"
        );
        assert_eq!(
            err(&text),
            "lines 3 and 5: sub-task 'auth-gateway' is listed twice: give each sub-task its own name (names are compared in kebab-case)"
        );
    }

    #[test]
    fn cycle_is_named_in_dependency_order() {
        let text = format!(
            "{HEAD}| root | - | 1 | s |\n| a | root, c | 1 | s |\n| b | a | 1 | s |\n| c | b | 1 | s |\n| d | c | 1 | s |\n"
        );
        assert_eq!(
            err(&text),
            "lines 4, 6, 5: the dependencies form a cycle a -> c -> b -> a (each depends on the next): remove one of these dependencies"
        );
    }

    #[test]
    fn self_dependency_is_refused() {
        let text = format!("{HEAD}| a | - | 1 | s |\n| b | a, B | 1 | s |\n");
        assert_eq!(
            err(&text),
            "line 4: sub-task 'b' depends on itself: remove it from its own 'depends on'"
        );
    }

    #[test]
    fn no_table_says_which_columns_with_an_example() {
        for text in [
            "",
            "# Decomposition\n\nSplit it in two.\n",
            "| test | checks |\n| --- | --- |\n| a | b |\n",
            "| sub-task | depends on |\n",
        ] {
            let e = err(text);
            assert!(e.starts_with("DECOMPOSITION.md has no sub-task table: add a markdown table whose header has the columns 'sub-task', 'depends on' (or 'wave'), 'estimated peak context (k tokens)' and 'scope / acceptance'"), "{e}");
            assert!(e.contains("| auth-api | auth-core | 8 |"), "{e}");
            assert!(!e.contains('\n'), "one line");
        }
        assert_eq!(
            err("x\n| Sub-task | Depends on | Notes |\n|-|-|-|\n| a | - | n |\n"),
            "line 2: the sub-task table has no 'estimated peak context (k tokens)' or 'scope / acceptance' column: the header needs 'sub-task', 'depends on' (or 'wave'), 'estimated peak context (k tokens)' and 'scope / acceptance'"
        );
        assert_eq!(
            err(HEAD),
            "line 1: the sub-task table has no rows: add one row per sub-task"
        );
    }

    #[test]
    fn names_that_cannot_be_task_names_are_refused() {
        let long = "a".repeat(65);
        let shown_long = excerpt(&long);
        for (cell, shown) in [
            ("Café", "Café"),
            ("!!!", "!!!"),
            (long.as_str(), shown_long.as_str()),
        ] {
            let text = format!("{HEAD}| {cell} | - | 1 | s |\n");
            assert_eq!(
                err(&text),
                format!(
                    "line 3: '{shown}' cannot be made a task name: use ASCII letters, digits and spaces or hyphens, at most 64 characters in kebab-case, e.g. 'Auth gateway' or 'auth-gateway'"
                )
            );
        }
        let text = format!("{HEAD}| ** ** | - | 1 | s |\n");
        assert_eq!(
            err(&text),
            "line 3: the sub-task name is empty: name every sub-task, e.g. 'auth-gateway'"
        );
        let text = format!("{HEAD}| a | - | 1 |   |\n");
        assert!(err(&text).starts_with("line 3: sub-task 'a' has no scope"));
        let ok = "a".repeat(64);
        assert!(parse_decomposition(&format!("{HEAD}| {ok} | - | 1 | s |\n")).is_ok());
    }

    #[test]
    fn more_than_200_subtasks_are_refused() {
        let rows = |n: usize| -> String {
            let mut t = HEAD.to_string();
            for i in 0..n {
                t.push_str(&format!("| s{i} | - | 1 | s |\n"));
            }
            t
        };
        assert_eq!(
            parse_decomposition(&rows(200)).expect("200").subtasks.len(),
            200
        );
        assert_eq!(
            err(&rows(201)),
            "the table lists 201 sub-tasks, more than the limit of 200: group them into fewer, larger sub-tasks (each may decompose further)"
        );
    }

    #[test]
    fn check_decomposition_reports_every_row_error_in_line_order() {
        let text = format!(
            "{HEAD}| a | - | x | s |\n| ok | - | 1 | s |\n| b | ghost | 1 | s |\n| c | - | 1 |\n| a | - | 1 | s |\n"
        );
        let errors = check_decomposition(&text).expect_err("bad");
        let lines: Vec<Option<usize>> = errors.iter().map(DecompositionError::line).collect();
        assert_eq!(lines, [Some(3), Some(5), Some(6)], "{errors:?}");
        assert!(matches!(errors[0], DecompositionError::Estimate { .. }));
        assert!(matches!(
            errors[1],
            DecompositionError::UnknownDependency { .. }
        ));
        assert!(matches!(errors[2], DecompositionError::Cells { .. }));
        // The invalid first 'a' was not kept, so the second is not a duplicate.
        assert_eq!(parse_decomposition(&text).expect_err("bad"), errors[0]);
    }

    /// A random DAG: sub-task i depends on some of 0..i; names written naturally or in
    /// kebab-case, estimates in several spellings.
    /// name, dependencies, tokens, scope
    type Row = (String, Vec<String>, u64, String);

    fn random_table(rng: &mut Rng) -> (String, Vec<Row>) {
        let n = 1 + rng.below(30);
        let mut want = Vec::new();
        let mut text = String::from("# Plan\n\nProse | with a pipe.\n\n");
        text.push_str("| Sub-task | Depends on | Estimated peak context (k tokens) | Scope / acceptance |\n| --- | --- | --- | --- |\n");
        for i in 0..n {
            let kebab_name = format!("part-{i}-x{}", rng.below(1000));
            let written = match rng.below(3) {
                0 => kebab_name.clone(),
                1 => format!("Part {}", &kebab_name[5..].replace('-', " ")),
                _ => format!("**{kebab_name}**"),
            };
            let mut deps: Vec<String> = Vec::new();
            for (j, (d, _, _, _)) in want.iter().enumerate() {
                if rng.below(4) == 0 && j < i {
                    deps.push(String::clone(d));
                }
            }
            let k = 1 + rng.below(999) as u64;
            let (cell, tokens) = match rng.below(3) {
                0 => (format!("{k}"), k * 1000),
                1 => (format!("{k}k"), k * 1000),
                _ => (format!("{}", k * 1000 + 1000), k * 1000 + 1000),
            };
            let dep_cell = if deps.is_empty() {
                (*rng.pick(&["-", "none", "", "—"])).to_string()
            } else {
                deps.join(", ")
            };
            let scope = format!("scope {i}: do {}", rng.below(100));
            text.push_str(&format!("| {written} | {dep_cell} | {cell} | {scope} |\n"));
            want.push((kebab_name, deps, tokens, scope));
        }
        text.push_str("\nMore prose.\n");
        (text, want)
    }

    #[test]
    fn random_dag_tables_parse_back_and_waves_respect_dependencies() {
        for seed in 0..500u64 {
            let mut rng = Rng::new(0xDEC0_0000 ^ seed);
            let (text, want) = random_table(&mut rng);
            let d =
                parse_decomposition(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{text}"));
            let got: Vec<Row> = d
                .subtasks
                .iter()
                .map(|s| {
                    (
                        s.name.clone(),
                        s.depends_on.clone(),
                        s.peak_context_tokens,
                        s.scope.clone(),
                    )
                })
                .collect();
            assert_eq!(got, want, "seed {seed}\n{text}");
            let waves = d.waves();
            assert_eq!(waves.iter().map(Vec::len).sum::<usize>(), want.len());
            let wave_of: HashMap<&str, usize> = waves
                .iter()
                .enumerate()
                .flat_map(|(i, w)| w.iter().map(move |n| (n.as_str(), i + 1)))
                .collect();
            for s in d.subtasks.iter().step_by(7) {
                assert_eq!(d.wave_of(&s.name), wave_of.get(s.name.as_str()).copied());
            }
            for s in &d.subtasks {
                let w = wave_of[s.name.as_str()];
                for dep in &s.depends_on {
                    assert!(
                        wave_of[dep.as_str()] < w,
                        "seed {seed}: {dep} before {}",
                        s.name
                    );
                }
                // Not later than needed: wave 1, or one after its latest dependency.
                let need = s
                    .depends_on
                    .iter()
                    .map(|d2| wave_of[d2.as_str()])
                    .max()
                    .unwrap_or(0)
                    + 1;
                assert_eq!(w, need, "seed {seed}: {}", s.name);
            }
        }
    }

    #[test]
    fn fuzz_decomposition_never_panics() {
        let mut rng = Rng::new(7);
        let tables: Vec<String> = (0..8).map(|_| random_table(&mut rng).0).collect();
        let mut seeds: Vec<&str> = tables.iter().map(String::as_str).collect();
        seeds.push(SCRIPTED);
        let words = [
            "|",
            "| --- |",
            "\\|",
            "—",
            "k",
            "wave",
            "depends on",
            "a, b",
            "1000000000000",
        ];
        assert_no_panics(run(
            "decomposition",
            iterations(2_000),
            &seeds,
            &words,
            |b| {
                let text = String::from_utf8_lossy(b);
                let _ = check_decomposition(&text);
                let Ok(d) = parse_decomposition(&text) else {
                    return false;
                };
                let placed: usize = d.waves().iter().map(Vec::len).sum();
                assert_eq!(
                    placed,
                    d.subtasks.len(),
                    "a parsed decomposition has no cycle"
                );
                for s in &d.subtasks {
                    assert!(s.name.parse::<crate::TaskName>().is_ok());
                }
                true
            },
        ));
    }
}
