//! A small markdown-to-HTML renderer for artifacts, which are untrusted text: everything is
//! escaped, and only the tags this module writes itself reach the page. It knows ATX
//! headings, paragraphs, `-`/`*`/`+` and `1.` lists, `>` quotes, `---` rules, fenced code,
//! `|` tables, inline code, `**bold**`, `*italic*`/`_italic_` and `[links](https://…)` (http
//! and https only, `rel="noopener noreferrer"`); anything else is shown as the text it is.

/// Escapes text for HTML content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + s.len() / 8);
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Which block is open while lines are read.
enum Block {
    None,
    Paragraph(Vec<String>),
    List {
        ordered: bool,
        items: Vec<String>,
    },
    Quote(Vec<String>),
    /// Lines starting with `|`: a table when its second line is a delimiter row.
    Table(Vec<String>),
}

/// Renders `src` as HTML; every character of it is escaped.
pub fn to_html(src: &str) -> String {
    let mut out = String::new();
    let mut block = Block::None;
    let mut fence: Option<(String, Vec<&str>)> = None;
    for line in src.lines() {
        if let Some((marker, body)) = fence.as_mut() {
            if line.trim_start().starts_with(marker.as_str()) {
                out.push_str("<pre><code>");
                out.push_str(&escape(&body.join("\n")));
                out.push_str("</code></pre>\n");
                fence = None;
            } else {
                body.push(line);
            }
            continue;
        }
        let trimmed = line.trim_start();
        if let Some(marker) = fence_marker(trimmed) {
            flush(&mut out, &mut block);
            fence = Some((marker, Vec::new()));
            continue;
        }
        if trimmed.is_empty() {
            flush(&mut out, &mut block);
            continue;
        }
        if let Some((level, text)) = heading(trimmed) {
            flush(&mut out, &mut block);
            out.push_str(&format!("<h{level}>{}</h{level}>\n", inline(text)));
            continue;
        }
        if is_rule(trimmed) {
            flush(&mut out, &mut block);
            out.push_str("<hr>\n");
            continue;
        }
        if let Some((ordered, text)) = list_item(trimmed) {
            match &mut block {
                Block::List { ordered: o, items } if *o == ordered => items.push(text.to_string()),
                _ => {
                    flush(&mut out, &mut block);
                    block = Block::List {
                        ordered,
                        items: vec![text.to_string()],
                    };
                }
            }
            continue;
        }
        if trimmed.starts_with('|') {
            match &mut block {
                Block::Table(lines) => lines.push(trimmed.to_string()),
                _ => {
                    flush(&mut out, &mut block);
                    block = Block::Table(vec![trimmed.to_string()]);
                }
            }
            continue;
        }
        if let Some(text) = trimmed.strip_prefix('>') {
            let text = text.strip_prefix(' ').unwrap_or(text).to_string();
            match &mut block {
                Block::Quote(lines) => lines.push(text),
                _ => {
                    flush(&mut out, &mut block);
                    block = Block::Quote(vec![text]);
                }
            }
            continue;
        }
        match &mut block {
            Block::Paragraph(lines) => lines.push(trimmed.to_string()),
            // A line under a list item continues it.
            Block::List { items, .. } if line.starts_with(' ') => {
                if let Some(last) = items.last_mut() {
                    last.push(' ');
                    last.push_str(trimmed);
                }
            }
            _ => {
                flush(&mut out, &mut block);
                block = Block::Paragraph(vec![trimmed.to_string()]);
            }
        }
    }
    if let Some((_, body)) = fence {
        // An unclosed fence runs to the end, as CommonMark has it.
        out.push_str("<pre><code>");
        out.push_str(&escape(&body.join("\n")));
        out.push_str("</code></pre>\n");
    }
    flush(&mut out, &mut block);
    out
}

/// Writes the open block out and closes it.
fn flush(out: &mut String, block: &mut Block) {
    match std::mem::replace(block, Block::None) {
        Block::None => {}
        Block::Paragraph(lines) => {
            out.push_str(&format!("<p>{}</p>\n", inline(&lines.join(" "))));
        }
        Block::List { ordered, items } => {
            let tag = if ordered { "ol" } else { "ul" };
            out.push_str(&format!("<{tag}>\n"));
            for item in items {
                out.push_str(&format!("<li>{}</li>\n", inline(&item)));
            }
            out.push_str(&format!("</{tag}>\n"));
        }
        Block::Quote(lines) => {
            out.push_str(&format!(
                "<blockquote><p>{}</p></blockquote>\n",
                inline(&lines.join(" "))
            ));
        }
        Block::Table(lines) => table(out, &lines),
    }
}

/// The cells of a `| a | b |` row (the outer pipes optional).
fn cells(row: &str) -> Vec<&str> {
    let row = row.trim();
    let row = row.strip_prefix('|').unwrap_or(row);
    let row = row.strip_suffix('|').unwrap_or(row);
    row.split('|').map(str::trim).collect()
}

/// `| --- | :---: |`: the row under a table's header.
fn is_delimiter_row(row: &str) -> bool {
    let c = cells(row);
    !c.is_empty()
        && c.iter().all(|cell| {
            let inner = cell.trim_start_matches(':').trim_end_matches(':');
            !inner.is_empty() && inner.chars().all(|ch| ch == '-')
        })
}

/// A table (header, delimiter row, body rows); lines that are no table stay a paragraph.
fn table(out: &mut String, lines: &[String]) {
    if lines.len() < 2 || !is_delimiter_row(&lines[1]) {
        out.push_str(&format!("<p>{}</p>\n", inline(&lines.join(" "))));
        return;
    }
    let row = |tag: &str, line: &str| -> String {
        let cols: String = cells(line)
            .iter()
            .map(|c| format!("<{tag}>{}</{tag}>", inline(c)))
            .collect();
        format!("<tr>{cols}</tr>")
    };
    out.push_str("<table><thead>");
    out.push_str(&row("th", &lines[0]));
    out.push_str("</thead><tbody>");
    for line in &lines[2..] {
        out.push_str(&row("td", line));
    }
    out.push_str("</tbody></table>\n");
}

/// "```" or "~~~" (three or more) opening a fence: the marker that closes it.
fn fence_marker(line: &str) -> Option<String> {
    for c in ['`', '~'] {
        let n = line.chars().take_while(|x| *x == c).count();
        if n >= 3 {
            return Some(std::iter::repeat_n(c, n).collect());
        }
    }
    None
}

/// `# text` … `###### text`.
fn heading(line: &str) -> Option<(usize, &str)> {
    let level = line.chars().take_while(|c| *c == '#').count();
    if !(1..=6).contains(&level) {
        return None;
    }
    let rest = &line[level..];
    if rest.is_empty() {
        return Some((level, ""));
    }
    let text = rest.strip_prefix(' ')?;
    Some((level, text.trim().trim_end_matches('#').trim_end()))
}

/// `---`, `***` or `___`, three or more.
fn is_rule(line: &str) -> bool {
    let l: String = line.chars().filter(|c| !c.is_whitespace()).collect();
    l.len() >= 3 && ['-', '*', '_'].iter().any(|m| l.chars().all(|c| c == *m))
}

/// `- item`, `* item`, `+ item` or `12. item`.
fn list_item(line: &str) -> Option<(bool, &str)> {
    for m in ["- ", "* ", "+ "] {
        if let Some(rest) = line.strip_prefix(m) {
            return Some((false, rest));
        }
    }
    let digits = line.chars().take_while(|c| c.is_ascii_digit()).count();
    if digits > 0 && digits <= 9 {
        let rest = &line[digits..];
        if let Some(text) = rest.strip_prefix(". ").or_else(|| rest.strip_prefix(") ")) {
            return Some((true, text));
        }
    }
    None
}

/// Inline markup of one block's text, escaped.
fn inline(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        let rest = &s[i..];
        if let Some((html, used)) = code_span(rest)
            .or_else(|| emphasis(rest, "**", "strong"))
            .or_else(|| emphasis(rest, "__", "strong"))
            .or_else(|| single_emphasis(s, i))
            .or_else(|| link(rest))
        {
            out.push_str(&html);
            i += used;
            continue;
        }
        let Some(c) = rest.chars().next() else {
            break;
        };
        out.push_str(&escape(c.encode_utf8(&mut [0; 4])));
        i += c.len_utf8();
    }
    out
}

/// `` `code` `` at the start of `s`: its HTML and the bytes it used.
fn code_span(s: &str) -> Option<(String, usize)> {
    let ticks = s.chars().take_while(|c| *c == '`').count();
    if ticks == 0 {
        return None;
    }
    let marker = &s[..ticks];
    let body = &s[ticks..];
    let end = body.find(marker)?;
    let code = body[..end].trim();
    Some((format!("<code>{}</code>", escape(code)), ticks * 2 + end))
}

/// `**text**` (or `__text__`) at the start of `s`.
fn emphasis(s: &str, marker: &str, tag: &str) -> Option<(String, usize)> {
    let body = s.strip_prefix(marker)?;
    if body.starts_with(' ') {
        return None;
    }
    let end = body.find(marker)?;
    if end == 0 {
        return None;
    }
    Some((
        format!("<{tag}>{}</{tag}>", inline(&body[..end])),
        marker.len() * 2 + end,
    ))
}

/// `*text*` or `_text_` at byte `i` of `s`; `_` only at a word's start (not `snake_case`).
fn single_emphasis(s: &str, i: usize) -> Option<(String, usize)> {
    let rest = &s[i..];
    let m = rest.chars().next()?;
    if m != '*' && m != '_' {
        return None;
    }
    if m == '_'
        && s[..i]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric())
    {
        return None;
    }
    let body = &rest[1..];
    if body.starts_with(' ') || body.starts_with(m) {
        return None;
    }
    let end = body.find(m)?;
    if end == 0 || body[..end].ends_with(' ') {
        return None;
    }
    if m == '_'
        && body[end + 1..]
            .chars()
            .next()
            .is_some_and(|c| c.is_alphanumeric())
    {
        return None;
    }
    Some((format!("<em>{}</em>", inline(&body[..end])), end + 2))
}

/// `[text](url)` at the start of `s`: a link when `url` is http(s), else `None` (the text is
/// then shown as written).
fn link(s: &str) -> Option<(String, usize)> {
    let body = s.strip_prefix('[')?;
    let close = body.find("](")?;
    let text = &body[..close];
    if text.contains('[') {
        return None;
    }
    let after = &body[close + 2..];
    let end = after.find(')')?;
    let url = after[..end].trim();
    let lower = url.to_ascii_lowercase();
    if !(lower.starts_with("https://") || lower.starts_with("http://"))
        || url.contains(char::is_whitespace)
    {
        return None;
    }
    Some((
        format!(
            "<a href=\"{}\" rel=\"noopener noreferrer\">{}</a>",
            escape(url),
            inline(text)
        ),
        1 + close + 2 + end + 1,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_everything() {
        let html = to_html("<script>alert('x')</script>\n\n# <b>hi</b>\n\n- <img src=x onerror=1>");
        assert!(!html.contains("<script"), "{html}");
        assert!(!html.contains("<b>"), "{html}");
        assert!(!html.contains("<img"), "{html}");
        assert!(
            html.contains("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"),
            "{html}"
        );
        assert!(html.contains("<h1>&lt;b&gt;hi&lt;/b&gt;</h1>"), "{html}");
    }

    #[test]
    fn tables_with_escaped_cells_and_pipes_that_are_no_table() {
        let html = to_html(
            "| sub-task | depends on | k |\n| --- | :---: | ---: |\n| cart | - | 8 |\n| <b>x</b> | `a` | 1 |\n\nafter",
        );
        assert_eq!(
            html,
            "<table><thead><tr><th>sub-task</th><th>depends on</th><th>k</th></tr></thead>\
             <tbody><tr><td>cart</td><td>-</td><td>8</td></tr>\
             <tr><td>&lt;b&gt;x&lt;/b&gt;</td><td><code>a</code></td><td>1</td></tr></tbody></table>\n\
             <p>after</p>\n"
        );
        // No delimiter row: the lines are a paragraph, escaped.
        assert_eq!(
            to_html("| a | <i> |\n| b |"),
            "<p>| a | &lt;i&gt; | | b |</p>\n"
        );
        assert_eq!(to_html("|"), "<p>|</p>\n");
    }

    #[test]
    fn blocks() {
        let html =
            to_html("# Title\n\nsome\ntext\n\n- a\n- b\n\n1. one\n2. two\n\n> quoted\n\n---\n");
        assert_eq!(
            html,
            "<h1>Title</h1>\n<p>some text</p>\n<ul>\n<li>a</li>\n<li>b</li>\n</ul>\n\
             <ol>\n<li>one</li>\n<li>two</li>\n</ol>\n<blockquote><p>quoted</p></blockquote>\n<hr>\n"
        );
    }

    #[test]
    fn fenced_code_is_literal() {
        let html = to_html("```rust\nlet a = \"<b>\" && **x**;\n```\nafter");
        assert_eq!(
            html,
            "<pre><code>let a = &quot;&lt;b&gt;&quot; &amp;&amp; **x**;</code></pre>\n<p>after</p>\n"
        );
        assert!(
            to_html("```\nunclosed <x>").contains("<pre><code>unclosed &lt;x&gt;</code></pre>")
        );
    }

    #[test]
    fn inline_markup() {
        assert_eq!(
            inline("a **bold** and *it* and _it_ and `<code>` and snake_case_name"),
            "a <strong>bold</strong> and <em>it</em> and <em>it</em> and <code>&lt;code&gt;</code> and snake_case_name"
        );
        assert_eq!(inline("2 * 3 * 4"), "2 * 3 * 4");
        assert_eq!(inline("**<i>**"), "<strong>&lt;i&gt;</strong>");
    }

    #[test]
    fn links_only_http() {
        assert_eq!(
            inline("[docs](https://example.com/a?b=1&c=\"2\")"),
            "<a href=\"https://example.com/a?b=1&amp;c=&quot;2&quot;\" rel=\"noopener noreferrer\">docs</a>"
        );
        assert_eq!(
            inline("[x](javascript:alert(1))"),
            "[x](javascript:alert(1))"
        );
        assert_eq!(inline("[x](data:text/html,hi)"), "[x](data:text/html,hi)");
        assert!(!inline("[<b>](http://a)").contains("<b>"));
    }

    #[test]
    fn odd_input_does_not_panic() {
        for s in [
            "*", "**", "`", "[", "[a](", "#", "######", "_a", "é*é*", "1.", "```",
        ] {
            let _ = to_html(s);
        }
    }
}
