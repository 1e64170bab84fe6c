//! OCI image archives, written without a container engine or a registry.
//!
//! An archive is an OCI image layout in one tar file, as `ctr images import` and
//! `podman load` read it:
//!
//! ```text
//! oci-layout                 {"imageLayoutVersion":"1.0.0"}
//! index.json                 one manifest descriptor, annotated with the image's name
//! blobs/sha256/<config>      the image configuration (entrypoint, env, rootfs diff_ids)
//! blobs/sha256/<manifest>    the config's and the layer's descriptors
//! blobs/sha256/<layer>       one gzip'd tar layer
//! ```
//!
//! containerd names the imported image after the descriptor's `io.containerd.image.name`
//! annotation (the full reference, `registry.k8s.io/pause:3.10.2`);
//! `org.opencontainers.image.ref.name` carries the tag, as the image-spec asks.
//!
//! Everything is deterministic: the same entries and configuration give the same bytes (entries
//! sorted by path, mtime 0, uid/gid 0, fixed gzip header, fixed creation time), so a digest
//! names the content and an unchanged image is not rewritten (see [`write_cached`]).

use std::{
    collections::BTreeMap,
    fs,
    io::{self, BufWriter, Read as _, Write as _},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

pub const MEDIA_TYPE_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MEDIA_TYPE_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const MEDIA_TYPE_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const MEDIA_TYPE_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const ANNOTATION_CONTAINERD_NAME: &str = "io.containerd.image.name";
pub const ANNOTATION_REF_NAME: &str = "org.opencontainers.image.ref.name";

/// The creation time in the config and its history (the epoch: nothing here depends on when
/// an image was written).
const CREATED: &str = "1970-01-01T00:00:00Z";
/// Bumped whenever the bytes written for the same inputs change, so cached archives are
/// rewritten (see [`Image::fingerprint`]).
const WRITER_VERSION: &str = "lb-xtask-oci 1";

/// What a path in the layer is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Content {
    Dir,
    /// A regular file copied from the host (read when the layer is written).
    HostFile(PathBuf),
    /// A regular file given in memory.
    Bytes(Vec<u8>),
    Symlink(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    mode: u32,
    content: Content,
}

/// The entries of one layer, by path inside the image (relative, no leading `/`). Adding a
/// path again replaces its entry. Directories that are not added explicitly but hold an entry
/// are written with mode 0755.
#[derive(Debug, Clone, Default)]
pub struct Layer {
    entries: BTreeMap<String, Entry>,
}

/// `/usr/bin/curl` and `usr/bin/curl/` → `usr/bin/curl`; no `.`/`..` or empty components.
fn normalize(path: &str) -> Result<String> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    ensure!(!parts.is_empty(), "empty path in an image layer: {path:?}");
    for part in &parts {
        ensure!(
            *part != "." && *part != "..",
            "path in an image layer has a `.` or `..` component: {path:?}"
        );
    }
    Ok(parts.join("/"))
}

impl Layer {
    pub fn new() -> Self {
        Self::default()
    }

    fn insert(&mut self, path: &str, mode: u32, content: Content) -> Result<&mut Self> {
        ensure!(
            mode <= 0o7777,
            "mode {mode:o} of {path} has more than permission bits"
        );
        self.entries
            .insert(normalize(path)?, Entry { mode, content });
        Ok(self)
    }

    /// A directory with `mode` (e.g. 0o1777 for `/tmp`).
    pub fn dir(&mut self, path: &str, mode: u32) -> Result<&mut Self> {
        self.insert(path, mode, Content::Dir)
    }

    /// A regular file with the contents of the host file `host` (symlinks followed).
    pub fn host_file(
        &mut self,
        path: &str,
        host: impl Into<PathBuf>,
        mode: u32,
    ) -> Result<&mut Self> {
        self.insert(path, mode, Content::HostFile(host.into()))
    }

    /// A regular file with the contents `data`.
    pub fn file(&mut self, path: &str, data: impl Into<Vec<u8>>, mode: u32) -> Result<&mut Self> {
        self.insert(path, mode, Content::Bytes(data.into()))
    }

    /// A symbolic link to `target` (taken as is: relative or absolute).
    pub fn symlink(&mut self, path: &str, target: &str) -> Result<&mut Self> {
        ensure!(!target.is_empty(), "symlink {path} has an empty target");
        self.insert(path, 0o777, Content::Symlink(target.to_owned()))
    }

    /// Every entry with the directories it implies, sorted by path: a parent sorts before its
    /// children because it is their prefix.
    fn all_entries(&self) -> BTreeMap<String, Entry> {
        let mut all = self.entries.clone();
        for path in self.entries.keys() {
            let mut parent = path.as_str();
            while let Some((up, _)) = parent.rsplit_once('/') {
                all.entry(up.to_owned()).or_insert(Entry {
                    mode: 0o755,
                    content: Content::Dir,
                });
                parent = up;
            }
        }
        all
    }

    /// The uncompressed tar of the layer.
    fn tar(&self) -> Result<Vec<u8>> {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, entry) in self.all_entries() {
            let mut header = tar::Header::new_gnu();
            header.set_mode(entry.mode);
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(0);
            match &entry.content {
                Content::Dir => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_size(0);
                    builder.append_data(&mut header, format!("{path}/"), io::empty())?;
                }
                Content::HostFile(host) => {
                    let file = fs::File::open(host)
                        .with_context(|| format!("opening {} for /{path}", host.display()))?;
                    let len = file.metadata()?.len();
                    ensure!(
                        file.metadata()?.is_file(),
                        "{} (for /{path}) is not a regular file",
                        host.display()
                    );
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_size(len);
                    // Exactly `len` bytes, even if the file grows while it is read.
                    let mut data = file.take(len);
                    builder
                        .append_data(&mut header, &path, &mut data)
                        .with_context(|| format!("adding {} as /{path}", host.display()))?;
                    ensure!(
                        data.limit() == 0,
                        "{} shrank while it was read",
                        host.display()
                    );
                }
                Content::Bytes(data) => {
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_size(data.len() as u64);
                    builder.append_data(&mut header, &path, data.as_slice())?;
                }
                Content::Symlink(target) => {
                    header.set_entry_type(tar::EntryType::Symlink);
                    header.set_size(0);
                    builder.append_link(&mut header, &path, target)?;
                }
            }
        }
        Ok(builder.into_inner()?)
    }
}

/// The image configuration's `config` part (what a Containerfile's ENTRYPOINT, CMD, ENV,
/// WORKDIR, USER, EXPOSE and STOPSIGNAL set); empty fields are left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Config {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// `NAME=value`.
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
    /// `80/tcp`.
    pub exposed_ports: Vec<String>,
    pub stop_signal: Option<String>,
}

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

impl Config {
    pub fn new(entrypoint: &[&str], cmd: &[&str], env: &[&str]) -> Self {
        Self {
            entrypoint: strings(entrypoint),
            cmd: strings(cmd),
            env: strings(env),
            ..Self::default()
        }
    }

    fn json(&self) -> Value {
        let mut config = serde_json::Map::new();
        if !self.entrypoint.is_empty() {
            config.insert("Entrypoint".into(), json!(self.entrypoint));
        }
        if !self.cmd.is_empty() {
            config.insert("Cmd".into(), json!(self.cmd));
        }
        if !self.env.is_empty() {
            config.insert("Env".into(), json!(self.env));
        }
        if let Some(dir) = &self.working_dir {
            config.insert("WorkingDir".into(), json!(dir));
        }
        if let Some(user) = &self.user {
            config.insert("User".into(), json!(user));
        }
        if !self.exposed_ports.is_empty() {
            let ports: serde_json::Map<String, Value> = self
                .exposed_ports
                .iter()
                .map(|p| (p.clone(), json!({})))
                .collect();
            config.insert("ExposedPorts".into(), Value::Object(ports));
        }
        if let Some(signal) = &self.stop_signal {
            config.insert("StopSignal".into(), json!(signal));
        }
        Value::Object(config)
    }
}

/// An image: its full name (`registry/repository:tag`), configuration and single layer.
#[derive(Debug, Clone)]
pub struct Image {
    pub name: String,
    pub config: Config,
    pub layer: Layer,
}

/// What [`write`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// `sha256:…` of the manifest: the image's digest once imported.
    pub manifest_digest: String,
    /// The gzip'd layer's size.
    pub layer_size: u64,
    /// The layer's size uncompressed (about what the image takes on a node).
    pub unpacked_size: u64,
    /// The archive's size.
    pub archive_size: u64,
}

fn sha256_hex(data: &[u8]) -> String {
    let digest = Sha256::digest(data);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn descriptor(media_type: &str, data: &[u8]) -> Value {
    json!({
        "mediaType": media_type,
        "digest": format!("sha256:{}", sha256_hex(data)),
        "size": data.len(),
    })
}

/// The tag of `registry/repository:tag` (a `:` in the registry's host:port is not one).
pub fn tag(name: &str) -> Result<&str> {
    let last = name.rsplit('/').next().unwrap_or(name);
    match last.rsplit_once(':') {
        Some((repo, tag)) if !repo.is_empty() && !tag.is_empty() => Ok(tag),
        _ => bail!("image name {name:?} has no tag (want registry/repository:tag)"),
    }
}

/// An image's content in memory, before it is archived.
struct Blobs {
    index: Vec<u8>,
    /// (hex sha256, content), sorted.
    blobs: Vec<(String, Vec<u8>)>,
    layer_size: u64,
    unpacked_size: u64,
}

impl Image {
    /// The blobs and the index, in memory.
    fn blobs(&self) -> Result<Blobs> {
        let tag = tag(&self.name)?;
        let tar = self.layer.tar()?;
        let diff_id = format!("sha256:{}", sha256_hex(&tar));
        let mut gz = flate2::GzBuilder::new()
            .mtime(0)
            .operating_system(3) // Unix
            .write(Vec::new(), flate2::Compression::default());
        gz.write_all(&tar)?;
        let layer = gz.finish()?;

        let config = json!({
            "created": CREATED,
            "architecture": "amd64",
            "os": "linux",
            "config": self.config.json(),
            "rootfs": { "type": "layers", "diff_ids": [diff_id] },
            "history": [{
                "created": CREATED,
                "created_by": "cargo xtask (xtask/src/oci.rs): one layer of listed files",
            }],
        });
        let config = serde_json::to_vec(&config)?;
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_MANIFEST,
            "config": descriptor(MEDIA_TYPE_CONFIG, &config),
            "layers": [descriptor(MEDIA_TYPE_LAYER, &layer)],
        });
        let manifest = serde_json::to_vec(&manifest)?;
        let mut manifest_descriptor = descriptor(MEDIA_TYPE_MANIFEST, &manifest);
        manifest_descriptor["platform"] = json!({ "architecture": "amd64", "os": "linux" });
        manifest_descriptor["annotations"] = json!({
            ANNOTATION_CONTAINERD_NAME: self.name,
            ANNOTATION_REF_NAME: tag,
        });
        let index = json!({
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_INDEX,
            "manifests": [manifest_descriptor],
        });
        let index = serde_json::to_vec(&index)?;
        let (layer_size, unpacked) = (layer.len() as u64, tar.len() as u64);
        let mut blobs: Vec<(String, Vec<u8>)> = [config, manifest, layer]
            .into_iter()
            .map(|b| (sha256_hex(&b), b))
            .collect();
        blobs.sort();
        blobs.dedup_by(|a, b| a.0 == b.0);
        Ok(Blobs {
            index,
            blobs,
            layer_size,
            unpacked_size: unpacked,
        })
    }

    /// A digest of everything the archive is made from: the writer's version, the name, the
    /// configuration, and each entry (host files by path, size and modification time, so a
    /// rebuilt binary or an upgraded library makes it differ).
    pub fn fingerprint(&self) -> Result<String> {
        let mut h = Sha256::new();
        let mut field = |bytes: &[u8]| {
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field(WRITER_VERSION.as_bytes());
        field(self.name.as_bytes());
        field(&serde_json::to_vec(&self.config.json())?);
        for (path, entry) in self.layer.all_entries() {
            field(path.as_bytes());
            field(&entry.mode.to_le_bytes());
            match &entry.content {
                Content::Dir => field(b"dir"),
                Content::Symlink(target) => {
                    field(b"symlink");
                    field(target.as_bytes());
                }
                Content::Bytes(data) => {
                    field(b"bytes");
                    field(data);
                }
                Content::HostFile(host) => {
                    let meta = fs::metadata(host)
                        .with_context(|| format!("{} (for /{path})", host.display()))?;
                    field(b"host");
                    field(host.as_os_str().as_encoded_bytes());
                    field(&meta.len().to_le_bytes());
                    field(&meta.mtime().to_le_bytes());
                    field(&meta.mtime_nsec().to_le_bytes());
                }
            }
        }
        Ok(format!("{:x}", h.finalize()))
    }
}

/// One entry of the outer archive.
fn append(builder: &mut tar::Builder<impl io::Write>, path: &str, data: &[u8]) -> Result<()> {
    let mut header = tar::Header::new_gnu();
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    if path.ends_with('/') {
        header.set_entry_type(tar::EntryType::Directory);
        header.set_mode(0o755);
    } else {
        header.set_entry_type(tar::EntryType::Regular);
        header.set_mode(0o644);
    }
    header.set_size(data.len() as u64);
    builder.append_data(&mut header, path, data)?;
    Ok(())
}

/// Writes `image` as an OCI archive at `out` (through a temporary file beside it, renamed
/// into place, so a reader never sees half an archive).
pub fn write(image: &Image, out: &Path) -> Result<Written> {
    let Blobs {
        index,
        blobs,
        layer_size,
        unpacked_size,
    } = image
        .blobs()
        .with_context(|| format!("building image {}", image.name))?;
    let manifest_digest = {
        let index: Value = serde_json::from_slice(&index)?;
        index["manifests"][0]["digest"]
            .as_str()
            .context("index without a manifest digest")?
            .to_owned()
    };
    if let Some(dir) = out.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = out.with_extension("tmp");
    let file = fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut builder = tar::Builder::new(BufWriter::new(file));
    append(&mut builder, "blobs/", &[])?;
    append(&mut builder, "blobs/sha256/", &[])?;
    for (hex, blob) in &blobs {
        append(&mut builder, &format!("blobs/sha256/{hex}"), blob)?;
    }
    append(&mut builder, "index.json", &index)?;
    append(
        &mut builder,
        "oci-layout",
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    let mut writer = builder.into_inner()?;
    writer.flush()?;
    let file = writer.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    drop(file);
    fs::rename(&tmp, out).with_context(|| format!("renaming {} into place", tmp.display()))?;
    Ok(Written {
        manifest_digest,
        layer_size,
        unpacked_size,
        archive_size: fs::metadata(out)?.len(),
    })
}

/// [`write`], unless `out` exists and its stamp (`<out>.inputs`) holds the image's current
/// [`Image::fingerprint`]; returns whether it wrote.
pub fn write_cached(image: &Image, out: &Path) -> Result<bool> {
    let stamp = stamp_path(out);
    let fingerprint = image.fingerprint()?;
    if out.is_file() && fs::read_to_string(&stamp).ok().as_deref() == Some(fingerprint.as_str()) {
        return Ok(false);
    }
    // No stale stamp may survive a failed write.
    let _ = fs::remove_file(&stamp);
    write(image, out)?;
    fs::write(&stamp, fingerprint).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(true)
}

/// The digest of the (first) manifest an archive's index.json names.
pub fn manifest_digest(archive: &Path) -> Result<String> {
    let file = fs::File::open(archive).with_context(|| format!("opening {}", archive.display()))?;
    let mut tar = tar::Archive::new(io::BufReader::new(file));
    for entry in tar.entries()? {
        let mut entry = entry?;
        if entry.path()?.as_os_str() == "index.json" {
            let mut data = Vec::new();
            entry.read_to_end(&mut data)?;
            let index: Value = serde_json::from_slice(&data)?;
            return index["manifests"][0]["digest"]
                .as_str()
                .map(str::to_owned)
                .with_context(|| format!("{}: index.json names no manifest", archive.display()));
        }
    }
    bail!("{} has no index.json", archive.display())
}

fn stamp_path(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_owned();
    name.push(".inputs");
    out.with_file_name(name)
}

#[cfg(test)]
pub mod tests {
    use std::{collections::BTreeMap, io::Read as _};

    use super::*;

    /// A fresh directory under the system's temporary directory, removed on drop.
    pub struct TempDir(pub PathBuf);

    impl TempDir {
        pub fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("xtask-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// The files of a tar (path → bytes), in archive order too.
    fn read_tar(data: &[u8]) -> (Vec<String>, BTreeMap<String, Vec<u8>>) {
        let mut order = Vec::new();
        let mut files = BTreeMap::new();
        let mut archive = tar::Archive::new(data);
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let path = entry.path().unwrap().display().to_string();
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes).unwrap();
            order.push(path.clone());
            files.insert(path, bytes);
        }
        (order, files)
    }

    /// One layer entry as read back: (type, mode, uid, gid, mtime, link target, contents).
    #[derive(Debug, PartialEq, Eq)]
    pub struct ReadEntry {
        pub kind: tar::EntryType,
        pub mode: u32,
        pub link: Option<String>,
        pub data: Vec<u8>,
    }

    /// An archive read back and checked against itself: every descriptor's digest and size
    /// match its blob, the config's diff_id matches the uncompressed layer. Returns the index,
    /// the config and the layer's entries (path without a trailing `/`).
    pub fn read_archive(archive: &Path) -> (Value, Value, BTreeMap<String, ReadEntry>) {
        let (_, files) = read_tar(&fs::read(archive).unwrap());
        assert_eq!(
            files["oci-layout"],
            br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()
        );
        let blob = |descriptor: &Value| -> Vec<u8> {
            let digest = descriptor["digest"].as_str().unwrap();
            let hex = digest.strip_prefix("sha256:").unwrap();
            let data = files
                .get(&format!("blobs/sha256/{hex}"))
                .unwrap_or_else(|| panic!("no blob {digest}"))
                .clone();
            assert_eq!(sha256_hex(&data), hex, "blob {digest}'s content");
            assert_eq!(
                descriptor["size"].as_u64(),
                Some(data.len() as u64),
                "{descriptor}"
            );
            data
        };
        let index: Value = serde_json::from_slice(&files["index.json"]).unwrap();
        assert_eq!(index["schemaVersion"], 2);
        let manifests = index["manifests"].as_array().unwrap();
        assert_eq!(manifests.len(), 1);
        assert_eq!(manifests[0]["mediaType"], MEDIA_TYPE_MANIFEST);
        let manifest: Value = serde_json::from_slice(&blob(&manifests[0])).unwrap();
        assert_eq!(manifest["schemaVersion"], 2);
        assert_eq!(manifest["config"]["mediaType"], MEDIA_TYPE_CONFIG);
        let config: Value = serde_json::from_slice(&blob(&manifest["config"])).unwrap();
        let layers = manifest["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 1);
        assert_eq!(layers[0]["mediaType"], MEDIA_TYPE_LAYER);
        let mut tar = Vec::new();
        flate2::read::GzDecoder::new(blob(&layers[0]).as_slice())
            .read_to_end(&mut tar)
            .unwrap();
        assert_eq!(
            config["rootfs"],
            json!({"type": "layers", "diff_ids": [format!("sha256:{}", sha256_hex(&tar))]})
        );
        let mut entries = BTreeMap::new();
        let mut archive = tar::Archive::new(tar.as_slice());
        let mut order = Vec::new();
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let header = entry.header();
            assert_eq!(header.mtime().unwrap(), 0);
            assert_eq!(header.uid().unwrap(), 0);
            assert_eq!(header.gid().unwrap(), 0);
            let path = entry.path().unwrap().display().to_string();
            let path = path.trim_end_matches('/').to_owned();
            let kind = header.entry_type();
            let mode = header.mode().unwrap();
            let link = entry.link_name().unwrap().map(|l| l.display().to_string());
            let mut data = Vec::new();
            entry.read_to_end(&mut data).unwrap();
            order.push(path.clone());
            let read = ReadEntry {
                kind,
                mode,
                link,
                data,
            };
            assert!(entries.insert(path, read).is_none(), "one entry a path");
        }
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(order, sorted, "layer entries sorted by path");
        (index, config, entries)
    }

    fn sample(host: &Path) -> Image {
        let mut layer = Layer::new();
        layer
            .host_file("/usr/local/bin/tool", host, 0o755)
            .unwrap()
            .file("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n", 0o644)
            .unwrap()
            .symlink("/bin/sh", "busybox")
            .unwrap()
            .dir("/tmp", 0o1777)
            .unwrap()
            .file(
                // Longer than the 100 bytes of a tar header's name field.
                &format!("deep/{}/file", "d".repeat(120)),
                "x",
                0o600,
            )
            .unwrap();
        Image {
            name: "registry.example.invalid:5000/some/image:1.2-3".to_owned(),
            config: Config {
                working_dir: Some("/".to_owned()),
                exposed_ports: vec!["80/tcp".to_owned()],
                ..Config::new(&["/usr/local/bin/tool"], &["run"], &["PATH=/usr/local/bin"])
            },
            layer,
        }
    }

    #[test]
    fn tag_is_after_the_last_colon_of_the_last_component() {
        assert_eq!(tag("registry.k8s.io/pause:3.10.2").unwrap(), "3.10.2");
        assert_eq!(tag("host:5000/a/b:v1").unwrap(), "v1");
        assert!(tag("host:5000/a/b").is_err());
        assert!(tag("b:").is_err());
    }

    #[test]
    fn archive_reads_back_with_matching_digests_and_entries() {
        let tmp = TempDir::new("oci-readback");
        let host = tmp.0.join("tool");
        fs::write(&host, b"\x7fELF pretend").unwrap();
        let image = sample(&host);
        let out = tmp.0.join("out/image.oci.tar");
        let written = write(&image, &out).unwrap();
        assert_eq!(written.archive_size, fs::metadata(&out).unwrap().len());

        let (index, config, entries) = read_archive(&out);
        let descriptor = &index["manifests"][0];
        assert_eq!(descriptor["digest"], written.manifest_digest.as_str());
        assert_eq!(
            descriptor["annotations"],
            json!({
                "io.containerd.image.name": "registry.example.invalid:5000/some/image:1.2-3",
                "org.opencontainers.image.ref.name": "1.2-3",
            })
        );
        assert_eq!(
            descriptor["platform"],
            json!({"architecture": "amd64", "os": "linux"})
        );
        assert_eq!(config["architecture"], "amd64");
        assert_eq!(config["os"], "linux");
        assert_eq!(
            config["config"],
            json!({
                "Entrypoint": ["/usr/local/bin/tool"],
                "Cmd": ["run"],
                "Env": ["PATH=/usr/local/bin"],
                "WorkingDir": "/",
                "ExposedPorts": {"80/tcp": {}},
            })
        );
        assert_eq!(config["history"].as_array().unwrap().len(), 1);

        use tar::EntryType::{Directory, Regular, Symlink};
        let dir = |mode| ReadEntry {
            kind: Directory,
            mode,
            link: None,
            data: Vec::new(),
        };
        let file = |mode, data: &[u8]| ReadEntry {
            kind: Regular,
            mode,
            link: None,
            data: data.to_vec(),
        };
        let deep = format!("deep/{}", "d".repeat(120));
        let want = BTreeMap::from([
            ("bin".to_owned(), dir(0o755)),
            (
                "bin/sh".to_owned(),
                ReadEntry {
                    kind: Symlink,
                    mode: 0o777,
                    link: Some("busybox".to_owned()),
                    data: Vec::new(),
                },
            ),
            ("deep".to_owned(), dir(0o755)),
            (deep.clone(), dir(0o755)),
            (format!("{deep}/file"), file(0o600, b"x")),
            ("etc".to_owned(), dir(0o755)),
            (
                "etc/passwd".to_owned(),
                file(0o644, b"root:x:0:0:root:/root:/bin/sh\n"),
            ),
            ("tmp".to_owned(), dir(0o1777)),
            ("usr".to_owned(), dir(0o755)),
            ("usr/local".to_owned(), dir(0o755)),
            ("usr/local/bin".to_owned(), dir(0o755)),
            (
                "usr/local/bin/tool".to_owned(),
                file(0o755, b"\x7fELF pretend"),
            ),
        ]);
        assert_eq!(entries, want);
    }

    #[test]
    fn same_inputs_give_the_same_bytes() {
        let tmp = TempDir::new("oci-determinism");
        let host = tmp.0.join("tool");
        fs::write(&host, b"binary").unwrap();
        let image = sample(&host);
        // The same entries added in another order.
        let mut reordered = Layer::new();
        for (path, entry) in image.layer.entries.iter().rev() {
            reordered
                .insert(path, entry.mode, entry.content.clone())
                .unwrap();
        }
        let other = Image {
            layer: reordered,
            ..image.clone()
        };
        let (a, b) = (tmp.0.join("a.tar"), tmp.0.join("b.tar"));
        let wa = write(&image, &a).unwrap();
        let wb = write(&other, &b).unwrap();
        assert_eq!(wa, wb);
        assert_eq!(fs::read(&a).unwrap(), fs::read(&b).unwrap());
        assert_eq!(image.fingerprint().unwrap(), other.fingerprint().unwrap());

        // A different file content is a different image.
        fs::write(&host, b"binary, rebuilt").unwrap();
        let wc = write(&image, &tmp.0.join("c.tar")).unwrap();
        assert_ne!(wa.manifest_digest, wc.manifest_digest);
    }

    #[test]
    fn cached_write_skips_unchanged_inputs() {
        let tmp = TempDir::new("oci-cache");
        let host = tmp.0.join("tool");
        fs::write(&host, b"one").unwrap();
        let image = sample(&host);
        let out = tmp.0.join("image.oci.tar");
        assert!(write_cached(&image, &out).unwrap());
        assert!(!write_cached(&image, &out).unwrap());
        // A changed input (size and mtime) is written again.
        fs::write(&host, b"three").unwrap();
        assert!(write_cached(&image, &out).unwrap());
        assert!(!write_cached(&image, &out).unwrap());
        // So is a missing archive.
        fs::remove_file(&out).unwrap();
        assert!(write_cached(&image, &out).unwrap());
        let (_, _, entries) = read_archive(&out);
        assert_eq!(entries["usr/local/bin/tool"].data, b"three");
    }

    #[test]
    fn bad_paths_are_refused() {
        let mut layer = Layer::new();
        assert!(layer.file("../etc/passwd", "x", 0o644).is_err());
        assert!(layer.file("/", "x", 0o644).is_err());
        assert!(layer.file("a/./b", "x", 0o644).is_err());
        assert!(layer.dir("tmp", 0o41777).is_err());
        assert!(layer.file("//a//b/", "x", 0o644).is_ok());
        assert!(layer.entries.contains_key("a/b"));
    }
}
