//! Opening the maps a running (or stopped) `lb run` pinned, for the read-only commands: the
//! one place that turns a pin directory into typed maps, with the hints an operator needs when
//! that fails, plus reading the datapath counters from them.
use std::{collections::BTreeMap, fs, io, path::Path};

use anyhow::{Context as _, bail};
use aya::maps::{Array, HashMap, Map, MapData, MapInfo, PerCpuArray};
use lb_common::{
    AffinityMatchKey, Backend4, Backend6, ClusterIp4Key, ClusterIp6Key, ClusterIpValue, EchoKey4,
    EchoKey6, EchoValue, MetricValue, RevNat4, RevNat6, Svc4Key, Svc6Key, SvcValue, map_names,
    metrics,
};

use super::maps::{BpfMaps, MaglevGeometry, Table, read_counter};
pub use super::meta::pin_error;
use crate::model::Family;

impl BpfMaps {
    /// Opens the service, backend and rev-NAT maps pinned in `dir` by a running (or stopped)
    /// `lb run`. aya checks key and value sizes, so maps of an incompatible layout are refused
    /// rather than misread.
    pub fn open_pinned(dir: &Path) -> anyhow::Result<Self> {
        check_pin_dir(dir)?;
        let meta = super::meta::check(dir)?;
        let mut capacities = BTreeMap::new();
        for t in Table::ALL {
            for f in [Family::V4, Family::V6] {
                let name = t.map_name(f);
                let path = dir.join(name);
                let info = MapInfo::from_pin(&path).map_err(|e| pin_error(&path, e))?;
                capacities.insert((t, f), info.max_entries());
            }
        }
        // Pins from an lb without Maglev have no lb_maglev (and M 0 in lb_meta).
        let table_size = meta.map_or(0, |m| m.maglev_table_size);
        let path = dir.join(map_names::MAGLEV);
        let (maglev, maglev_geometry) = if table_size != 0 && path.exists() {
            let info = MapInfo::from_pin(&path).map_err(|e| pin_error(&path, e))?;
            let map = open_map(dir, map_names::MAGLEV)?;
            let array = Array::try_from(map)
                .with_context(|| format!("pinned map {} is not lb's", path.display()))?;
            let geometry = MaglevGeometry {
                table_size,
                tables: info.max_entries() / table_size,
            };
            (Some(array), geometry)
        } else {
            (None, MaglevGeometry::default())
        };
        Ok(BpfMaps {
            services4: open_hash::<Svc4Key, SvcValue>(dir, map_names::SERVICES4)?,
            backends4: open_hash::<u32, Backend4>(dir, map_names::BACKENDS4)?,
            revnat4: open_hash::<u32, RevNat4>(dir, map_names::REVNAT4)?,
            services6: open_hash::<Svc6Key, SvcValue>(dir, map_names::SERVICES6)?,
            backends6: open_hash::<u32, Backend6>(dir, map_names::BACKENDS6)?,
            revnat6: open_hash::<u32, RevNat6>(dir, map_names::REVNAT6)?,
            cluster_ips4: open_hash::<ClusterIp4Key, ClusterIpValue>(dir, map_names::CLUSTER_IPS4)?,
            cluster_ips6: open_hash::<ClusterIp6Key, ClusterIpValue>(dir, map_names::CLUSTER_IPS6)?,
            src_ranges4: open_trie(dir, map_names::SRC_RANGE4)?,
            src_ranges6: open_trie(dir, map_names::SRC_RANGE6)?,
            aff_match4: open_hash::<AffinityMatchKey, u8>(dir, map_names::AFF_MATCH4)?,
            aff_match6: open_hash::<AffinityMatchKey, u8>(dir, map_names::AFF_MATCH6)?,
            echo4: open_hash::<EchoKey4, EchoValue>(dir, map_names::ECHO4)?,
            echo6: open_hash::<EchoKey6, EchoValue>(dir, map_names::ECHO6)?,
            capacities,
            maglev,
            maglev_geometry,
            held: None,
        })
    }
}

/// Fails with a hint when `dir` does not hold lb's maps.
pub fn check_pin_dir(dir: &Path) -> anyhow::Result<()> {
    match fs::metadata(dir.join(map_names::SERVICES4)) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => bail!(
            "cannot read {}: permission denied (lb's pins are accessible to root only)",
            dir.display()
        ),
        Err(_) => bail!(
            "no pinned maps at {}: is `lb run` running? (--pin-dir)",
            dir.display()
        ),
    }
}

/// Opens the map pinned as `name` in `dir`.
pub fn open_map(dir: &Path, name: &str) -> anyhow::Result<Map> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path).map_err(|e| pin_error(&path, e))?;
    Map::from_map_data(data).with_context(|| format!("pinned map {}", path.display()))
}

/// Opens the hash map pinned as `name` in `dir`; aya checks its key and value sizes.
pub fn open_hash<K: aya::Pod, V: aya::Pod>(
    dir: &Path,
    name: &str,
) -> anyhow::Result<HashMap<MapData, K, V>> {
    HashMap::try_from(open_map(dir, name)?).with_context(|| {
        format!(
            "pinned map {} does not have the layout this lb expects (made by an incompatible lb?)",
            dir.join(name).display()
        )
    })
}

/// Opens the LPM trie pinned as `name` in `dir`.
pub fn open_trie<K: aya::Pod, V: aya::Pod>(
    dir: &Path,
    name: &str,
) -> anyhow::Result<aya::maps::LpmTrie<MapData, K, V>> {
    aya::maps::LpmTrie::try_from(open_map(dir, name)?).with_context(|| {
        format!(
            "pinned map {} does not have the layout this lb expects (made by an incompatible lb?)",
            dir.join(name).display()
        )
    })
}

/// One datapath counter (`lb_metrics`), summed over CPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counter {
    /// A `lb_common::metrics::NAMES` entry.
    pub name: &'static str,
    pub packets: u64,
    pub bytes: u64,
}

/// Every datapath counter in the `lb_metrics` map pinned in `dir`, in `metrics::NAMES` order;
/// none if the map is not pinned (yet).
pub fn read_counters(dir: &Path) -> anyhow::Result<Vec<Counter>> {
    let path = dir.join(map_names::METRICS);
    if !path.exists() {
        return Ok(Vec::new());
    }
    let map: PerCpuArray<MapData, MetricValue> =
        PerCpuArray::try_from(open_map(dir, map_names::METRICS)?)
            .with_context(|| format!("pinned map {} has an unexpected layout", path.display()))?;
    let mut out = Vec::with_capacity(metrics::NAMES.len());
    for (index, name) in (0u32..).zip(metrics::NAMES) {
        let (packets, bytes) = read_counter(&map, index)
            .with_context(|| format!("reading {} index {index}", path.display()))?;
        out.push(Counter {
            name,
            packets,
            bytes,
        });
    }
    Ok(out)
}
