//! Tests of the manifest-directory source (`lb::kube::manifests::load_dir`) on real temporary
//! directories.
use std::{
    fs,
    path::{Path, PathBuf},
    sync::atomic::{AtomicUsize, Ordering},
};

use lb::kube::manifests::{Objects, Problem, load_dir};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(test: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "lb-manifests-test-{}-{test}-{n}",
            std::process::id()
        ));
        if path.exists() {
            fs::remove_dir_all(&path).expect("remove a stale test dir");
        }
        fs::create_dir_all(&path).expect("create test dir");
        Self(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    /// Writes `text` to `rel`, creating parent directories.
    fn write(&self, rel: &str, text: &str) -> PathBuf {
        let p = self.0.join(rel);
        fs::create_dir_all(p.parent().expect("file has a parent")).expect("create parent");
        fs::write(&p, text).expect("write test file");
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn service(name: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: ns
spec:
  clusterIP: {ip}
  ports:
    - name: http
      protocol: TCP
      port: 80
"
    )
}

fn slice(name: &str, service: &str, addr: &str) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}
  namespace: ns
  labels:
    kubernetes.io/service-name: {service}
addressType: IPv4
ports:
  - name: http
    protocol: TCP
    port: 8080
endpoints:
  - addresses: [\"{addr}\"]
"
    )
}

fn service_names(o: &Objects) -> Vec<String> {
    o.services
        .iter()
        .map(|s| s.metadata.name.as_deref().unwrap_or_default().to_string())
        .collect()
}

fn slice_names(o: &Objects) -> Vec<String> {
    o.slices
        .iter()
        .map(|s| s.metadata.name.as_deref().unwrap_or_default().to_string())
        .collect()
}

fn load(dir: &TempDir) -> (Objects, Vec<Problem>) {
    load_dir(dir.path()).expect("the directory is readable")
}

#[test]
fn multi_document_yaml_loads_every_document() {
    let dir = TempDir::new("multidoc");
    dir.write(
        "all.yaml",
        &format!(
            "# leading comment\n---\n{}---\n{}---\n# an empty document\n---\n{}...\n",
            service("one", "198.19.0.1"),
            slice("one-1", "one", "198.18.0.1"),
            service("two", "198.19.0.2"),
        ),
    );
    let (o, problems) = load(&dir);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(service_names(&o), ["one", "two"]);
    assert_eq!(slice_names(&o), ["one-1"]);
    // The documents are really parsed, not just counted.
    let spec = o.services[1].spec.as_ref().expect("spec");
    assert_eq!(
        spec.cluster_ip.as_ref().map(ToString::to_string).as_deref(),
        Some("198.19.0.2")
    );
    assert_eq!(spec.ports[0].port, 80);
    let s = &o.slices[0];
    assert_eq!(&*s.address_type, "IPv4");
    assert_eq!(
        s.endpoints[0]
            .addr
            .as_ref()
            .map(ToString::to_string)
            .as_deref(),
        Some("198.18.0.1")
    );
    assert_eq!(s.service.as_deref(), Some("one"));
}

#[test]
fn yml_extension_is_read() {
    let dir = TempDir::new("yml");
    dir.write("svc.yml", &service("short-ext", "198.19.0.3"));
    let (o, problems) = load(&dir);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(service_names(&o), ["short-ext"]);
}

#[test]
fn json_file_loads() {
    let dir = TempDir::new("json");
    dir.write(
        "svc.json",
        r#"{
  "apiVersion": "v1",
  "kind": "Service",
  "metadata": {"name": "from-json", "namespace": "ns"},
  "spec": {
    "clusterIP": "198.19.0.4",
    "ports": [{"name": "http", "protocol": "TCP", "port": 80}]
  }
}
"#,
    );
    dir.write(
        "slice.json",
        r#"{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{"name":"from-json-1","namespace":"ns","labels":{"kubernetes.io/service-name":"from-json"}},"addressType":"IPv4","ports":[{"name":"http","protocol":"TCP","port":8080}],"endpoints":[{"addresses":["198.18.0.4"],"conditions":{"ready":true}}]}"#,
    );
    let (o, problems) = load(&dir);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(service_names(&o), ["from-json"]);
    assert_eq!(slice_names(&o), ["from-json-1"]);
    assert_eq!(
        o.services[0]
            .spec
            .as_ref()
            .and_then(|s| s.cluster_ip.as_ref())
            .map(ToString::to_string)
            .as_deref(),
        Some("198.19.0.4")
    );
}

#[test]
fn list_kinds_contribute_their_items() {
    let dir = TempDir::new("list");
    let indent = |doc: String| -> String {
        doc.lines()
            .enumerate()
            .map(|(i, l)| {
                if i == 0 {
                    format!("  - {l}\n")
                } else {
                    format!("    {l}\n")
                }
            })
            .collect()
    };
    dir.write(
        "list.yaml",
        &format!(
            "apiVersion: v1\nkind: List\nitems:\n{}{}",
            indent(service("listed", "198.19.0.5")),
            indent(slice("listed-1", "listed", "198.18.0.5")),
        ),
    );
    dir.write(
        "svclist.yaml",
        &format!(
            "apiVersion: v1\nkind: ServiceList\nmetadata: {{}}\nitems:\n{}",
            indent(service("in-service-list", "198.19.0.6")),
        ),
    );
    dir.write("empty-list.yaml", "apiVersion: v1\nkind: List\nitems: []\n");
    let (o, problems) = load(&dir);
    assert!(problems.is_empty(), "{problems:?}");
    let mut names = service_names(&o);
    names.sort();
    assert_eq!(names, ["in-service-list", "listed"]);
    assert_eq!(slice_names(&o), ["listed-1"]);
}

#[test]
fn a_bad_item_in_a_list_is_reported_and_the_other_items_load() {
    let dir = TempDir::new("badlist");
    let file = dir.write(
        "list.yaml",
        "apiVersion: v1
kind: List
items:
  - apiVersion: v1
    kind: Service
    metadata: {name: first, namespace: ns}
    spec: {clusterIP: 198.19.0.7}
  - metadata: {name: no-kind}
  - apiVersion: v1
    kind: Service
    metadata: {name: third, namespace: ns}
    spec: {clusterIP: 198.19.0.8}
",
    );
    let (o, problems) = load(&dir);
    assert_eq!(service_names(&o), ["first", "third"]);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].file, file);
    assert_eq!(problems[0].document, 0);
    assert!(problems[0].error.contains("item 1"), "{}", problems[0]);
}

#[test]
fn nested_subdirectories_are_read_in_path_order() {
    let dir = TempDir::new("nested");
    dir.write("z.yaml", &service("z", "198.19.0.9"));
    dir.write("sub/deeper/m.yaml", &service("m", "198.19.0.10"));
    dir.write("a.yaml", &service("a", "198.19.0.11"));
    dir.write("sub/b.json", &service("b", "198.19.0.12"));
    let (o, problems) = load(&dir);
    assert!(problems.is_empty(), "{problems:?}");
    // a.yaml < sub/b.json < sub/deeper/m.yaml < z.yaml
    assert_eq!(service_names(&o), ["a", "b", "m", "z"]);
}

#[test]
fn non_manifest_files_are_ignored() {
    let dir = TempDir::new("nonmanifest");
    // Each of these would add a service (or a problem) if it were read.
    dir.write("README.md", &service("from-readme", "198.19.0.13"));
    dir.write("notes.txt", "this: is: not: yaml: [");
    dir.write("svc.yaml.bak", &service("from-backup", "198.19.0.14"));
    dir.write("Makefile", "all:\n\ttrue\n");
    dir.write("sub/README", &service("from-sub-readme", "198.19.0.15"));
    dir.write("real.yaml", &service("real", "198.19.0.16"));
    let (o, problems) = load(&dir);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(service_names(&o), ["real"]);
}

#[test]
fn broken_document_is_a_problem_and_other_files_still_load() {
    let dir = TempDir::new("broken");
    let broken = dir.write(
        "b-broken.yaml",
        &format!(
            "{}---\nkind: Service\nmetadata: {{name: [unclosed\n",
            service("before-break", "198.19.0.17")
        ),
    );
    dir.write("a-good.yaml", &service("good-a", "198.19.0.18"));
    dir.write("c-good.yaml", &slice("good-c", "good-a", "198.18.0.18"));
    let (o, problems) = load(&dir);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].file, broken);
    assert_eq!(problems[0].document, 1, "{}", problems[0]);
    assert!(!problems[0].error.is_empty());
    let shown = problems[0].to_string();
    assert!(shown.contains("b-broken.yaml"), "{shown}");
    assert!(shown.contains("document 1"), "{shown}");
    let mut names = service_names(&o);
    names.sort();
    assert_eq!(
        names,
        ["before-break", "good-a"],
        "the document before the break and the other files load"
    );
    assert_eq!(slice_names(&o), ["good-c"]);
}

#[test]
fn broken_first_document_is_reported_as_document_zero() {
    let dir = TempDir::new("broken0");
    let broken = dir.write(
        "x.yaml",
        "apiVersion: v1\nkind: Service\n  bad: indentation\n",
    );
    dir.write("y.yaml", &service("fine", "198.19.0.19"));
    let (o, problems) = load(&dir);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].file, broken);
    assert_eq!(problems[0].document, 0);
    assert_eq!(service_names(&o), ["fine"]);
}

#[test]
fn broken_json_is_a_problem() {
    let dir = TempDir::new("brokenjson");
    let broken = dir.write(
        "bad.json",
        r#"{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x""#,
    );
    dir.write("good.yaml", &service("fine", "198.19.0.20"));
    let (o, problems) = load(&dir);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].file, broken);
    assert_eq!(problems[0].document, 0);
    assert_eq!(service_names(&o), ["fine"]);
}

#[test]
fn objects_without_api_version_or_kind_are_reported() {
    let dir = TempDir::new("nokind");
    let file = dir.write(
        "mixed.yaml",
        &format!(
            "{}---\nkind: Service\nmetadata: {{name: no-api-version}}\n---\napiVersion: v1\nmetadata: {{name: no-kind}}\n---\njust a string\n---\n{}",
            service("ok-1", "198.19.0.21"),
            service("ok-2", "198.19.0.22"),
        ),
    );
    let (o, problems) = load(&dir);
    assert_eq!(service_names(&o), ["ok-1", "ok-2"]);
    let docs: Vec<usize> = problems.iter().map(|p| p.document).collect();
    assert_eq!(docs, [1, 2, 3], "{problems:?}");
    for p in &problems {
        assert_eq!(p.file, file);
        assert!(
            p.error.contains("apiVersion") && p.error.contains("kind"),
            "{p}"
        );
    }
}

#[test]
fn service_with_wrongly_typed_fields_is_a_problem() {
    let dir = TempDir::new("badtype");
    let file = dir.write(
        "svc.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: bad}}\nspec:\n  ports:\n    - port: eighty\n---\n{}",
            service("good", "198.19.0.23")
        ),
    );
    let (o, problems) = load(&dir);
    assert_eq!(service_names(&o), ["good"]);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].file, file);
    assert_eq!(problems[0].document, 0);
}

#[test]
fn other_kinds_are_silently_ignored() {
    let dir = TempDir::new("otherkinds");
    dir.write(
        "app.yaml",
        &format!(
            "apiVersion: apps/v1
kind: Deployment
metadata: {{name: web}}
spec:
  replicas: 3
---
apiVersion: v1
kind: ConfigMap
metadata: {{name: cfg}}
data: {{a: b}}
---
apiVersion: v1
kind: Endpoints
metadata: {{name: legacy}}
---
{}",
            service("web", "198.19.0.24")
        ),
    );
    let (o, problems) = load(&dir);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(service_names(&o), ["web"]);
    assert!(o.slices.is_empty());
}

#[test]
fn wrong_api_version_for_a_known_kind_is_not_loaded_as_that_kind() {
    // An EndpointSlice of the long-gone v1beta1 API must not be read as a v1 one.
    let dir = TempDir::new("apiversion");
    dir.write(
        "old.yaml",
        &slice("old", "web", "198.18.0.25")
            .replace("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1"),
    );
    dir.write("new.yaml", &slice("new", "web", "198.18.0.26"));
    let (o, problems) = load(&dir);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(slice_names(&o), ["new"]);
}

#[test]
fn empty_directory_and_empty_files_give_nothing() {
    let dir = TempDir::new("empty");
    let (o, problems) = load(&dir);
    assert!(problems.is_empty() && o.services.is_empty() && o.slices.is_empty());
    dir.write("empty.yaml", "");
    dir.write("comments.yaml", "# nothing here\n---\n---\n");
    let (o, problems) = load(&dir);
    assert!(problems.is_empty(), "{problems:?}");
    assert!(o.services.is_empty() && o.slices.is_empty());
}

#[test]
fn missing_directory_is_an_error() {
    let dir = TempDir::new("missing");
    let missing = dir.path().join("does-not-exist");
    let err = load_dir(&missing).expect_err("a missing directory cannot be loaded");
    assert!(
        format!("{err:#}").contains("does-not-exist"),
        "the error names the directory: {err:#}"
    );
}

#[test]
fn a_file_instead_of_a_directory_is_an_error() {
    let dir = TempDir::new("notadir");
    let file = dir.write("svc.yaml", &service("x", "198.19.0.27"));
    assert!(load_dir(&file).is_err());
}

#[test]
fn loaded_objects_translate() {
    // The two halves together: what load_dir reads is what desired_state consumes.
    let dir = TempDir::new("translate");
    dir.write("svc.yaml", &service("web", "198.19.0.28"));
    dir.write("slices/web-1.yaml", &slice("web-1", "web", "198.18.0.28"));
    dir.write("slices/web-2.json", &slice("web-2", "web", "198.18.0.29"));
    let (o, problems) = load(&dir);
    assert!(problems.is_empty(), "{problems:?}");
    let t =
        lb::translate::desired_state(&o.services, &o.slices, &lb::translate::NodeInfo::default());
    assert!(t.skipped.is_empty(), "{:?}", t.skipped);
    let entries: Vec<_> = t.state.services.iter().collect();
    assert_eq!(entries.len(), 1);
    let (fe, entry) = entries[0];
    assert_eq!(fe.to_string(), "198.19.0.28:80/TCP");
    let backends: Vec<String> = entry.backends.iter().map(|b| b.l4.to_string()).collect();
    assert_eq!(backends, ["198.18.0.28:8080/TCP", "198.18.0.29:8080/TCP"]);
}

#[test]
fn temp_dirs_are_cleaned_up() {
    let path = {
        let dir = TempDir::new("cleanup");
        dir.write("a/b.yaml", "");
        dir.path().to_path_buf()
    };
    assert!(!path.exists());
}

#[test]
fn tab_indented_json_loads() {
    // Valid JSON as many editors and `jq --tab` write it.
    let dir = TempDir::new("tabjson");
    dir.write(
        "svc.json",
        "{\n\t\"apiVersion\": \"v1\",\n\t\"kind\": \"Service\",\n\t\"metadata\": {\n\t\t\"name\": \"tabbed\",\n\t\t\"namespace\": \"ns\"\n\t},\n\t\"spec\": {\n\t\t\"clusterIP\": \"198.19.0.30\",\n\t\t\"ports\": [\n\t\t\t{\"name\": \"http\", \"port\": 80}\n\t\t]\n\t}\n}\n",
    );
    let (o, problems) = load(&dir);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(service_names(&o), ["tabbed"]);
}

#[test]
fn node_objects_are_loaded_for_the_node_facts() {
    let dir = TempDir::new("nodes");
    dir.write(
        "node.yaml",
        "apiVersion: v1
kind: Node
metadata:
  name: node-a
  labels: {topology.kubernetes.io/zone: zone-1}
---
apiVersion: v1
kind: NodeList
items:
  - apiVersion: v1
    kind: Node
    metadata: {name: node-b}
",
    );
    let (o, problems) = load(&dir);
    assert!(problems.is_empty(), "{problems:?}");
    let names: Vec<_> = o
        .nodes
        .iter()
        .map(|n| n.metadata.name.as_deref().unwrap_or_default().to_string())
        .collect();
    assert_eq!(names, ["node-a", "node-b"]);
    let info = lb::translate::NodeInfo::from_node("node-a", o.nodes.first());
    assert_eq!(info.name, "node-a");
    assert_eq!(info.zone.as_deref(), Some("zone-1"));
    assert_eq!(
        lb::translate::NodeInfo::from_node("node-b", o.nodes.get(1)).zone,
        None
    );
}
