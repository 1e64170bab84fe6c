//! The manifest-directory source: Services and EndpointSlices from YAML or JSON files, as
//! `kubectl apply -f DIR` would read them (multi-document files and `List`s included).
//!
//! Subdirectories are read too, following symlinks, but each directory and each file only once
//! (by device and inode): a ConfigMap mount's `..data` link and its timestamped directory give
//! each object once, and a symlink loop ends at the directory it comes back to (a problem, not
//! a hang). Files above [`MAX_FILE_BYTES`] are refused without being read.
use std::{
    collections::BTreeSet,
    fs,
    io::Read as _,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use k8s_openapi::api::{core::v1, discovery::v1 as discovery};
use serde::Deserialize as _;

use super::slim::{EndpointSlice, Node, Service};

/// The objects read from a directory, slim: each is decoded as its Kubernetes type (which
/// refuses what the API server would), then kept as lb's copy.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    /// Node objects give the manifest source this node's facts (zone).
    pub nodes: Vec<Node>,
}

/// The largest manifest file lb reads (16 MiB, four times what the API server accepts in one
/// request); a bigger one is a problem and is not read at all.
pub const MAX_FILE_BYTES: u64 = 16 << 20;

/// What kind of problem a [`Problem`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProblemKind {
    /// A document that is no YAML/JSON, or no valid object of its kind.
    Unparsable,
    /// A file above [`MAX_FILE_BYTES`].
    TooLarge,
    /// A file or directory that could not be read (permissions, a dangling symlink, ...).
    Unreadable,
    /// A directory that contains itself through a symlink.
    SymlinkLoop,
}

impl ProblemKind {
    /// The `kind` and `reason` labels of `lb_objects_skipped_total`.
    pub fn labels(self) -> (&'static str, &'static str) {
        match self {
            ProblemKind::Unparsable => ("Document", "unparsable"),
            ProblemKind::TooLarge => ("File", "too_large"),
            ProblemKind::Unreadable => ("File", "unreadable"),
            ProblemKind::SymlinkLoop => ("File", "symlink_loop"),
        }
    }
}

/// A document that could not be used; the rest of the directory still applies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub file: PathBuf,
    /// 0-based document index within the file.
    pub document: usize,
    pub error: String,
    pub kind: ProblemKind,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (document {}): {}",
            self.file.display(),
            self.document,
            self.error
        )
    }
}

fn is_manifest(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml" | "json")
    )
}

/// Reads every `*.yaml`, `*.yml` and `*.json` file below `dir`, in name order. Fails only if
/// the directory itself cannot be read; bad documents come back as problems.
pub fn load_dir(dir: &Path) -> anyhow::Result<(Objects, Vec<Problem>)> {
    let (files, mut problems) =
        list_files(dir).with_context(|| format!("reading {}", dir.display()))?;
    let mut objects = Objects::default();
    for (file, meta) in files {
        let problem = |kind, error: String| Problem {
            file: file.clone(),
            document: 0,
            error,
            kind,
        };
        if meta.len() > MAX_FILE_BYTES {
            problems.push(problem(
                ProblemKind::TooLarge,
                format!(
                    "{} bytes, more than the {MAX_FILE_BYTES} lb reads (not read)",
                    meta.len()
                ),
            ));
            continue;
        }
        match read_capped(&file) {
            Ok(Some(text)) => parse_into(&file, &text, &mut objects, &mut problems),
            Ok(None) => problems.push(problem(
                ProblemKind::TooLarge,
                format!("grew beyond {MAX_FILE_BYTES} bytes while being read"),
            )),
            Err(e) => problems.push(problem(ProblemKind::Unreadable, e.to_string())),
        }
    }
    Ok((objects, problems))
}

/// The file's text, or `None` if it holds more than [`MAX_FILE_BYTES`] (it grew since its size
/// was checked): never more than that is read.
fn read_capped(file: &Path) -> std::io::Result<Option<String>> {
    let mut text = String::new();
    fs::File::open(file)?
        .take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)?;
    Ok((text.len() as u64 <= MAX_FILE_BYTES).then_some(text))
}

/// The manifest files of a directory with their metadata, and what could not be walked.
pub type Listing = (Vec<(PathBuf, fs::Metadata)>, Vec<Problem>);

/// Every manifest file below `dir` (symlinks followed), in path order, with its metadata; each
/// directory and file once (see the module docs). Entries that cannot be read and symlink
/// loops come back as problems. Fails only if `dir` itself cannot be read.
pub fn list_files(dir: &Path) -> std::io::Result<Listing> {
    let mut walk = Walk::default();
    let meta = fs::metadata(dir)?;
    if !meta.is_dir() {
        // read_dir's own error, for the caller's message.
        fs::read_dir(dir)?;
    }
    walk.dir(dir, &meta, &mut Vec::new())?;
    Ok((walk.files, walk.problems))
}

#[derive(Default)]
struct Walk {
    files: Vec<(PathBuf, fs::Metadata)>,
    problems: Vec<Problem>,
    /// (device, inode) of every directory and file taken so far.
    seen: BTreeSet<(u64, u64)>,
}

impl Walk {
    /// Reads `dir` (whose metadata is `meta`); `ancestors` are the directories above it.
    fn dir(
        &mut self,
        dir: &Path,
        meta: &fs::Metadata,
        ancestors: &mut Vec<(u64, u64)>,
    ) -> std::io::Result<()> {
        let id = (meta.dev(), meta.ino());
        if ancestors.contains(&id) {
            self.problems.push(Problem {
                file: dir.to_path_buf(),
                document: 0,
                error: "a symlink loop: this directory contains itself (not read again)".into(),
                kind: ProblemKind::SymlinkLoop,
            });
            return Ok(());
        }
        if !self.seen.insert(id) {
            // Reached before through another link (a ConfigMap's `..data`): read once.
            return Ok(());
        }
        let mut entries: Vec<PathBuf> = fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        ancestors.push(id);
        for path in entries {
            // Follows symlinks; a dangling one or an unreadable entry is a problem of its own.
            let meta = match fs::metadata(&path) {
                Ok(m) => m,
                Err(e) => {
                    if is_manifest(&path) {
                        self.unreadable(&path, &e);
                    }
                    continue;
                }
            };
            if meta.is_dir() {
                if let Err(e) = self.dir(&path, &meta, ancestors) {
                    self.unreadable(&path, &e);
                }
            } else if is_manifest(&path) && self.seen.insert((meta.dev(), meta.ino())) {
                self.files.push((path, meta));
            }
        }
        ancestors.pop();
        Ok(())
    }

    fn unreadable(&mut self, path: &Path, e: &std::io::Error) {
        self.problems.push(Problem {
            file: path.to_path_buf(),
            document: 0,
            error: e.to_string(),
            kind: ProblemKind::Unreadable,
        });
    }
}

/// Parses one file's documents (YAML is a superset of JSON).
pub fn parse_into(file: &Path, text: &str, objects: &mut Objects, problems: &mut Vec<Problem>) {
    for (document, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let problem = |error: String| Problem {
            file: file.to_path_buf(),
            document,
            error,
            kind: ProblemKind::Unparsable,
        };
        let value = match serde_yaml::Value::deserialize(de) {
            Ok(serde_yaml::Value::Null) => continue,
            Ok(v) => v,
            Err(e) => {
                problems.push(problem(e.to_string()));
                // A syntax error leaves the rest of the stream unreadable.
                break;
            }
        };
        if let Err(e) = add_object(value, objects) {
            problems.push(problem(e));
        }
    }
}

fn add_object(value: serde_yaml::Value, objects: &mut Objects) -> Result<(), String> {
    let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or("");
    let api_version = value
        .get("apiVersion")
        .and_then(|k| k.as_str())
        .unwrap_or("");
    match (api_version, kind) {
        ("v1", "Service") => {
            // As the watch does (`k8s::WatchedService`): a dumped Service may carry a status
            // condition with `lastTransitionTime: null`, and lb reads no condition.
            let mut value = value;
            if let Some(status) = value
                .get_mut("status")
                .and_then(serde_yaml::Value::as_mapping_mut)
            {
                status.remove("conditions");
            }
            let svc: v1::Service = serde_yaml::from_value(value).map_err(|e| e.to_string())?;
            objects.services.push(Service::from(&svc));
        }
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            let slice: discovery::EndpointSlice =
                serde_yaml::from_value(value).map_err(|e| e.to_string())?;
            objects.slices.push(EndpointSlice::from(&slice));
        }
        ("v1", "Node") => {
            let node: v1::Node = serde_yaml::from_value(value).map_err(|e| e.to_string())?;
            objects.nodes.push(Node::from(&node));
        }
        (_, "List" | "ServiceList" | "EndpointSliceList" | "NodeList") => {
            let items = value
                .get("items")
                .and_then(|i| i.as_sequence())
                .cloned()
                .unwrap_or_default();
            let mut errors = Vec::new();
            for (i, item) in items.into_iter().enumerate() {
                if let Err(e) = add_object(item, objects) {
                    errors.push(format!("item {i}: {e}"));
                }
            }
            if !errors.is_empty() {
                return Err(errors.join("; "));
            }
        }
        ("", _) | (_, "") => return Err("not a Kubernetes object (no apiVersion/kind)".into()),
        // Other kinds (Deployments, ...) may share the directory; they are not lb's.
        _ => {}
    }
    Ok(())
}
