//! What `lb run` keeps in its `--state-dir` for the read-only commands: `frontends.json`, the
//! service port each programmed frontend belongs to (the maps hold addresses only). The daemon
//! rewrites it after every sync; `lb services` and `lb trace` read it.
use std::{
    collections::BTreeMap,
    fs, io,
    path::{Path, PathBuf},
};

use anyhow::Context as _;

use crate::model::{DesiredState, ServicePortName};

/// Default `--state-dir`.
pub const DEFAULT_STATE_DIR: &str = "/run/lb";
/// File in the state dir naming each programmed frontend's service.
pub const FRONTENDS_FILE: &str = "frontends.json";

/// One line of `frontends.json`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FrontendName {
    /// `ip:port/PROTO` (IPv6 in brackets), as `model::L4Addr` displays it.
    pub frontend: String,
    /// `external` or `internal`.
    pub scope: String,
    pub namespace: String,
    pub name: String,
    pub port_name: String,
    /// ClusterIP, ExternalIP, LoadBalancer, NodePort.
    pub kind: String,
}

impl FrontendName {
    /// The service port, which displays as `namespace/name[:port]`.
    pub fn service(&self) -> ServicePortName {
        ServicePortName {
            namespace: self.namespace.as_str().into(),
            name: self.name.as_str().into(),
            port_name: self.port_name.as_str().into(),
        }
    }
}

/// Frontend names keyed by `(frontend, scope)`, as [`FrontendName`] spells them.
pub type Names = BTreeMap<(String, String), FrontendName>;

/// Writes the names of the desired frontends atomically (temp file + rename).
pub fn write_names(dir: &Path, state: &DesiredState) -> anyhow::Result<()> {
    let names: Vec<FrontendName> = state
        .services
        .iter()
        .map(|(fe, entry)| FrontendName {
            frontend: fe.l4.to_string(),
            scope: fe.scope.as_str().into(),
            namespace: entry.name.namespace.to_string(),
            name: entry.name.name.to_string(),
            port_name: entry.name.port_name.to_string(),
            kind: entry.kind().into(),
        })
        .collect();
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(".{FRONTENDS_FILE}.tmp"));
    fs::write(&tmp, serde_json::to_vec_pretty(&names)?)?;
    fs::rename(&tmp, dir.join(FRONTENDS_FILE))?;
    Ok(())
}

/// Why `frontends.json` could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("cannot parse {}: {source}", path.display())]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// Reads `<state_dir>/frontends.json`; a missing file gives no names.
pub fn read_names(state_dir: &Path) -> Result<Names, ReadError> {
    let path = state_dir.join(FRONTENDS_FILE);
    let text = match fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Names::new()),
        Err(source) => return Err(ReadError::Read { path, source }),
    };
    let names: Vec<FrontendName> =
        serde_json::from_slice(&text).map_err(|source| ReadError::Parse { path, source })?;
    Ok(names
        .into_iter()
        .map(|n| ((n.frontend.clone(), n.scope.clone()), n))
        .collect())
}
