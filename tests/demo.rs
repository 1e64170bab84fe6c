//! `lb-demo --kubernetes` (what `cargo xtask demo --kubernetes` runs) end to end: the real
//! control plane, kubectl-made objects, lb following the API, every target spread over the
//! three Pods. The demo's own exit code says whether every request succeeded and every backend
//! was reached; the test also reads its summary. Needs root.
use std::process::Command;

#[test]
fn kubernetes_demo_passes() {
    let out = Command::new(env!("CARGO_BIN_EXE_lb-demo"))
        .args(["--kubernetes", "--requests", "30"])
        .output()
        .expect("run lb-demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "lb-demo --kubernetes: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("\nPASS: all 120 requests succeeded"),
        "{stdout}"
    );
    // The controller's slices (generated names `echo-xxxxx`), one per family, listing the Pods.
    let slices: Vec<&str> = stdout
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("echo-") && (l.contains(" IPv4 ") || l.contains(" IPv6 ")))
        .collect();
    assert_eq!(slices.len(), 2, "kubectl get endpointslices: {stdout}");
    for pod in ["198.18.11.2", "198.18.12.2", "198.18.13.2"] {
        assert!(slices.iter().any(|l| l.contains(pod)), "{pod}: {slices:?}");
    }
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.trim_start().starts_with("kubernetes "))
        .collect();
    assert_eq!(rows.len(), 4, "{stdout}");
    for row in rows {
        assert!(row.contains("30/30") && row.contains(" 3/3 "), "{row}");
    }
}
