//! The documents stay true to the code they describe.
//!
//! - docs/flags.md holds `lb run --help` verbatim (between its `lb-run-help` markers), so the
//!   flag reference cannot drift from the binary. `LB_BLESS=1 cargo test -p lb-tests --test docs`
//!   rewrites the block from the built `lb` (`cargo build --bins` first); review the diff.
//!   Its table has one row per flag of that help, no more, no fewer.
//! - Every relative link of README.md, docs/ and deploy/ names a file that exists, and a
//!   `#fragment` into a Markdown file names one of its headings (GitHub's anchors).
use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use lb_tests::bins::LB;

const BEGIN: &str = "<!-- lb-run-help:begin -->";
const END: &str = "<!-- lb-run-help:end -->";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `lb run --help` as the reference shows it: without the environment's values (clap prints
/// `[env: KUBECONFIG=…]` with whatever is set) and without trailing blanks.
fn run_help() -> String {
    let out = Command::new(LB)
        .args(["run", "--help"])
        .env_remove("KUBECONFIG")
        .output()
        .expect("running lb run --help");
    assert!(out.status.success(), "lb run --help failed: {out:?}");
    let text = String::from_utf8(out.stdout).expect("help is UTF-8");
    let mut s = String::new();
    for line in text.lines() {
        s.push_str(line.trim_end());
        s.push('\n');
    }
    s
}

#[test]
fn flag_reference_matches_lb_run_help() {
    let path = root().join("docs/flags.md");
    let doc = fs::read_to_string(&path).expect("docs/flags.md");
    let (Some(b), Some(e)) = (doc.find(BEGIN), doc.find(END)) else {
        panic!("docs/flags.md has no {BEGIN} … {END} markers");
    };
    let want = format!("{BEGIN}\n```text\n{}```\n", run_help());
    let have = &doc[b..e];
    if std::env::var_os("LB_BLESS").is_some() {
        fs::write(&path, format!("{}{want}{}", &doc[..b], &doc[e..])).unwrap();
        return;
    }
    assert!(
        have == want,
        "docs/flags.md's `lb run --help` block differs from the binary's (LB_BLESS=1 to \
         accept):\n--- docs/flags.md\n{have}\n+++ lb run --help\n{want}"
    );
}

/// The long flags `--name` a text names at the start of a line (help) or of a table row.
fn flags(lines: impl Iterator<Item = String>) -> BTreeSet<String> {
    lines
        .filter_map(|l| {
            let l = l.trim_start_matches(['|', ' ', '`']);
            // `-x, --name`: the short form goes.
            let l = match l.strip_prefix('-') {
                Some(r) if !r.starts_with('-') => r.split_once(", ").map_or(l, |(_, r)| r),
                _ => l,
            };
            let name: String = l
                .strip_prefix("--")?
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            (!name.is_empty() && name != "help").then(|| format!("--{name}"))
        })
        .collect()
}

#[test]
fn flag_table_has_a_row_per_flag() {
    let doc = fs::read_to_string(root().join("docs/flags.md")).expect("docs/flags.md");
    let table = doc[..doc.find(BEGIN).expect("markers")]
        .lines()
        .filter(|l| l.starts_with("| `--"))
        .map(String::from);
    let help = run_help();
    let help = help
        .lines()
        .filter(|l| l.starts_with("  "))
        .map(String::from);
    let (table, help) = (flags(table), flags(help));
    assert!(
        help.len() > 20,
        "too few flags parsed from lb run --help: {help:?}"
    );
    let missing: Vec<_> = help.difference(&table).collect();
    let extra: Vec<_> = table.difference(&help).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "docs/flags.md's table: no row for {missing:?}; rows for flags lb run lacks: {extra:?}"
    );
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks; repeats get `-1`, `-2`, …).
fn anchors(md: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fence = false;
    for line in md.lines() {
        if line.starts_with("```") {
            fence = !fence;
            continue;
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if fence || hashes == 0 || line.chars().nth(hashes) != Some(' ') {
            continue;
        }
        let base = slug(&line[hashes..]);
        let mut a = base.clone();
        let mut n = 0;
        while out.contains(&a) {
            n += 1;
            a = format!("{base}-{n}");
        }
        out.insert(a);
    }
    out
}

/// The targets of the inline links `[text](target)` of `md`, outside code blocks and spans.
fn links(md: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fence = false;
    for line in md.lines() {
        if line.starts_with("```") {
            fence = !fence;
            continue;
        }
        if fence {
            continue;
        }
        // Drop code spans, which may hold `](` of their own.
        let mut text = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                text.push_str(part);
            }
        }
        let mut rest = text.as_str();
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            let end = rest.find([')', ' ']).unwrap_or(rest.len());
            out.push(rest[..end].to_string());
            rest = &rest[end..];
        }
    }
    out
}

#[test]
fn doc_links_resolve() {
    let root = root();
    let mut files = vec![root.join("README.md")];
    for dir in ["docs", "deploy"] {
        for e in fs::read_dir(root.join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "md") {
                files.push(p);
            }
        }
    }
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let md = fs::read_to_string(file).unwrap();
        for target in links(&md) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, fragment) = target.split_once('#').unwrap_or((&target, ""));
            let dest = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            let name = file.strip_prefix(&root).unwrap().display().to_string();
            if !dest.exists() {
                broken.push(format!("{name}: {target}: no such file"));
                continue;
            }
            if !fragment.is_empty() && dest.extension().is_some_and(|x| x == "md") {
                let doc = fs::read_to_string(&dest).unwrap();
                if !anchors(&doc).contains(fragment) {
                    broken.push(format!("{name}: {target}: no such heading"));
                }
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} links found: the link parser is broken"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn slugs_are_githubs() {
    assert_eq!(
        slug("North-south: NodePort, LoadBalancer, external IPs, XDP"),
        "north-south-nodeport-loadbalancer-external-ips-xdp"
    );
    assert_eq!(
        slug("Where does a packet go? `lb trace`"),
        "where-does-a-packet-go-lb-trace"
    );
    assert_eq!(slug("Known limits (for now)"), "known-limits-for-now");
    let a = anchors("# A\n```\n# not a heading\n```\n## A\n");
    assert_eq!(a, BTreeSet::from(["a".to_string(), "a-1".into()]));
    assert_eq!(
        links("see [x](a.md#b) and `[y](not.md)` and [z](c/)"),
        ["a.md#b", "c/"]
    );
}
