//! The JUnit file `e2e.test --report-dir` writes (`junit_01.xml`, Ginkgo's reporter) and the
//! one table `cargo xtask e2e` prints: spec, each proxy's result, time.

use std::{collections::BTreeMap, fmt::Write as _};

use anyhow::{Context as _, Result};

#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Passed,
    /// Failed, panicked, timed out, interrupted or aborted: the status word.
    Failed(String),
    /// Skipped at run time (e2eskipper), with its reason.
    Skipped(String),
}

impl Outcome {
    fn cell(&self) -> String {
        match self {
            Self::Passed => "passed".to_owned(),
            Self::Failed(status) if status == "failed" => "**FAILED**".to_owned(),
            Self::Failed(status) => format!("**FAILED** ({status})"),
            Self::Skipped(_) => "skipped".to_owned(),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    /// The spec's full text, without Ginkgo's `[It] ` node-type prefix.
    pub name: String,
    pub outcome: Outcome,
    pub seconds: f64,
}

/// The specs that ran (or were skipped at run time) in a Ginkgo JUnit report. Specs the focus
/// and skip expressions left out (`<skipped message="skipped"/>`, no time) are not listed,
/// nor are suite nodes that passed.
pub fn parse(xml: &str) -> Result<Vec<Case>> {
    let mut cases = Vec::new();
    let mut rest = xml;
    while let Some(start) = rest.find("<testcase") {
        rest = &rest[start + "<testcase".len()..];
        let (attrs, self_closing, after) =
            tag_attributes(rest).context("unterminated <testcase")?;
        let body = if self_closing {
            ""
        } else {
            let end = after
                .find("</testcase>")
                .context("<testcase> without </testcase>")?;
            &after[..end]
        };
        rest = after;
        let attr = |key: &str| {
            attrs
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        let raw_name = attr("name").context("<testcase> without a name")?;
        let status = attr("status").unwrap_or("");
        let seconds = attr("time").and_then(|t| t.parse().ok()).unwrap_or(0.0);
        let failed_body = body.contains("<failure") || body.contains("<error");
        let outcome = match status {
            "passed" => Outcome::Passed,
            "skipped" | "pending" => {
                let message = body
                    .find("<skipped")
                    .and_then(|at| tag_attributes(&body[at + "<skipped".len()..]))
                    .and_then(|(attrs, _, _)| {
                        attrs
                            .into_iter()
                            .find(|(k, _)| k == "message")
                            .map(|(_, v)| v)
                    })
                    .unwrap_or_default();
                // Left out by --ginkgo.focus/--ginkgo.skip: never ran.
                if message == "skipped" || status == "pending" {
                    continue;
                }
                let reason = message.strip_prefix("skipped - ").unwrap_or(&message);
                Outcome::Skipped(reason.trim().to_owned())
            }
            "" if !failed_body => Outcome::Passed,
            other => Outcome::Failed(if other.is_empty() { "failed" } else { other }.to_owned()),
        };
        let Some(name) = raw_name.strip_prefix("[It] ") else {
            // BeforeSuite, AfterSuite, ReportAfterSuite…: shown only when they failed.
            if matches!(outcome, Outcome::Failed(_)) {
                cases.push(Case {
                    name: raw_name.to_owned(),
                    outcome,
                    seconds,
                });
            }
            continue;
        };
        cases.push(Case {
            name: name.to_owned(),
            outcome,
            seconds,
        });
    }
    Ok(cases)
}

/// A tag's attributes, in order.
type Attributes = Vec<(String, String)>;

/// The attributes of the tag whose name was just consumed, whether it closes itself, and the
/// text after its `>`.
fn tag_attributes(s: &str) -> Option<(Attributes, bool, &str)> {
    let mut attrs = Vec::new();
    let mut rest = s;
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("/>") {
            return Some((attrs, true, after));
        }
        if let Some(after) = rest.strip_prefix('>') {
            return Some((attrs, false, after));
        }
        let eq = rest.find('=')?;
        let key = rest[..eq].trim().to_owned();
        rest = rest[eq + 1..].trim_start();
        let quote = rest.chars().next()?;
        if quote != '"' && quote != '\'' {
            return None;
        }
        let end = rest[1..].find(quote)? + 1;
        attrs.push((key, unescape(&rest[1..end])));
        rest = &rest[end + 1..];
    }
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(amp) = rest.find('&') {
        out.push_str(&rest[..amp]);
        rest = &rest[amp..];
        let Some(semi) = rest.find(';') else { break };
        let entity = &rest[1..semi];
        let decoded = match entity {
            "amp" => Some('&'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "quot" => Some('"'),
            "apos" => Some('\''),
            _ => entity
                .strip_prefix("#x")
                .and_then(|h| u32::from_str_radix(h, 16).ok())
                .or_else(|| entity.strip_prefix('#').and_then(|d| d.parse().ok()))
                .and_then(char::from_u32),
        };
        match decoded {
            Some(c) => {
                out.push(c);
                rest = &rest[semi + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Counts of one proxy's run.
pub fn summary(cases: &[Case]) -> (usize, usize, usize) {
    let count = |f: fn(&Outcome) -> bool| cases.iter().filter(|c| f(&c.outcome)).count();
    (
        count(|o| matches!(o, Outcome::Passed)),
        count(|o| matches!(o, Outcome::Failed(_))),
        count(|o| matches!(o, Outcome::Skipped(_))),
    )
}

/// One Markdown table of every spec that ran under any of the proxies: a column per proxy
/// (`-` where it did not run) and each run's time, then a count line per proxy.
pub fn table(runs: &[(&str, &[Case])]) -> String {
    let mut specs: BTreeMap<&str, Vec<Option<&Case>>> = BTreeMap::new();
    for (i, (_, cases)) in runs.iter().enumerate() {
        for case in *cases {
            specs
                .entry(case.name.as_str())
                .or_insert_with(|| vec![None; runs.len()])[i] = Some(case);
        }
    }
    let mut out = String::from("| spec |");
    for (proxy, _) in runs {
        let _ = write!(out, " {proxy} |");
    }
    out.push_str(" time |\n|---|");
    for _ in runs {
        out.push_str("---|");
    }
    out.push_str("---:|\n");
    for (name, results) in &specs {
        let _ = write!(out, "| {} |", name.replace('|', "\\|"));
        for r in results {
            let _ = write!(out, " {} |", r.map_or("-".to_owned(), |c| c.outcome.cell()));
        }
        let times: Vec<String> = results
            .iter()
            .map(|r| r.map_or("-".to_owned(), |c| format!("{:.0} s", c.seconds)))
            .collect();
        let _ = writeln!(out, " {} |", times.join(" / "));
    }
    for (proxy, cases) in runs {
        let (passed, failed, skipped) = summary(cases);
        let _ = writeln!(
            out,
            "\n{proxy}: {passed} passed, {failed} failed, {skipped} skipped"
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
  <testsuites tests="5" disabled="0" errors="0" failures="1" time="61.2">
      <testsuite name="Kubernetes e2e suite" package="/x" tests="5">
          <properties><property name="SuiteSucceeded" value="false"></property></properties>
          <testcase name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="passed" time="0.5"></testcase>
          <testcase name="[It] [sig-network] Services should serve a basic endpoint from pods  [Conformance]" classname="Kubernetes e2e suite" status="passed" time="12.25">
              <system-err>log &amp; more</system-err>
          </testcase>
          <testcase name="[It] [sig-network] Services should be &quot;rejected&quot; when no endpoints exist" classname="Kubernetes e2e suite" status="failed" time="40.1">
              <failure message="" type="failed">[FAILED] timed out &lt;x&gt;</failure>
          </testcase>
          <testcase name="[It] [sig-network] Services should not run" classname="Kubernetes e2e suite" status="skipped" time="0">
              <skipped message="skipped"></skipped>
          </testcase>
          <testcase name="[It] [sig-network] Services should need 3 nodes" classname="Kubernetes e2e suite" status="skipped" time="1.5">
              <skipped message="skipped - Requires at least 3 nodes (not 2)"></skipped>
          </testcase>
          <testcase name="[ReportAfterSuite] Kubernetes e2e suite report" classname="Kubernetes e2e suite" status="passed" time="0"/>
      </testsuite>
  </testsuites>"#;

    #[test]
    fn parses_ginkgo_report() {
        let cases = parse(REPORT).unwrap();
        assert_eq!(cases.len(), 3, "{cases:#?}");
        assert_eq!(
            cases[0].name,
            "[sig-network] Services should serve a basic endpoint from pods  [Conformance]"
        );
        assert_eq!(cases[0].outcome, Outcome::Passed);
        assert!((cases[0].seconds - 12.25).abs() < 1e-9);
        assert_eq!(
            cases[1].name,
            "[sig-network] Services should be \"rejected\" when no endpoints exist"
        );
        assert_eq!(cases[1].outcome, Outcome::Failed("failed".to_owned()));
        assert_eq!(
            cases[2].outcome,
            Outcome::Skipped("Requires at least 3 nodes (not 2)".to_owned())
        );
        assert_eq!(summary(&cases), (1, 1, 1));
    }

    #[test]
    fn failed_suite_nodes_are_listed() {
        let xml = r#"<testcase name="[SynchronizedBeforeSuite]" status="failed" time="3"><failure>x</failure></testcase>"#;
        let cases = parse(xml).unwrap();
        assert_eq!(cases[0].name, "[SynchronizedBeforeSuite]");
        assert!(matches!(cases[0].outcome, Outcome::Failed(_)));
    }

    #[test]
    fn unescapes_entities() {
        assert_eq!(
            unescape("a &amp; b &lt;c&gt; &#39;d&#x27; &bogus"),
            "a & b <c> 'd' &bogus"
        );
    }

    #[test]
    fn table_lines_up_both_proxies() {
        let case = |name: &str, outcome, seconds| Case {
            name: name.to_owned(),
            outcome,
            seconds,
        };
        let lb = vec![
            case("b spec", Outcome::Passed, 10.0),
            case("a | spec", Outcome::Failed("failed".to_owned()), 5.4),
        ];
        let kp = vec![case("b spec", Outcome::Passed, 9.0)];
        let t = table(&[("lb", &lb), ("kube-proxy", &kp)]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "| spec | lb | kube-proxy | time |");
        assert_eq!(lines[1], "|---|---|---|---:|");
        assert_eq!(lines[2], "| a \\| spec | **FAILED** | - | 5 s / - |");
        assert_eq!(lines[3], "| b spec | passed | passed | 10 s / 9 s |");
        assert!(t.contains("\nlb: 1 passed, 1 failed, 0 skipped\n"), "{t}");
        assert!(
            t.contains("\nkube-proxy: 1 passed, 0 failed, 0 skipped\n"),
            "{t}"
        );
    }
}
