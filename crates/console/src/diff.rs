//! A task's change (`TaskDetail.changes`) as a person reviewing it reads it: per file, its
//! hunks, added and removed lines marked. The diff is the agents' code, untrusted: every
//! character is escaped, control and bidirectional-formatting characters are shown as their
//! code points (a reviewer must see them, not have them reorder the text), and what is
//! shown is bounded in files, lines and bytes, with a note naming the branch that holds the
//! whole change.

use std::fmt::Write as _;

use automaton_proto::v1 as pb;

use crate::markdown::escape;

/// At most this many files are shown.
pub const FILES_SHOWN: usize = 100;
/// At most this many lines (headers, hunk lines) are shown, all files together.
pub const LINES_SHOWN: usize = 5_000;
/// At most this many bytes of the diff are shown, all files together.
pub const BYTES_SHOWN: usize = 512 * 1024;
/// A longer line shows its first this many characters and how much more it has.
pub const LINE_CHARS: usize = 1_000;

/// One file of a unified git diff.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct FileDiff<'a> {
    /// The path, as the `+++`/`---` lines (or the `diff --git` header) name it; a rename is
    /// `old → new`.
    pub name: String,
    /// The lines between the header and the first hunk (`index`, modes, `Binary files …`).
    pub meta: Vec<&'a str>,
    pub hunks: Vec<Hunk<'a>>,
    pub added: usize,
    pub removed: usize,
}

/// One hunk: its `@@ … @@` line and its lines, each with its `+`, `-`, ` ` or `\` first.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Hunk<'a> {
    pub header: &'a str,
    pub lines: Vec<&'a str>,
}

/// Splits a unified git diff into files and hunks. Lines before the first `diff --git`
/// header (none from git) are kept as a file without a name.
pub fn parse(diff: &str) -> Vec<FileDiff<'_>> {
    let mut files: Vec<FileDiff<'_>> = Vec::new();
    let mut renamed: (Option<&str>, Option<&str>) = (None, None);
    for line in diff.lines() {
        if let Some(rest) = line.strip_prefix("diff --git ") {
            renamed = (None, None);
            files.push(FileDiff {
                name: header_name(rest),
                ..FileDiff::default()
            });
            continue;
        }
        if files.is_empty() {
            files.push(FileDiff::default());
        }
        let file = files.last_mut().expect("a file was pushed above");
        if line.starts_with("@@") {
            file.hunks.push(Hunk {
                header: line,
                lines: Vec::new(),
            });
            continue;
        }
        // Within a hunk every line starts with its marker: `--- x` there is a removed line.
        if let Some(hunk) = file.hunks.last_mut() {
            match line.as_bytes().first() {
                Some(b'+') => file.added += 1,
                Some(b'-') => file.removed += 1,
                _ => {}
            }
            hunk.lines.push(line);
            continue;
        }
        if let Some(path) = line.strip_prefix("+++ b/") {
            file.name = path.to_string();
        } else if let Some(path) = line.strip_prefix("--- a/")
            && file.name.is_empty()
        {
            file.name = path.to_string();
        } else if let Some(from) = line.strip_prefix("rename from ") {
            renamed.0 = Some(from);
        } else if let Some(to) = line.strip_prefix("rename to ") {
            renamed.1 = Some(to);
        }
        if let (Some(from), Some(to)) = renamed {
            file.name = format!("{from} → {to}");
        }
        file.meta.push(line);
    }
    files
}

/// The path of `a/X b/X` (a `diff --git` header's rest); the whole rest when the two halves
/// differ (a rename: its `rename` lines name both) or it is quoted.
fn header_name(rest: &str) -> String {
    let half = rest.len().saturating_sub(1) / 2;
    if rest.len() % 2 == 1
        && rest.is_char_boundary(half)
        && rest.is_char_boundary(half + 1)
        && rest.as_bytes().get(half) == Some(&b' ')
    {
        let (a, b) = (&rest[..half], &rest[half + 1..]);
        if let (Some(a), Some(b)) = (a.strip_prefix("a/"), b.strip_prefix("b/"))
            && a == b
        {
            return a.to_string();
        }
    }
    rest.to_string()
}

/// A character a reviewer must see as what it is: a control character (TAB aside) or one
/// that changes the text's direction or hides (the "Trojan Source" characters).
fn hidden(c: char) -> bool {
    (c.is_control() && c != '\t')
        || matches!(
            c,
            '\u{061C}'
                | '\u{200B}'..='\u{200F}'
                | '\u{202A}'..='\u{202E}'
                | '\u{2060}'..='\u{2064}'
                | '\u{2066}'..='\u{2069}'
                | '\u{FEFF}'
        )
}

/// Escapes `s` for HTML text and shows each [`hidden`] character as its code point, at most
/// `max` characters of it (then how many bytes more).
pub fn escape_code(s: &str, max: usize) -> String {
    let mut out = String::with_capacity(s.len() + s.len() / 8);
    for (n, (i, c)) in s.char_indices().enumerate() {
        if n == max {
            let _ = write!(
                out,
                "<span class=\"more\">… {} more bytes</span>",
                s.len() - i
            );
            break;
        }
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if hidden(c) => {
                let _ = write!(out, "<span class=\"ctl\">U+{:04X}</span>", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out
}

/// The first 12 characters of a commit id.
pub fn short_commit(id: &str) -> &str {
    id.char_indices().nth(12).map_or(id, |(i, _)| &id[..i])
}

/// The branch a task's work is on, as the store names it: `automaton/NAME`, a sub-task's
/// `automaton/PARENT--SUB`.
pub fn task_branch(task: &str) -> String {
    match task.parse::<automaton_workflow::TaskName>() {
        Ok(t) => t.branch(),
        Err(_) => format!("automaton/{task}"),
    }
}

/// What is left to show, all files together.
struct Budget {
    files: usize,
    lines: usize,
    bytes: usize,
}

impl Budget {
    /// Takes one line of `len` bytes; false when it does not fit.
    fn line(&mut self, len: usize) -> bool {
        let len = len.min(LINE_CHARS * 4);
        if self.lines == 0 || self.bytes < len {
            return false;
        }
        self.lines -= 1;
        self.bytes -= len;
        true
    }
}

/// The `#change` section: base → head, the files changed (with their counts), then each
/// file's hunks; cut at [`FILES_SHOWN`], [`LINES_SHOWN`] and [`BYTES_SHOWN`], or where the
/// coordinator cut it, with a note naming `branch`, which holds the whole change.
pub fn render_change(changes: Option<&pb::TaskChanges>, branch: &str) -> String {
    let mut out = String::from("<section id=\"change\"><h2>Change</h2>");
    let Some(c) = changes else {
        out.push_str("<p class=\"empty\">no change to show: the task has no branch yet, or the project no git repository</p></section>");
        return out;
    };
    let _ = write!(
        out,
        "<p class=\"commits\"><code class=\"base\" title=\"{}\">{}</code> → <code class=\"head\" title=\"{}\">{}</code> on <code class=\"branch\">{}</code></p>",
        escape(&c.base_commit),
        escape(short_commit(&c.base_commit)),
        escape(&c.head_commit),
        escape(short_commit(&c.head_commit)),
        escape(branch),
    );
    if c.diff.trim().is_empty() {
        out.push_str(&if c.truncated {
            cut_note("the coordinator sent none of it", branch)
        } else {
            "<p class=\"empty\">no change: the branch holds nothing beyond its base</p>".into()
        });
        out.push_str("</section>");
        return out;
    }
    let files = parse(&c.diff);
    let mut left = Budget {
        files: FILES_SHOWN,
        lines: LINES_SHOWN,
        bytes: BYTES_SHOWN,
    };
    let mut shown = String::new();
    let mut rendered = 0;
    let mut cut = false;
    for (i, f) in files.iter().enumerate() {
        if left.files == 0 {
            cut = true;
            break;
        }
        left.files -= 1;
        rendered += 1;
        if !file(&mut shown, i, f, &mut left) {
            cut = true;
            break;
        }
    }
    // The list of files: a link to each one shown, the name of each one cut.
    out.push_str("<ul class=\"files\">");
    for (i, f) in files.iter().enumerate().take(FILES_SHOWN) {
        let name = escape_code(display_name(f), LINE_CHARS);
        let name = if i < rendered {
            format!("<a href=\"#file-{i}\">{name}</a>")
        } else {
            format!("<span class=\"cut-file\">{name}</span>")
        };
        let _ = write!(
            out,
            "<li>{name} <span class=\"added\">+{}</span> <span class=\"removed\">−{}</span></li>",
            f.added, f.removed,
        );
    }
    out.push_str("</ul>");
    out.push_str(&shown);
    if cut {
        let lines: usize = files
            .iter()
            .map(|f| f.meta.len() + f.hunks.iter().map(|h| h.lines.len() + 1).sum::<usize>())
            .sum();
        out.push_str(&cut_note(
            &format!(
                "{} files, {lines} lines, {} bytes; at most {FILES_SHOWN} files, {LINES_SHOWN} lines and {} KiB are shown",
                files.len(),
                c.diff.len(),
                BYTES_SHOWN / 1024
            ),
            branch,
        ));
    } else if c.truncated {
        out.push_str(&cut_note(
            "the coordinator sends at most 1 MiB of a change",
            branch,
        ));
    }
    out.push_str("</section>");
    out
}

fn display_name<'a>(f: &'a FileDiff<'_>) -> &'a str {
    if f.name.is_empty() {
        "(before the first file)"
    } else {
        &f.name
    }
}

fn cut_note(why: &str, branch: &str) -> String {
    format!(
        "<p class=\"cut\">cut: the whole change is on branch <code>{}</code> ({})</p>",
        escape(branch),
        escape(why)
    )
}

/// One file's article; false when the budget ran out inside it (what fit is shown).
fn file(out: &mut String, i: usize, f: &FileDiff<'_>, left: &mut Budget) -> bool {
    let _ = write!(
        out,
        "<article class=\"file\" id=\"file-{i}\" data-file=\"{}\"><h3 class=\"file-name\">{}</h3>",
        escape(&f.name.replace(hidden, "\u{FFFD}")),
        escape_code(display_name(f), LINE_CHARS),
    );
    let mut whole = true;
    if !f.meta.is_empty() {
        out.push_str("<pre class=\"meta\">");
        for m in &f.meta {
            if !left.line(m.len()) {
                whole = false;
                break;
            }
            let _ = write!(
                out,
                "<span class=\"line\">{}</span>",
                escape_code(m, LINE_CHARS)
            );
        }
        out.push_str("</pre>");
    }
    'hunks: for h in &f.hunks {
        if !whole || !left.line(h.header.len()) {
            whole = false;
            break;
        }
        let _ = write!(
            out,
            "<div class=\"hunk\"><pre class=\"hunk-header\">{}</pre><pre class=\"lines\">",
            escape_code(h.header, LINE_CHARS)
        );
        for l in &h.lines {
            if !left.line(l.len()) {
                whole = false;
                out.push_str("</pre></div>");
                break 'hunks;
            }
            let class = match l.as_bytes().first() {
                Some(b'+') => "line add",
                Some(b'-') => "line del",
                Some(b' ') => "line ctx",
                _ => "line note",
            };
            let _ = write!(
                out,
                "<span class=\"{class}\">{}</span>",
                escape_code(l, LINE_CHARS)
            );
        }
        out.push_str("</pre></div>");
    }
    out.push_str("</article>");
    whole
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIFF: &str = concat!(
        "diff --git a/src/lib.rs b/src/lib.rs\n",
        "index 1111111..2222222 100644\n",
        "--- a/src/lib.rs\n",
        "+++ b/src/lib.rs\n",
        "@@ -1,3 +1,3 @@\n",
        " fn a() {}\n",
        "--- old\n",
        "+++ new\n",
        "@@ -10,2 +10,3 @@ fn b()\n",
        " x\n",
        "+y\n",
        "\\ No newline at end of file\n",
        "diff --git a/old.md b/new.md\n",
        "similarity index 90%\n",
        "rename from old.md\n",
        "rename to new.md\n",
        "diff --git a/gone.txt b/gone.txt\n",
        "deleted file mode 100644\n",
        "--- a/gone.txt\n",
        "+++ /dev/null\n",
        "@@ -1 +0,0 @@\n",
        "-bye\n",
    );

    #[test]
    fn a_diff_splits_into_files_hunks_and_counts() {
        let files = parse(DIFF);
        assert_eq!(files.len(), 3);
        assert_eq!(files[0].name, "src/lib.rs");
        assert_eq!(files[0].hunks.len(), 2);
        // Inside a hunk, `--- old` is a removed line, not a file header.
        assert_eq!(
            files[0].hunks[0].lines,
            vec![" fn a() {}", "--- old", "+++ new"]
        );
        assert_eq!((files[0].added, files[0].removed), (2, 1));
        assert_eq!(files[1].name, "old.md → new.md");
        assert!(files[1].hunks.is_empty());
        assert_eq!(files[2].name, "gone.txt");
        assert_eq!(files[2].removed, 1);
        assert_eq!(header_name("a/x y b/x y"), "x y");
        assert_eq!(header_name("a/x b/y"), "a/x b/y");
    }

    #[test]
    fn control_and_bidi_characters_show_as_code_points() {
        let s = escape_code("a\u{1b}[31m\u{202E}<b>\tz\r", 100);
        assert_eq!(
            s,
            "a<span class=\"ctl\">U+001B</span>[31m<span class=\"ctl\">U+202E</span>&lt;b&gt;\tz<span class=\"ctl\">U+000D</span>"
        );
        assert_eq!(
            escape_code("abcdef", 3),
            "abc<span class=\"more\">… 3 more bytes</span>"
        );
    }

    #[test]
    fn the_change_renders_files_hunks_and_marked_lines() {
        let c = pb::TaskChanges {
            base_commit: "0123456789abcdef0123".into(),
            head_commit: "fedcba9876543210fedc".into(),
            diff: DIFF.into(),
            truncated: false,
        };
        let html = render_change(Some(&c), "automaton/shop");
        assert!(html.contains("<code class=\"base\" title=\"0123456789abcdef0123\">0123456789ab</code> → <code class=\"head\" title=\"fedcba9876543210fedc\">fedcba987654</code>"), "{html}");
        assert_eq!(html.matches("<article class=\"file\"").count(), 3);
        assert_eq!(html.matches("<div class=\"hunk\">").count(), 3);
        assert!(
            html.contains("<span class=\"line add\">+y</span>"),
            "{html}"
        );
        assert!(
            html.contains("<span class=\"line del\">-bye</span>"),
            "{html}"
        );
        assert!(
            html.contains("<span class=\"line del\">--- old</span>"),
            "{html}"
        );
        assert!(html.contains("<span class=\"line note\">\\ No newline at end of file</span>"));
        assert!(html.contains("<a href=\"#file-0\">src/lib.rs</a> <span class=\"added\">+2</span> <span class=\"removed\">−1</span>"), "{html}");
        assert!(!html.contains("class=\"cut\""), "{html}");
    }

    #[test]
    fn no_change_and_an_empty_change_say_so_in_one_line() {
        let none = render_change(None, "automaton/x");
        assert!(none.contains("no change to show"), "{none}");
        let empty = render_change(Some(&pb::TaskChanges::default()), "automaton/x");
        assert!(
            empty.contains("no change: the branch holds nothing beyond its base"),
            "{empty}"
        );
        assert!(!empty.contains("class=\"file\""));
    }

    #[test]
    fn a_huge_change_is_cut_with_a_note_naming_the_branch() {
        let mut diff = String::new();
        for f in 0..(FILES_SHOWN + 5) {
            let _ = write!(diff, "diff --git a/f{f} b/f{f}\n@@ -0,0 +1,100 @@\n");
            for l in 0..100 {
                let _ = writeln!(diff, "+line {l}");
            }
        }
        let c = pb::TaskChanges {
            diff,
            ..Default::default()
        };
        let html = render_change(Some(&c), "automaton/big");
        let shown = html.matches("class=\"line add\"").count();
        assert!(shown <= LINES_SHOWN, "{shown}");
        assert!(shown > LINES_SHOWN - 200, "{shown}");
        assert!(
            html.contains("the whole change is on branch <code>automaton/big</code>"),
            "{html}"
        );
        assert!(html.contains("105 files"), "{}", &html[html.len() - 400..]);
        // The coordinator's own cut gets the note too.
        let c = pb::TaskChanges {
            diff: "diff --git a/a b/a\n@@ -1 +1 @@\n+x\n".into(),
            truncated: true,
            ..Default::default()
        };
        let html = render_change(Some(&c), "automaton/big");
        assert!(
            html.contains("cut: the whole change is on branch <code>automaton/big</code> (the coordinator sends at most 1 MiB of a change)"),
            "{html}"
        );
    }

    #[test]
    fn branch_names_follow_the_store() {
        assert_eq!(task_branch("shop"), "automaton/shop");
        assert_eq!(task_branch("shop/api"), "automaton/shop--api");
        assert_eq!(short_commit("abc"), "abc");
    }
}
