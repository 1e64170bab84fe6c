//! The in-memory maps as the API tests compare them: `render` output parsed into frontend →
//! backends.
use std::collections::{BTreeMap, BTreeSet};

/// A backend as [`Maps`] lists it: `addr:8080/TCP`, or `addr:8080/TCP state` for
/// `"addr state"` (a backend kept for established flows only).
pub fn be(addr: &str) -> String {
    match addr.split_once(' ') {
        Some((a, state)) => format!("{a}:8080/TCP {state}"),
        None => format!("{addr}:8080/TCP"),
    }
}

/// `render` output, parsed: frontend → its backends in slot order (`addr:port/PROTO`, with the
/// state appended when not active), plus anything inconsistent (orphans, missing entries,
/// rev-NAT mismatches).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Maps {
    pub frontends: BTreeMap<String, Vec<String>>,
    pub problems: Vec<String>,
    pub text: String,
}

impl Maps {
    pub fn parse(text: String) -> Self {
        let mut maps = Maps::default();
        let mut current: Option<String> = None;
        for line in text.lines() {
            if let Some(slot) = line.strip_prefix("  slot ") {
                let (_, rest) = slot.split_once(": ").unwrap_or(("", slot));
                if rest.starts_with("MISSING") {
                    maps.problems.push(line.to_string());
                    continue;
                }
                let backend = rest.strip_suffix(" active").unwrap_or(rest).to_string();
                if let Some(fe) = &current {
                    maps.frontends.entry(fe.clone()).or_default().push(backend);
                }
            } else if line.starts_with("orphan") {
                maps.problems.push(line.to_string());
                current = None;
            } else if line.starts_with("echo ") {
                // The echo table: derived from the masters, which are checked themselves.
                current = None;
            } else if line.starts_with("cluster-ip ") {
                // The ClusterIP set; its own consistency is checked by the rendering.
                if !line.contains("(ok)") {
                    maps.problems.push(line.to_string());
                }
                current = None;
            } else {
                let fe = line
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                if !line.contains("(ok)") {
                    maps.problems.push(line.to_string());
                }
                maps.frontends.insert(fe.clone(), Vec::new());
                current = Some(fe);
            }
        }
        maps.text = text;
        maps
    }

    /// Exactly these frontends → backends, and nothing left over.
    pub fn is(&self, want: &[(&str, &[&str])]) -> bool {
        let want: BTreeMap<String, BTreeSet<String>> = want
            .iter()
            .map(|(fe, bs)| (fe.to_string(), bs.iter().map(|b| be(b)).collect()))
            .collect();
        let have: BTreeMap<String, BTreeSet<String>> = self
            .frontends
            .iter()
            .map(|(fe, bs)| (fe.clone(), bs.iter().cloned().collect()))
            .collect();
        have == want && self.problems.is_empty()
    }
}
