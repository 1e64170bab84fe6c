//! lb-userspace's modules import only downwards: no import circles.
//!
//! The test reads every `.rs` file under lb-userspace/src, names each file's module
//! (`src/foo.rs` and `src/foo/mod.rs` are `foo`, `src/a/b.rs` is `a::b`, `src/lib.rs` is the
//! crate root, written `crate`; `src/main.rs` is another crate, the `lb` binary, and is left
//! out) and collects what each module imports:
//! - every path of every `use` item (`pub use`, `use … as …`, globs, `self` and nested,
//!   multi-line `{…}` groups), and
//! - every path written inline in code that starts with `crate::`, `super::` or `self::`, or
//!   with the name of one of the module's own child modules (`trace::run(…)` in `cli`).
//!
//! Comments, string and character literals are stripped first, so a path in a doc comment or
//! a message is not an import. `super` and `self` are resolved from where they are written:
//! inside an inline `mod tests { … }` of `a::b`, `super` is `a::b` itself. A path names the
//! longest module prefix it has (`crate::datapath::maps::read_counter` is `datapath::maps`; a
//! path that is no module below the root, such as `crate::Foo`, is the root).
//!
//! Edges: module A → module B when A's file imports from B (imports within one file are no
//! edge). A `mod` declaration is not an import, so a parent declaring a child is no edge; but a
//! parent that uses its child's items (`cli` running `trace::run`) has an edge to the child, and
//! a child that uses its parent's items (`use super::Args` in `cli::trace`) has an edge to the
//! parent (the file `mod.rs`). So an option type a parent and its child both use belongs in a
//! module below both.
//!
//! The test fails naming every circle: each strongly connected component of more than one
//! module, with one chain around it and where each import of the chain is written. A second
//! test does the same one level up, each module counted as its top-level module (`datapath`
//! for `datapath::maps`): folders, too, import only downwards.
//! `detector_finds_circles` proves, on a small synthetic crate, that the detector finds circles
//! (and ignores comments and strings), so the main test cannot pass vacuously.
//!
//! `lb_userspace_functions_are_short` holds every function to 80 lines unless a `// Long:`
//! comment above it says why; `long_function_reader_measures_and_reads_reasons` proves the
//! reader on a synthetic file.
use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    fs,
    path::{Path, PathBuf},
};

/// An import edge's evidence: the file and line where the import is written.
type Evidence = Vec<String>;

/// The module graph: every module, and for each, the modules it imports with evidence.
#[derive(Debug, Default)]
struct Graph {
    modules: BTreeSet<String>,
    edges: BTreeMap<String, BTreeMap<String, Evidence>>,
}

/// The module path of the file at `rel` (relative to src/); `None` for main.rs and non-.rs.
fn module_of(rel: &Path) -> Option<String> {
    let s = rel.to_str()?.strip_suffix(".rs")?;
    let mut parts: Vec<&str> = s.split('/').collect();
    match parts.as_slice() {
        ["lib"] => return Some("crate".into()),
        ["main"] => return None,
        _ => {}
    }
    if parts.last() == Some(&"mod") {
        parts.pop();
    }
    Some(parts.join("::"))
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
    /// A string, char or number literal (its content is dropped).
    Lit,
}

/// Tokens with their line numbers; comments, strings and chars are gone.
fn tokenize(src: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    let n = c.len();
    // Skips a quoted literal starting at the opening quote c[i]; returns the index after it.
    let skip_quoted = |mut i: usize, q: char, line: &mut usize| -> usize {
        i += 1;
        while i < n && c[i] != q {
            if c[i] == '\\' {
                i += 1;
            }
            if i < n && c[i] == '\n' {
                *line += 1;
            }
            i += 1;
        }
        i + 1
    };
    while i < n {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && c.get(i + 1) == Some(&'/') {
            while i < n && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            // Block comments nest.
            let mut depth = 0;
            while i < n {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = skip_quoted(i, '"', &mut line);
            out.push((Tok::Lit, line));
        } else if ch == '\'' {
            // A char literal ('x', '\n', '\u{1F600}') or a lifetime ('a).
            if c.get(i + 1) == Some(&'\\') || c.get(i + 2) == Some(&'\'') {
                i = skip_quoted(i, '\'', &mut line);
                out.push((Tok::Lit, line));
            } else {
                i += 1;
                while i < n && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < n && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let next = c.get(i).copied();
            if (word == "r" || word == "br") && matches!(next, Some('"' | '#')) {
                // A raw string r#"…"#, or a raw identifier r#ident.
                let mut hashes = 0;
                while c.get(i) == Some(&'#') {
                    hashes += 1;
                    i += 1;
                }
                if c.get(i) != Some(&'"') {
                    let start = i;
                    while i < n && (c[i].is_alphanumeric() || c[i] == '_') {
                        i += 1;
                    }
                    out.push((Tok::Ident(c[start..i].iter().collect()), line));
                    continue;
                }
                i += 1;
                loop {
                    if i >= n {
                        break;
                    }
                    if c[i] == '"' && (1..=hashes).all(|k| c.get(i + k) == Some(&'#')) {
                        i += 1 + hashes;
                        break;
                    }
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
                out.push((Tok::Lit, line));
            } else if (word == "b" || word == "c") && matches!(next, Some('"' | '\'')) {
                i = skip_quoted(i, next.unwrap(), &mut line);
                out.push((Tok::Lit, line));
            } else {
                out.push((Tok::Ident(word), line));
            }
        } else if ch.is_ascii_digit() {
            while i < n && (c[i].is_alphanumeric() || c[i] == '_' || c[i] == '.') {
                // `0..n`: a range, not a fraction.
                if c[i] == '.' && c.get(i + 1) == Some(&'.') {
                    break;
                }
                i += 1;
            }
            out.push((Tok::Lit, line));
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

/// Parses a use tree at `toks[*i]`, appending each full path (prefix included) to `out`.
/// A `self` in a group names the group's prefix; `as` renames are dropped.
fn use_tree(toks: &[(Tok, usize)], i: &mut usize, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let mut path = prefix.to_vec();
    let mut first = true;
    loop {
        match toks.get(*i).map(|t| &t.0) {
            Some(Tok::Path) => *i += 1, // `use ::std::…`, or between segments
            Some(Tok::Ident(w)) if w == "self" && first && !prefix.is_empty() => *i += 1,
            Some(Tok::Ident(w)) if w == "as" => {
                *i += 2;
                out.push(path);
                return;
            }
            Some(Tok::Ident(w)) => {
                path.push(w.clone());
                *i += 1;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    match toks.get(*i).map(|t| &t.0) {
                        Some(Tok::Punct('}')) | None => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *i += 1,
                        _ => use_tree(toks, i, &path, out),
                    }
                }
            }
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push(path);
                return;
            }
            _ => {
                out.push(path);
                return;
            }
        }
        first = false;
    }
}

/// The modules file `module` imports from its source, with the line of each import.
fn imports(module: &str, src: &str, modules: &BTreeSet<String>) -> Vec<(String, usize)> {
    let toks = tokenize(src);
    let file_ctx: Vec<String> = if module == "crate" {
        vec![]
    } else {
        module.split("::").map(String::from).collect()
    };
    let is_module = |segs: &[String]| {
        let name = if segs.is_empty() {
            "crate".to_string()
        } else {
            segs.join("::")
        };
        modules.contains(&name)
    };
    // Resolves a path written in context `ctx` to the longest module prefix it names.
    let resolve = |ctx: &[String], path: &[String]| -> Option<String> {
        let mut abs: Vec<String>;
        let mut rest = path;
        match path.first().map(String::as_str) {
            Some("crate") => {
                abs = vec![];
                rest = &path[1..];
            }
            Some("super") => {
                abs = ctx.to_vec();
                while rest.first().map(String::as_str) == Some("super") {
                    abs.pop()?;
                    rest = &rest[1..];
                }
            }
            Some("self") => {
                abs = ctx.to_vec();
                rest = &path[1..];
            }
            Some(first) if ctx == file_ctx.as_slice() => {
                // A child module of this file's module, named without a prefix.
                let mut child = ctx.to_vec();
                child.push(first.to_string());
                if !is_module(&child) {
                    return None;
                }
                abs = ctx.to_vec();
            }
            _ => return None,
        }
        abs.extend(rest.iter().cloned());
        while !abs.is_empty() && !is_module(&abs) {
            abs.pop();
        }
        Some(if abs.is_empty() {
            "crate".into()
        } else {
            abs.join("::")
        })
    };

    let mut out = Vec::new();
    // Inline modules: (name, the brace depth inside them).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < toks.len() {
        let ctx: Vec<String> = file_ctx
            .iter()
            .cloned()
            .chain(inline.iter().map(|(m, _)| m.clone()))
            .collect();
        let prev = if i == 0 { None } else { Some(&toks[i - 1].0) };
        match &toks[i].0 {
            Tok::Punct('{') => {
                depth += 1;
                i += 1;
            }
            Tok::Punct('}') => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            Tok::Ident(w) if w == "mod" => {
                if let (Some((Tok::Ident(name), _)), Some((Tok::Punct('{'), _))) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    inline.push((name.clone(), depth + 1));
                }
                i += 1;
            }
            Tok::Ident(w) if w == "use" && prev != Some(&Tok::Path) => {
                let line = toks[i].1;
                i += 1;
                let mut paths = Vec::new();
                use_tree(&toks, &mut i, &[], &mut paths);
                for p in paths {
                    if let Some(m) = resolve(&ctx, &p) {
                        out.push((m, line));
                    }
                }
            }
            Tok::Ident(w)
                if prev != Some(&Tok::Path)
                    && prev != Some(&Tok::Punct('.'))
                    && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Path) =>
            {
                let line = toks[i].1;
                let mut path = vec![w.clone()];
                let mut j = i + 1;
                while let (Some(Tok::Path), Some(Tok::Ident(seg))) =
                    (toks.get(j).map(|t| &t.0), toks.get(j + 1).map(|t| &t.0))
                {
                    path.push(seg.clone());
                    j += 2;
                }
                if let Some(m) = resolve(&ctx, &path) {
                    out.push((m, line));
                }
                i = j;
            }
            _ => i += 1,
        }
    }
    out
}

/// The graph of `files`: (path relative to src/, content).
fn graph(files: &[(PathBuf, String)]) -> Graph {
    let named: Vec<(String, &PathBuf, &String)> = files
        .iter()
        .filter_map(|(p, s)| Some((module_of(p)?, p, s)))
        .collect();
    let mut g = Graph {
        modules: named.iter().map(|(m, _, _)| m.clone()).collect(),
        ..Graph::default()
    };
    for (module, path, src) in &named {
        for (to, line) in imports(module, src, &g.modules) {
            if &to == module {
                continue;
            }
            let ev = g
                .edges
                .entry(module.clone())
                .or_default()
                .entry(to)
                .or_default();
            let at = format!("{}:{line}", path.display());
            if !ev.contains(&at) {
                ev.push(at);
            }
        }
    }
    g
}

/// Strongly connected components with more than one module (Tarjan), each sorted.
fn circles(g: &Graph) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for w in t.g.edges.get(v).into_iter().flat_map(|e| e.keys()) {
            let w = w.as_str();
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                scc.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort();
                t.out.push(scc);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for m in &g.modules {
        if !t.index.contains_key(m.as_str()) {
            visit(&mut t, m);
        }
    }
    t.out.sort();
    t.out
}

/// A shortest chain from `scc[0]` around and back to it, inside the component, with the
/// evidence of each step.
fn chain(g: &Graph, scc: &[String]) -> String {
    let start = &scc[0];
    let inside: BTreeSet<&String> = scc.iter().collect();
    let mut prev: BTreeMap<&String, &String> = BTreeMap::new();
    let mut queue = VecDeque::from([start]);
    let mut end = None;
    'bfs: while let Some(v) = queue.pop_front() {
        for w in g.edges.get(v).into_iter().flat_map(|e| e.keys()) {
            if !inside.contains(w) {
                continue;
            }
            if w == start {
                end = Some(v);
                break 'bfs;
            }
            if !prev.contains_key(w) {
                prev.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    let mut path = vec![start];
    let mut v = end.expect("a component has a cycle through each member");
    while v != start {
        path.push(v);
        v = prev[v];
    }
    path.push(start);
    path.reverse(); // start … end start: reversed from the back-walk
    let mut s = String::new();
    for w in path.windows(2) {
        let ev = &g.edges[w[0]][w[1]];
        s.push_str(&format!("    {} -> {}  ({})\n", w[0], w[1], ev.join(", ")));
    }
    s
}

/// Each circle: its modules, one chain around it, and every import inside it.
fn report(g: &Graph) -> Vec<String> {
    circles(g)
        .iter()
        .map(|scc| {
            let mut inside = String::new();
            for from in scc {
                for (to, ev) in &g.edges[from] {
                    if scc.contains(to) {
                        inside.push_str(&format!("    {from} -> {to}  ({})\n", ev.join(", ")));
                    }
                }
            }
            format!(
                "circle {{{}}}:\n  a chain around it:\n{}  all its imports:\n{inside}",
                scc.join(", "),
                chain(g, scc)
            )
        })
        .collect()
}

fn read_tree(root: &Path, dir: &Path, out: &mut Vec<(PathBuf, String)>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            read_tree(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(root).unwrap().to_path_buf();
            out.push((rel, fs::read_to_string(&path).unwrap()));
        }
    }
}

#[test]
fn lb_userspace_has_no_import_circles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../lb-userspace/src");
    let mut files = Vec::new();
    read_tree(&src, &src, &mut files);
    let g = graph(&files);
    assert!(
        g.modules.len() > 20,
        "lb-userspace/src: too few modules: {:?}",
        g.modules
    );
    assert!(
        g.edges.values().map(BTreeMap::len).sum::<usize>() > 30,
        "too few imports found: the detector is broken"
    );
    let found = report(&g);
    assert!(
        found.is_empty(),
        "{} import circle(s) in lb-userspace/src:\n{}",
        found.len(),
        found.join("\n")
    );
}

/// `g` with each module counted as its top-level module (imports inside one are dropped).
fn top_level(g: &Graph) -> Graph {
    let top = |m: &str| m.split("::").next().unwrap_or(m).to_string();
    let mut t = Graph {
        modules: g.modules.iter().map(|m| top(m)).collect(),
        ..Graph::default()
    };
    for (from, tos) in &g.edges {
        for (to, ev) in tos {
            if top(from) == top(to) {
                continue;
            }
            let e = t
                .edges
                .entry(top(from))
                .or_default()
                .entry(top(to))
                .or_default();
            e.extend(ev.iter().map(|at| format!("{from} -> {to} at {at}")));
        }
    }
    t
}

#[test]
fn lb_userspace_folders_have_no_import_circles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../lb-userspace/src");
    let mut files = Vec::new();
    read_tree(&src, &src, &mut files);
    let found = report(&top_level(&graph(&files)));
    assert!(
        found.is_empty(),
        "{} import circle(s) between lb-userspace's top-level modules:\n{}",
        found.len(),
        found.join("\n")
    );
}

fn synthetic(files: &[(&str, &str)]) -> Graph {
    let files: Vec<(PathBuf, String)> = files
        .iter()
        .map(|(p, s)| (PathBuf::from(p), s.to_string()))
        .collect();
    graph(&files)
}

#[test]
fn detector_finds_circles() {
    let g = synthetic(&[
        ("lib.rs", "pub mod a;\npub mod b;\npub mod d;\npub mod e;\n"),
        ("main.rs", "use crate::a::X; fn main() {}"),
        // a → b::c through a grouped, multi-line, nested use; a → d only in a comment.
        (
            "a.rs",
            "// use crate::d::Z;\n/* crate::d::W /* nested */ crate::d::V */\npub use crate::{\n    \
             b::{\n        c::{self, Y as Why},\n    },\n};\npub struct X;\n",
        ),
        ("b/mod.rs", "pub mod c;\n"),
        // b::c → a inline; strings, chars and lifetimes are no paths.
        (
            "b/c.rs",
            "pub struct Y;\nfn f<'a>(s: &'a str) -> char { let _ = \"crate::d::Q\"; \
             let _ = r#\"super::super::d\"#; let _ = crate::a::X; '\"' }\n\
             #[cfg(test)]\nmod tests {\n    use super::*;\n    use super::super::super::d;\n}\n",
        ),
        ("d.rs", "pub struct Z;\n"),
        // Parent and child: e runs f's items, f uses e's option type.
        (
            "e/mod.rs",
            "mod f;\npub struct Opt;\npub fn run() { f::go() }\n",
        ),
        ("e/f.rs", "use super::Opt;\npub fn go() {}\n"),
    ]);
    assert!(!g.modules.contains("main"), "main.rs is another crate");
    let edges = |m: &str| -> Vec<&str> {
        g.edges
            .get(m)
            .map(|e| e.keys().map(String::as_str).collect())
            .unwrap_or_default()
    };
    assert_eq!(edges("a"), ["b::c"]);
    // The test module's `super::super::super::d` is `crate::d`: an edge of b::c.
    assert_eq!(edges("b::c"), ["a", "d"]);
    assert_eq!(
        edges("b"),
        Vec::<&str>::new(),
        "`mod` declarations are no imports"
    );
    assert_eq!(edges("e"), ["e::f"]);
    assert_eq!(edges("e::f"), ["e"]);
    assert_eq!(
        circles(&g),
        [
            vec!["a".to_string(), "b::c".into()],
            vec!["e".into(), "e::f".into()]
        ]
    );
    // One level up, b::c is b: the circle is {a, b}.
    assert_eq!(circles(&top_level(&g))[0], ["a", "b"]);
    let r = report(&g);
    assert!(r[0].contains("a -> b::c  (a.rs:3)"), "{}", r[0]);
    assert!(r[0].contains("b::c -> a  (b/c.rs:2)"), "{}", r[0]);
}

/// Functions longer than this many lines (from the `fn` line to the closing brace) need a
/// reason: a comment line starting `// Long:` among the lines just above the `fn`.
const MAX_FN_LINES: usize = 80;

/// Every function with a body in `src`: (name, line of `fn`, lines from `fn` to its `}`).
fn functions(src: &str) -> Vec<(String, usize, usize)> {
    let toks = tokenize(src);
    let mut out = Vec::new();
    for (i, (t, line)) in toks.iter().enumerate() {
        let (Tok::Ident(kw), Some((Tok::Ident(name), _))) = (t, toks.get(i + 1)) else {
            continue;
        };
        if kw != "fn" {
            continue;
        }
        // The body is the first `{` before any `;` (a `;` first: a declaration, no body).
        let Some(open) = toks[i..]
            .iter()
            .position(|(t, _)| matches!(t, Tok::Punct('{' | ';')))
            .map(|p| i + p)
            .filter(|&p| toks[p].0 == Tok::Punct('{'))
        else {
            continue;
        };
        let mut depth = 0usize;
        for (t, end) in &toks[open..] {
            match t {
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => {
                    depth -= 1;
                    if depth == 0 {
                        out.push((name.clone(), *line, end - line + 1));
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// Whether the comment, doc and attribute lines right above line `at` (1-based) give a reason.
fn has_reason(src: &str, at: usize) -> bool {
    src.lines()
        .take(at - 1)
        .collect::<Vec<_>>()
        .iter()
        .rev()
        .map(|l| l.trim())
        .take_while(|l| l.starts_with("//") || l.starts_with("#[") || l.starts_with(')'))
        .any(|l| l.starts_with("// Long:"))
}

/// The functions of `files` over [`MAX_FN_LINES`] without a reason, as `path:line name (n lines)`.
fn long_functions(files: &[(PathBuf, String)]) -> Vec<String> {
    let mut long = Vec::new();
    for (path, src) in files {
        for (name, line, n) in functions(src) {
            if n > MAX_FN_LINES && !has_reason(src, line) {
                long.push(format!("{}:{line} {name} ({n} lines)", path.display()));
            }
        }
    }
    long.sort();
    long
}

#[test]
fn lb_userspace_functions_are_short() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../lb-userspace/src");
    let mut files = Vec::new();
    read_tree(&src, &src, &mut files);
    let all: usize = files.iter().map(|(_, s)| functions(s).len()).sum();
    assert!(
        all > 500,
        "only {all} functions found: the reader is broken"
    );
    let long = long_functions(&files);
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines in lb-userspace/src (split them, or say why in a \
         `// Long:` comment above the fn):\n{}",
        long.join("\n")
    );
}

#[test]
fn long_function_reader_measures_and_reads_reasons() {
    let body = |n: usize| "    let _ = 1;\n".repeat(n);
    let src = format!(
        "fn short() {{\n{}}}\n\
         trait T {{ fn decl(&self); }}\n\
         /// Docs.\n#[inline]\nfn long<'a>(s: &'a str) -> char {{\n    let _ = \"{{\";\n{}}}\n\
         // Long: one flat table.\nfn excused() {{\n{}}}\n",
        body(3),
        body(MAX_FN_LINES),
        body(MAX_FN_LINES)
    );
    let fns = functions(&src);
    let sizes: Vec<(&str, usize)> = fns.iter().map(|(n, _, l)| (n.as_str(), *l)).collect();
    assert_eq!(
        sizes,
        [
            ("short", 5),
            ("long", MAX_FN_LINES + 3),
            ("excused", MAX_FN_LINES + 2)
        ],
        "the string's brace and the bodiless declaration must not count"
    );
    let files = [(PathBuf::from("x.rs"), src)];
    assert_eq!(
        long_functions(&files),
        [format!("x.rs:9 long ({} lines)", MAX_FN_LINES + 3)]
    );
}
