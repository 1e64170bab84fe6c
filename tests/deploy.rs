//! The deploy/ manifests: every YAML document parses into the k8s-openapi type of its kind with
//! no field lost (a misspelt field fails), the DaemonSet has what lb needs on a node, it only
//! passes flags `lb run` knows, and the RBAC rules stay minimal.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{Container, Namespace, Service, ServiceAccount},
        discovery::v1::EndpointSlice,
        rbac::v1::{ClusterRole, ClusterRoleBinding},
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use lb_tests::bins::LB;
use serde::{Deserialize as _, Serialize, de::DeserializeOwned};

const BPFFS: &str = "/sys/fs/bpf";
const HEALTHZ_PORT: i32 = 10256;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Every `*.yaml` in `dir`, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    files
}

/// The typed objects found, by kind.
#[derive(Default)]
struct Objects {
    daemonsets: Vec<DaemonSet>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    services: Vec<Service>,
    endpoint_slices: Vec<EndpointSlice>,
    namespaces: Vec<Namespace>,
    /// `kustomization.yaml` (not an API object: kubectl's `-k`), kept as YAML.
    kustomizations: Vec<serde_yaml::Value>,
}

/// Parses `doc` as `T` and checks that serializing it back gives the same document, so a
/// field k8s-openapi does not know (a typo, a wrong level) is not silently dropped.
fn typed<T: DeserializeOwned + Serialize>(doc: &serde_yaml::Value, what: &str) -> T {
    let obj: T = serde_yaml::from_value(doc.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
    let back = serde_json::to_value(&obj).unwrap();
    let orig = serde_json::to_value(doc).unwrap();
    assert_eq!(
        back, orig,
        "{what}: fields lost or changed in a round trip through k8s-openapi"
    );
    obj
}

fn parse_all(files: &[PathBuf]) -> Objects {
    let mut objs = Objects::default();
    for file in files {
        let text = fs::read_to_string(file).unwrap();
        for (i, de) in serde_yaml::Deserializer::from_str(&text).enumerate() {
            let doc = serde_yaml::Value::deserialize(de)
                .unwrap_or_else(|e| panic!("{} document {i}: {e}", file.display()));
            if doc.is_null() {
                continue; // an empty document (a trailing `---`)
            }
            let kind = doc["kind"].as_str().unwrap_or_default().to_string();
            let what = format!("{} document {i} ({kind})", file.display());
            match kind.as_str() {
                "DaemonSet" => objs.daemonsets.push(typed(&doc, &what)),
                "ServiceAccount" => objs.service_accounts.push(typed(&doc, &what)),
                "ClusterRole" => objs.cluster_roles.push(typed(&doc, &what)),
                "ClusterRoleBinding" => objs.cluster_role_bindings.push(typed(&doc, &what)),
                "Service" => objs.services.push(typed(&doc, &what)),
                "EndpointSlice" => objs.endpoint_slices.push(typed(&doc, &what)),
                "Namespace" => objs.namespaces.push(typed(&doc, &what)),
                "Kustomization" => objs.kustomizations.push(doc),
                other => panic!("{what}: unexpected kind {other:?}; teach tests/deploy.rs"),
            }
        }
    }
    objs
}

fn deploy_objects() -> Objects {
    parse_all(&yaml_files(&deploy_dir()))
}

#[test]
fn every_manifest_parses_into_its_kubernetes_type() {
    let top = yaml_files(&deploy_dir());
    let examples = yaml_files(&deploy_dir().join("examples"));
    for f in ["daemonset.yaml", "rbac.yaml"] {
        assert!(top.iter().any(|p| p.ends_with(f)), "deploy/{f} missing");
    }
    assert!(examples.len() >= 2, "{examples:?}");
    let objs = parse_all(&top);
    assert_eq!(objs.daemonsets.len(), 1);
    assert_eq!(objs.service_accounts.len(), 1);
    assert_eq!(objs.cluster_roles.len(), 1);
    assert_eq!(objs.cluster_role_bindings.len(), 1);
    let ex = parse_all(&examples);
    assert!(!ex.services.is_empty() && !ex.endpoint_slices.is_empty());
}

/// `kubectl apply -k deploy/` installs exactly the manifests of deploy/ (what `cargo xtask
/// e2e` overlays), each of which exists.
#[test]
fn the_kustomization_lists_every_manifest() {
    let objs = parse_all(&yaml_files(&deploy_dir()));
    assert_eq!(objs.kustomizations.len(), 1);
    let k = &objs.kustomizations[0];
    assert_eq!(
        k["apiVersion"].as_str(),
        Some("kustomize.config.k8s.io/v1beta1")
    );
    // Listed in apply order (RBAC before the DaemonSet that uses it); compared as a set.
    let mut resources: Vec<&str> = k["resources"]
        .as_sequence()
        .expect("resources")
        .iter()
        .map(|r| r.as_str().expect("a file name"))
        .collect();
    let manifests: Vec<String> = yaml_files(&deploy_dir())
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .filter(|f| f != "kustomization.yaml")
        .collect();
    resources.sort_unstable();
    assert_eq!(resources, manifests, "deploy/kustomization.yaml resources");
}

/// A type that fails to parse is an error, not a skipped document.
#[test]
fn unknown_fields_and_kinds_are_caught() {
    let doc: serde_yaml::Value =
        serde_yaml::from_str("apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: x}\nautomountServiceAccountTokn: false\n")
            .unwrap();
    let r = std::panic::catch_unwind(|| typed::<ServiceAccount>(&doc, "typo"));
    assert!(r.is_err(), "a misspelt field must fail");
    let dir = std::env::temp_dir().join(format!("lb-test-deploy-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let file = dir.join("x.yaml");
    fs::write(
        &file,
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
    )
    .unwrap();
    let r = std::panic::catch_unwind(|| parse_all(std::slice::from_ref(&file)));
    let _ = fs::remove_dir_all(&dir);
    assert!(r.is_err(), "an unknown kind must fail");
}

fn lb_container(ds: &DaemonSet) -> &Container {
    let spec = ds.spec.template.spec.as_ref().unwrap();
    spec.containers
        .iter()
        .find(|c| c.name == "lb")
        .expect("container lb")
}

#[test]
fn daemonset_has_what_lb_needs_on_a_node() {
    let objs = deploy_objects();
    let ds = &objs.daemonsets[0];
    assert_eq!(ds.metadata.name.as_deref(), Some("lb"));
    assert_eq!(ds.metadata.namespace.as_deref(), Some("kube-system"));
    let spec = &ds.spec;
    let strategy = spec.update_strategy.as_ref().unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    assert_eq!(
        strategy.rolling_update.as_ref().unwrap().max_unavailable,
        Some(IntOrString::Int(1))
    );
    let selector = spec.selector.match_labels.as_ref().unwrap();
    let labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .as_ref()
        .unwrap();
    for (k, v) in selector {
        assert_eq!(labels.get(k), Some(v), "template labels match the selector");
    }
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tolerations = pod.tolerations.as_ref().unwrap();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "tolerates every taint"
    );

    // The ServiceAccount is the one rbac.yaml creates, in the same namespace.
    let sa = &objs.service_accounts[0];
    assert_eq!(pod.service_account_name, sa.metadata.name);
    assert_eq!(ds.metadata.namespace, sa.metadata.namespace);

    // Least privilege: every capability dropped but exactly those `lb run` checks for at start
    // on a 5.8+ kernel (the first of each requirement's alternatives).
    let c = lb_container(ds);
    let capabilities = c
        .security_context
        .as_ref()
        .and_then(|s| s.capabilities.as_ref())
        .expect("capabilities");
    let list =
        |l: &Option<Vec<String>>| -> BTreeSet<String> { l.iter().flatten().cloned().collect() };
    assert_eq!(list(&capabilities.drop), BTreeSet::from(["ALL".to_owned()]));
    let needed: BTreeSet<String> = lb::privileges::needs(40)
        .iter()
        .map(|n| n.caps[0].name.trim_start_matches("CAP_").to_owned())
        .collect();
    assert_eq!(
        needed,
        BTreeSet::from(["BPF", "PERFMON", "NET_ADMIN"].map(String::from)),
        "what lb run checks for"
    );
    assert_eq!(
        list(&capabilities.add),
        needed,
        "the DaemonSet adds exactly that"
    );
    assert_ne!(
        c.security_context.as_ref().and_then(|s| s.privileged),
        Some(true),
        "the lb container is not privileged"
    );

    // NODE_NAME from the downward API, used for --hostname-override.
    let env = c.env.as_ref().unwrap();
    let node_name = env.iter().find(|e| e.name == "NODE_NAME").unwrap();
    let field = node_name
        .value_from
        .as_ref()
        .and_then(|v| v.field_ref.as_ref())
        .unwrap();
    assert_eq!(field.field_path, "spec.nodeName");
    let args = c.args.as_ref().unwrap();
    assert_eq!(args[0], "run");
    assert!(args.contains(&"--hostname-override=$(NODE_NAME)".to_string()));
    // Every $(VAR) in the args is defined in env, or Kubernetes passes it through verbatim.
    let defined: BTreeSet<&str> = env.iter().map(|e| e.name.as_str()).collect();
    for arg in args {
        for var in arg.split("$(").skip(1).filter_map(|s| s.split(')').next()) {
            assert!(defined.contains(var), "{arg}: ${var} not in env");
        }
    }

    // Volumes: bpffs, the cgroup v2 root and the state dir come from the host.
    let volumes: BTreeMap<&str, &str> = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .map(|v| {
            let host = v.host_path.as_ref().map(|h| h.path.as_str());
            (v.name.as_str(), host.unwrap_or_default())
        })
        .collect();
    let mounts: BTreeMap<&str, (&str, Option<&str>)> = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m.mount_path.as_str(),
                (volumes[m.name.as_str()], m.mount_propagation.as_deref()),
            )
        })
        .collect();
    let (bpffs_host, bpffs_prop) = mounts[BPFFS];
    assert_eq!(bpffs_host, BPFFS, "{mounts:?}");
    assert!(
        matches!(bpffs_prop, Some("HostToContainer" | "Bidirectional")),
        "pins made on the host must be visible: {bpffs_prop:?}"
    );
    assert!(
        mounts.values().any(|(host, _)| *host == "/sys/fs/cgroup"),
        "{mounts:?}"
    );
    assert!(mounts.contains_key("/run/lb"), "{mounts:?}");
    // The flags point at the mounts.
    let flag = |name: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(&format!("--{name}=")))
            .map(str::to_string)
    };
    let pin_dir = flag("pin-dir").unwrap_or_else(|| "/sys/fs/bpf/lb".into());
    assert!(Path::new(&pin_dir).starts_with(BPFFS), "{pin_dir}");
    let cgroup = flag("cgroup-path")
        .expect("--cgroup-path (the container's own /sys/fs/cgroup is not the host's)");
    assert!(mounts.contains_key(cgroup.as_str()), "{cgroup} is mounted");
    assert_eq!(flag("state-dir").as_deref(), Some("/run/lb"));

    // Kubernetes only allows Bidirectional propagation in privileged containers.
    let all = pod
        .init_containers
        .iter()
        .flatten()
        .chain(pod.containers.iter());
    for ct in all {
        let privileged = ct
            .security_context
            .as_ref()
            .and_then(|s| s.privileged)
            .unwrap_or(false);
        for m in ct.volume_mounts.iter().flatten() {
            if m.mount_propagation.as_deref() == Some("Bidirectional") {
                assert!(privileged, "{}: Bidirectional needs privileged", ct.name);
            }
        }
    }

    // Probes and ports: kube-proxy's healthz port.
    let http_get = |p: Option<&k8s_openapi::api::core::v1::Probe>| {
        let h = p.and_then(|p| p.http_get.as_ref()).expect("httpGet probe");
        (h.path.clone().unwrap_or_default(), h.port.clone())
    };
    assert_eq!(
        http_get(c.liveness_probe.as_ref()),
        ("/livez".to_string(), IntOrString::Int(HEALTHZ_PORT))
    );
    assert_eq!(
        http_get(c.readiness_probe.as_ref()),
        ("/healthz".to_string(), IntOrString::Int(HEALTHZ_PORT))
    );
    let ports: BTreeSet<i32> = c.ports.iter().flatten().map(|p| p.container_port).collect();
    assert_eq!(ports, BTreeSet::from([10249, HEALTHZ_PORT]));
    assert_eq!(
        flag("healthz-bind-address").as_deref(),
        Some("0.0.0.0:10256")
    );
}

/// The DaemonSet passes only flags this `lb run` accepts.
#[test]
fn daemonset_flags_exist_in_lb_run() {
    let objs = deploy_objects();
    let c = lb_container(&objs.daemonsets[0]);
    assert_eq!(c.command.as_deref(), Some(&["lb".to_string()][..]));
    let out = Command::new(LB).args(["run", "--help"]).output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for arg in c.args.as_ref().unwrap().iter().skip(1) {
        let name = arg.split('=').next().unwrap();
        assert!(
            name.starts_with("--") && help.contains(&format!("{name} ")),
            "`lb run` has no {name}:\n{help}"
        );
    }
}

#[test]
fn rbac_is_read_only_and_minimal() {
    let objs = deploy_objects();
    let role = &objs.cluster_roles[0];
    let allowed_verbs = BTreeSet::from(["get", "list", "watch"]);
    let mut resources = BTreeSet::new();
    for rule in role.rules.as_ref().unwrap() {
        for v in &rule.verbs {
            assert!(allowed_verbs.contains(v.as_str()), "verb {v}");
        }
        assert!(rule.non_resource_urls.is_none());
        assert!(rule.resource_names.is_none());
        for group in rule.api_groups.as_ref().unwrap() {
            for r in rule.resources.as_ref().unwrap() {
                assert!(!r.contains('*') && !group.contains('*'), "{group}/{r}");
                resources.insert((group.as_str(), r.as_str()));
            }
        }
    }
    assert_eq!(
        resources,
        BTreeSet::from([
            ("", "services"),
            ("", "nodes"),
            ("discovery.k8s.io", "endpointslices"),
        ])
    );
    assert!(role.aggregation_rule.is_none());

    // The binding ties exactly this role to exactly the DaemonSet's ServiceAccount.
    let binding = &objs.cluster_role_bindings[0];
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let sa = &objs.service_accounts[0];
    let subjects = binding.subjects.as_ref().unwrap();
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(Some(&subjects[0].name), sa.metadata.name.as_ref());
    assert_eq!(subjects[0].namespace, sa.metadata.namespace);
}

/// The image is `FROM scratch` with lb as its only file (no registry needed to build it, no
/// shell in it); its entry point and the DaemonSet's commands run that lb, and every command
/// they use exists. tests/image.rs builds it for real.
#[test]
fn containerfile_holds_the_binary_the_daemonset_runs() {
    let text = fs::read_to_string(deploy_dir().join("Containerfile")).unwrap();
    let instructions: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert_eq!(
        instructions,
        [
            "FROM scratch",
            "COPY lb /usr/local/bin/lb",
            "ENV PATH=/usr/local/bin",
            "ENTRYPOINT [\"/usr/local/bin/lb\"]",
            "CMD [\"run\"]",
        ],
        "a scratch image around lb; no RUN, which would need a shell"
    );

    // The DaemonSet's containers call lb by name (PATH above) with commands lb has.
    let ds = &deploy_objects().daemonsets[0];
    assert_eq!(
        lb_container(ds).command.as_deref(),
        Some(&["lb".to_string()][..])
    );
    let pod = ds.spec.template.spec.as_ref().unwrap();
    let inits: Vec<&Container> = pod.init_containers.iter().flatten().collect();
    assert!(!inits.is_empty(), "the bpffs init container");
    for init in &inits {
        let command = init.command.as_deref().unwrap_or_default();
        assert_eq!(
            command.first().map(String::as_str),
            Some("lb"),
            "{command:?}"
        );
        let out = Command::new(LB)
            .args(&command[1..])
            .arg("--help")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "init container {}: `lb {}` is not a command lb has: {}",
            init.name,
            command[1..].join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // Init containers run the same image, so the node pulls one image.
    let image = lb_container(ds).image.as_deref().unwrap();
    for init in pod.init_containers.iter().flatten() {
        assert_eq!(
            init.image.as_deref(),
            Some(image),
            "one image for all containers"
        );
    }
}
