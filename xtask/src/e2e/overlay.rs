//! The kustomize overlay that installs lb on the e2e cluster from deploy/ as it is
//! (`kubectl apply -k`, kustomize being built into kubectl): it sets only this cluster's facts
//! — the image, the external device, the API server's address, the hybrid host's cgroup v2
//! mount, and per-node cgroup, pin and state directories (every "node" here shares one kernel,
//! one bpffs and one cgroup tree; on a real cluster those defaults are right).

use std::path::Path;

use anyhow::{Context as _, Result, ensure};
use serde_json::json;

/// This cluster's facts for lb.
#[derive(Clone, Debug)]
pub struct Facts {
    /// `registry.example.invalid/lb:<version>`, imported into every node.
    pub image: String,
    /// `LB_DEVICES`: the node netns' uplink.
    pub devices: String,
    pub apiserver_host: String,
    pub apiserver_port: u16,
    /// The cgroup v2 mount on this (hybrid) host, for the `cgroup` hostPath volume.
    pub cgroup2_mount: String,
    /// The parent of every node's kubelet `cgroupRoot`, relative to the cgroup v2 root; each
    /// node's lb attaches socket LB to `<this>/<node name>`.
    pub node_cgroup_parent: String,
    pub cluster_cidr: String,
    pub service_cidr: String,
    /// Extra `lb run` flags (`--name=value`), e.g. while a datapath feature lands.
    pub extra_args: Vec<String>,
}

/// The `lb` container's args in deploy/daemonset.yaml.
pub fn deploy_args(daemonset_yaml: &str) -> Result<Vec<String>> {
    let ds: serde_json::Value =
        serde_yaml::from_str(daemonset_yaml).context("parsing deploy/daemonset.yaml")?;
    let containers = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .context("deploy/daemonset.yaml has no containers")?;
    let lb = containers
        .iter()
        .find(|c| c["name"] == "lb")
        .context("deploy/daemonset.yaml has no `lb` container")?;
    lb["args"]
        .as_array()
        .context("the lb container has no args")?
        .iter()
        .map(|a| a.as_str().map(str::to_owned).context("a non-string arg"))
        .collect()
}

/// `base` with each `--flag=value` of `set` replacing that flag's value, or appended.
pub fn override_args(base: &[String], set: &[String]) -> Vec<String> {
    let flag = |arg: &str| arg.split('=').next().unwrap_or(arg).to_owned();
    let mut out: Vec<String> = base.to_vec();
    for new in set {
        let name = flag(new);
        match out.iter_mut().find(|a| flag(a) == name) {
            Some(old) => old.clone_from(new),
            None => out.push(new.clone()),
        }
    }
    out
}

/// The overlay's `kustomization.yaml` (JSON, which is YAML), with `deploy_dir` (deploy/ as a
/// kustomization) as its only resource, given relative to the overlay directory.
pub fn kustomization(facts: &Facts, deploy_relative: &str, base_args: &[String]) -> Result<String> {
    let (name, tag) = facts
        .image
        .rsplit_once(':')
        .filter(|(_, tag)| !tag.contains('/'))
        .context("the image has no tag")?;
    ensure!(
        name == crate::image::REPOSITORY,
        "the lb image {} is not {}",
        facts.image,
        crate::image::REPOSITORY
    );
    let mut set = vec![
        // Per node: the kubelet cgroupRoot (socket LB sees only that node's pods) and the pin
        // and state directories (one bpffs and one /run for all nodes here).
        format!(
            "--cgroup-path=/host/sys/fs/cgroup/{}/$(NODE_NAME)",
            facts.node_cgroup_parent.trim_matches('/')
        ),
        "--pin-dir=/sys/fs/bpf/lb-$(NODE_NAME)".to_owned(),
        "--state-dir=/run/lb/$(NODE_NAME)".to_owned(),
        format!("--cluster-cidr={}", facts.cluster_cidr),
        format!("--service-cidr={}", facts.service_cidr),
    ];
    set.extend(facts.extra_args.iter().cloned());
    let args = override_args(base_args, &set);
    let patch = json!({
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": { "name": "lb", "namespace": "kube-system" },
        "spec": { "template": { "spec": {
            "containers": [{
                "name": "lb",
                "args": args,
                "env": [
                    { "name": "LB_DEVICES", "value": facts.devices },
                    { "name": "KUBERNETES_SERVICE_HOST", "value": facts.apiserver_host },
                    { "name": "KUBERNETES_SERVICE_PORT", "value": facts.apiserver_port.to_string() },
                ],
            }],
            "volumes": [{
                "name": "cgroup",
                "hostPath": { "path": facts.cgroup2_mount, "type": "Directory" },
            }],
        }}},
    });
    let kustomization = json!({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [deploy_relative],
        "images": [{ "name": name, "newName": name, "newTag": tag }],
        "patches": [{
            "target": { "kind": "DaemonSet", "name": "lb" },
            "patch": serde_json::to_string_pretty(&patch)?,
        }],
    });
    Ok(format!(
        "# Generated by `cargo xtask e2e` (xtask/src/e2e/overlay.rs): deploy/ with this \
         cluster's facts.\n{}\n",
        serde_json::to_string_pretty(&kustomization)?
    ))
}

/// Writes the overlay into `dir` (created) for `deploy_dir`; returns the directory.
pub fn write(dir: &Path, deploy_dir: &Path, facts: &Facts) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let daemonset = std::fs::read_to_string(deploy_dir.join("daemonset.yaml"))
        .context("reading deploy/daemonset.yaml")?;
    let relative = relative_path(dir, deploy_dir)?;
    let text = kustomization(facts, &relative, &deploy_args(&daemonset)?)?;
    std::fs::write(dir.join("kustomization.yaml"), text).context("writing kustomization.yaml")
}

/// `to` relative to the directory `from` (both absolute): kustomize takes directories outside
/// the overlay only as relative paths.
fn relative_path(from: &Path, to: &Path) -> Result<String> {
    ensure!(
        from.is_absolute() && to.is_absolute(),
        "relative_path needs absolute paths"
    );
    let from: Vec<_> = from.components().collect();
    let to: Vec<_> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut parts: Vec<String> = vec!["..".to_owned(); from.len() - common];
    parts.extend(
        to[common..]
            .iter()
            .map(|c| c.as_os_str().to_string_lossy().into_owned()),
    );
    Ok(if parts.is_empty() {
        ".".to_owned()
    } else {
        parts.join("/")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> Facts {
        Facts {
            image: format!("{}:1.2.3", crate::image::REPOSITORY),
            devices: "eth0".to_owned(),
            apiserver_host: "198.19.250.1".to_owned(),
            apiserver_port: 6443,
            cgroup2_mount: "/sys/fs/cgroup/unified".to_owned(),
            node_cgroup_parent: "/a/e2e-1".to_owned(),
            cluster_cidr: "198.19.160.0/21".to_owned(),
            service_cidr: "198.19.128.0/20".to_owned(),
            extra_args: vec!["--xdp=off".to_owned()],
        }
    }

    #[test]
    fn override_replaces_or_appends() {
        let base = ["run", "--pin-dir=/sys/fs/bpf/lb", "--xdp=auto"].map(String::from);
        let out = override_args(&base, &["--xdp=off".into(), "--new=1".into()]);
        assert_eq!(
            out,
            ["run", "--pin-dir=/sys/fs/bpf/lb", "--xdp=off", "--new=1"]
        );
    }

    #[test]
    fn the_deploy_daemonset_has_args_and_the_overlay_sets_only_facts() {
        let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        let ds = std::fs::read_to_string(deploy.join("daemonset.yaml")).unwrap();
        let base = deploy_args(&ds).unwrap();
        assert_eq!(base[0], "run");
        let text = kustomization(&facts(), "../../deploy", &base).unwrap();
        let k: serde_json::Value = serde_yaml::from_str(&text).expect("the kustomization is YAML");
        assert_eq!(k["resources"][0], "../../deploy");
        assert_eq!(k["images"][0]["newTag"], "1.2.3");
        let patch: serde_json::Value =
            serde_json::from_str(k["patches"][0]["patch"].as_str().unwrap()).unwrap();
        let c = &patch["spec"]["template"]["spec"]["containers"][0];
        let args: Vec<&str> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        // Every flag of deploy/ is still there, once.
        for a in &base {
            let flag = a.split('=').next().unwrap();
            assert_eq!(
                args.iter()
                    .filter(|x| x.split('=').next() == Some(flag))
                    .count(),
                1,
                "{flag} in {args:?}"
            );
        }
        assert!(args.contains(&"--cgroup-path=/host/sys/fs/cgroup/a/e2e-1/$(NODE_NAME)"));
        assert!(args.contains(&"--pin-dir=/sys/fs/bpf/lb-$(NODE_NAME)"));
        assert!(args.contains(&"--xdp=off"), "{args:?}");
        assert!(args.contains(&"--service-cidr=198.19.128.0/20"));
        assert_eq!(c["env"][0]["value"], "eth0");
        assert_eq!(c["env"][2]["value"], "6443");
        assert_eq!(
            patch["spec"]["template"]["spec"]["volumes"][0]["hostPath"]["path"],
            "/sys/fs/cgroup/unified"
        );
    }

    #[test]
    fn wrong_image_is_refused() {
        let mut f = facts();
        f.image = "other/lb:1".to_owned();
        assert!(kustomization(&f, ".", &[]).is_err());
    }

    #[test]
    fn relative_paths() {
        assert_eq!(
            relative_path(Path::new("/w/target/e2e/r/lb"), Path::new("/w/deploy")).unwrap(),
            "../../../../deploy"
        );
        assert_eq!(
            relative_path(Path::new("/a"), Path::new("/a")).unwrap(),
            "."
        );
    }
}
