//! The manifest-directory source: Services and EndpointSlices from YAML or JSON files, as
//! `kubectl apply -f DIR` would read them (multi-document files and `List`s included).
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use serde::Deserialize as _;

/// The objects read from a directory.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    /// Node objects give the manifest source this node's facts (zone).
    pub nodes: Vec<Node>,
}

/// A document that could not be used; the rest of the directory still applies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub file: PathBuf,
    /// 0-based document index within the file.
    pub document: usize,
    pub error: String,
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
    let mut files = Vec::new();
    collect_files(dir, &mut files).with_context(|| format!("reading {}", dir.display()))?;
    files.sort();
    let mut objects = Objects::default();
    let mut problems = Vec::new();
    for file in files {
        match fs::read_to_string(&file) {
            Ok(text) => parse_into(&file, &text, &mut objects, &mut problems),
            Err(e) => problems.push(Problem {
                file,
                document: 0,
                error: e.to_string(),
            }),
        }
    }
    Ok((objects, problems))
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_files(&path, out)?;
        } else if is_manifest(&path) {
            out.push(path);
        }
    }
    Ok(())
}

/// Parses one file's documents (YAML is a superset of JSON).
pub fn parse_into(file: &Path, text: &str, objects: &mut Objects, problems: &mut Vec<Problem>) {
    for (document, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let problem = |error: String| Problem {
            file: file.to_path_buf(),
            document,
            error,
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
            let svc: Service = serde_yaml::from_value(value).map_err(|e| e.to_string())?;
            objects.services.push(svc);
        }
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            let slice: EndpointSlice = serde_yaml::from_value(value).map_err(|e| e.to_string())?;
            objects.slices.push(slice);
        }
        ("v1", "Node") => {
            let node: Node = serde_yaml::from_value(value).map_err(|e| e.to_string())?;
            objects.nodes.push(node);
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
