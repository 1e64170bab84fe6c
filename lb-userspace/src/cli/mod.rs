//! The `lb` command line: the clap definitions and what each command runs. `lb run` is the
//! daemon (`daemon`); the other commands only read a running lb's pinned maps
//! (`inspect`, `trace`).
pub mod inspect;
pub mod trace;

use std::{net::SocketAddr, path::PathBuf};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use lb_common::DEFAULT_PIN_DIR;

use crate::{
    config::DeviceArgs,
    daemon::{self, RunOptions, SourceConfig},
    datapath::cgroup::cgroup2_root,
    kube::k8s,
};

#[derive(Parser)]
#[command(
    name = "lb",
    version,
    about = "eBPF service load balancer replacing kube-proxy"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load the datapath, program it from a source and keep it in sync.
    Run(RunArgs),
    /// List the service frontends programmed in the pinned maps, with their backends.
    Services(inspect::ServicesArgs),
    /// List every backend in the pinned maps and how many frontends use it.
    Backends(inspect::PinDirArgs),
    /// Show the kernel, lb's loaded programs and attachments, map fill levels and counters.
    Status(inspect::PinDirArgs),
    /// Run a synthetic packet through the real datapath (BPF_PROG_TEST_RUN) and show where it
    /// goes and why; never changes live conntrack.
    Trace(trace::TraceArgs),
    /// Probe the kernel features lb adapts to and show which fallbacks it would take.
    Features(FeaturesArgs),
    /// Detach lb's programs for good (they stay attached when `lb run` exits, so a restart
    /// or upgrade loses nothing); the pinned maps stay.
    Detach(inspect::PinDirArgs),
    /// Mount bpffs at a path unless one is mounted there already (the DaemonSet's init
    /// container runs this: the image has no shell and no `mount`).
    MountBpffs(MountBpffsArgs),
}

#[derive(clap::Args)]
struct MountBpffsArgs {
    /// Where bpffs belongs.
    #[arg(long, default_value = "/sys/fs/bpf")]
    path: PathBuf,
}

#[derive(clap::Args)]
struct FeaturesArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Directory of Service, EndpointSlice (and Node) manifests, watched for changes; SIGHUP
    /// re-reads it. The default source when no cluster is configured.
    #[arg(long, conflicts_with = "kubeconfig")]
    manifests: Option<PathBuf>,
    /// Kubeconfig for the Kubernetes API source (in a pod the in-cluster config is used).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// This node's name, compared with endpoints' nodeName [default: $NODE_NAME or the hostname].
    #[arg(long)]
    hostname_override: Option<String>,
    /// bpffs directory where the maps are pinned and reused across restarts.
    #[arg(long, default_value = DEFAULT_PIN_DIR)]
    pin_dir: PathBuf,
    /// Socket-level load balancing (connect/sendmsg/recvmsg/getpeername hooks).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    socket_lb: bool,
    /// cgroup v2 directory the socket-LB programs attach to [default: the cgroup v2 root].
    #[arg(long)]
    cgroup_path: Option<PathBuf>,
    /// External-facing interfaces whose tc ingress gets per-packet service NAT, with the
    /// frontends' external scope (comma-separated or repeated).
    #[arg(long, value_delimiter = ',')]
    tc_ingress: Vec<String>,
    /// Pod-facing interfaces (host side of pod veths) whose tc ingress gets per-packet service
    /// NAT for in-cluster traffic (the frontends' internal scope, like socket LB).
    #[arg(long, value_delimiter = ',')]
    tc_pod: Vec<String>,
    /// Interfaces whose tc egress gets reverse NAT of replies.
    #[arg(long, value_delimiter = ',')]
    tc_egress: Vec<String>,
    /// Pod-facing devices that get `lb_tc_pod` (in-cluster NAT and the reverse NAT of local
    /// backends' replies): `auto`, every veth of lb's network namespace that is not an external
    /// device, also those created later (watched); `none`; or a comma-separated list (the same
    /// as --tc-pod) [default: auto, unless a --tc-* list lays the hooks out by hand].
    #[arg(long, value_parser = parse_pod_devices)]
    pod_devices: Option<PodDevices>,
    #[command(flatten)]
    devices: DeviceArgs,
    /// Prometheus metrics address (kube-proxy's default); "off" disables metrics and health.
    #[arg(long, default_value = "127.0.0.1:10249")]
    metrics_bind_address: String,
    /// /healthz and /livez address (kube-proxy's default).
    #[arg(long, default_value = "0.0.0.0:10256")]
    healthz_bind_address: String,
    /// Directory for runtime state shared with `lb services` (frontend names).
    #[arg(long, default_value = crate::state_dir::DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// Map size override, `NAME=ENTRIES` (repeatable), e.g. `lb4_services=1048576`. A pinned map
    /// of another size is refused: resizing needs a fresh pin directory.
    #[arg(long, value_parser = parse_map_max)]
    bpf_map_max: Vec<(String, u32)>,
    #[command(flatten)]
    ct: crate::datapath::conntrack::CtArgs,
    /// Seconds between passes of the conntrack GC, which deletes expired and closed entries
    /// and those of removed backends (a sync that removes backends also starts one at once).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    ct_gc_interval: u64,
    #[command(flatten)]
    node_facts: crate::node::NodeFactsArgs,
    #[command(flatten)]
    algorithm: crate::config::AlgorithmArgs,
    /// Seconds each Kubernetes watch request lasts (`timeoutSeconds`; kube-rs' default) before
    /// it is resumed; a silent connection counts as dead 5-10 s after that.
    #[arg(long, default_value_t = 290, value_parser = clap::value_parser!(u64).range(1..=3600))]
    watch_timeout: u64,
    /// How often a sync is a full one (the maps re-read, every object translated, every
    /// frontend compared), repairing what the incremental syncs in between cannot see (a map
    /// written by someone else), like kube-proxy's `--iptables-sync-period`: `300s`, `5m`,
    /// `1h`; `0` never.
    #[arg(long, default_value = "5m", value_parser = parse_interval)]
    full_sync_interval: std::time::Duration,
}

/// `--pod-devices`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodDevices {
    Auto,
    None,
    List(Vec<String>),
}

fn parse_pod_devices(s: &str) -> Result<PodDevices, String> {
    Ok(match s {
        "auto" => PodDevices::Auto,
        "none" => PodDevices::None,
        list => {
            let names: Vec<String> = list
                .split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(str::to_owned)
                .collect();
            if names.is_empty() {
                return Err("`auto`, `none` or a comma-separated list of devices".into());
            }
            PodDevices::List(names)
        }
    })
}

/// `--pod-devices` with the `--tc-*` lists: (the hand-listed pod devices, whether lb finds the
/// rest itself). The default finds them unless the hooks are laid out by hand.
pub fn pod_devices(
    arg: Option<PodDevices>,
    tc_ingress: &[String],
    mut tc_pod: Vec<String>,
    tc_egress: &[String],
) -> (Vec<String>, bool) {
    let by_hand = !(tc_ingress.is_empty() && tc_pod.is_empty() && tc_egress.is_empty());
    let auto = match arg {
        None => !by_hand,
        Some(PodDevices::Auto) => true,
        Some(PodDevices::None) => false,
        Some(PodDevices::List(l)) => {
            for n in l {
                if !tc_pod.contains(&n) {
                    tc_pod.push(n);
                }
            }
            false
        }
    };
    (tc_pod, auto)
}

/// A duration as `N`, `Ns`, `Nm` or `Nh` (seconds, minutes, hours).
fn parse_interval(s: &str) -> Result<std::time::Duration, String> {
    let (n, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?}: not a number of s, m or h"))?;
    let secs = match unit {
        "s" => n,
        "m" => n.saturating_mul(60),
        "h" => n.saturating_mul(3600),
        _ => return Err(format!("{s:?}: the unit is s, m or h")),
    };
    Ok(std::time::Duration::from_secs(secs))
}

fn parse_map_max(s: &str) -> Result<(String, u32), String> {
    let (name, n) = s.split_once('=').ok_or("want NAME=ENTRIES")?;
    let n = n.parse().map_err(|e| format!("{n:?}: {e}"))?;
    Ok((name.to_string(), n))
}

/// Manifests used when neither --manifests nor a cluster is configured.
const DEFAULT_MANIFESTS: &str = "/etc/lb/manifests";

fn node_name(arg: Option<String>) -> anyhow::Result<String> {
    if let Some(n) = arg.or_else(|| std::env::var("NODE_NAME").ok()) {
        return Ok(n);
    }
    let host =
        std::fs::read_to_string("/proc/sys/kernel/hostname").context("reading the hostname")?;
    Ok(host.trim().to_lowercase())
}

fn parse_addr(s: &str) -> anyhow::Result<Option<SocketAddr>> {
    if s == "off" {
        return Ok(None);
    }
    s.parse()
        .map(Some)
        .with_context(|| format!("bad address {s:?} (want IP:PORT or off)"))
}

/// Runs the command `cli` names.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Trace(args) => {
            let name = args.hostname_override.clone();
            trace::run(&args, || node_name(name))
        }
        Command::Run(args) => daemon::run(run_options(args)?).await,
        Command::Services(args) => inspect::services_cmd(&args),
        Command::Backends(args) => inspect::backends_cmd(&args),
        Command::Status(args) => inspect::status_cmd(&args),
        Command::Detach(args) => detach_cmd(&args),
        Command::MountBpffs(args) => mount_bpffs_cmd(&args),
        Command::Features(args) => features_cmd(&args),
    }
}

/// The daemon's options from `lb run`'s flags: the source, the cgroup, the pod devices and
/// the listen addresses resolved.
fn run_options(args: RunArgs) -> anyhow::Result<RunOptions> {
    let cgroup = if args.socket_lb {
        Some(match args.cgroup_path {
            Some(p) => p,
            None => cgroup2_root()?,
        })
    } else {
        None
    };
    let source = match (args.manifests, args.kubeconfig) {
        (Some(dir), _) => SourceConfig::Manifests(dir),
        (None, Some(kc)) => SourceConfig::Kubernetes {
            kubeconfig: Some(kc),
        },
        (None, None) if k8s::cluster_configured() => SourceConfig::Kubernetes { kubeconfig: None },
        (None, None) => SourceConfig::Manifests(DEFAULT_MANIFESTS.into()),
    };
    // One server task serves both; "off" for either turns both off.
    let (metrics_addr, healthz_addr) = match (
        parse_addr(&args.metrics_bind_address)?,
        parse_addr(&args.healthz_bind_address)?,
    ) {
        (Some(m), Some(h)) => (Some(m), Some(h)),
        _ => (None, None),
    };
    let (tc_pod, pod_devices_auto) = pod_devices(
        args.pod_devices,
        &args.tc_ingress,
        args.tc_pod,
        &args.tc_egress,
    );
    Ok(RunOptions {
        source,
        node_name: node_name(args.hostname_override)?,
        pin_dir: args.pin_dir,
        cgroup,
        tc_ingress: args.tc_ingress,
        tc_pod,
        pod_devices_auto,
        tc_egress: args.tc_egress,
        devices: args.devices.devices,
        xdp: args.devices.xdp,
        metrics_addr,
        healthz_addr,
        state_dir: args.state_dir,
        // The conntrack sizes, unless --bpf-map-max names the map itself.
        map_max: args
            .ct
            .map_sizes()
            .into_iter()
            .map(|(n, v)| (n.to_string(), v))
            .chain(args.bpf_map_max)
            .collect(),
        ct_timeouts: args.ct.timeouts(),
        ct_gc_interval: std::time::Duration::from_secs(args.ct_gc_interval),
        node_facts: args.node_facts,
        algorithm: args.algorithm,
        watch_timeout: std::time::Duration::from_secs(args.watch_timeout),
        full_sync_interval: args.full_sync_interval,
    })
}

/// `lb detach`: removes the pinned tc links of lb's programs and says which.
fn detach_cmd(args: &inspect::PinDirArgs) -> anyhow::Result<()> {
    use aya::programs::TcAttachType;
    use lb_common::prog_names;
    let removed = crate::datapath::links::detach_all(
        &args.pin_dir,
        &[
            (prog_names::TC_INGRESS, TcAttachType::Ingress),
            (prog_names::TC_POD, TcAttachType::Ingress),
            (prog_names::TC_EGRESS, TcAttachType::Egress),
        ],
    )?;
    if args.json {
        println!("{}", serde_json::to_string(&removed)?);
    } else if removed.is_empty() {
        println!("nothing attached under {}", args.pin_dir.display());
    } else {
        for r in &removed {
            println!("detached {r}");
        }
    }
    Ok(())
}

/// `lb mount-bpffs`.
fn mount_bpffs_cmd(args: &MountBpffsArgs) -> anyhow::Result<()> {
    let mounted = crate::datapath::load::mount_bpffs(&args.path)?;
    let path = args.path.display();
    if mounted {
        println!("mounted bpffs at {path}");
    } else {
        println!("bpffs already mounted at {path}");
    }
    Ok(())
}

/// `lb features`.
fn features_cmd(args: &FeaturesArgs) -> anyhow::Result<()> {
    let f = crate::datapath::features::probe(&args.devices.devices, args.devices.xdp);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&f)?);
    } else {
        print!("Kernel {}\n{}", f.release, f.render());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_devices_default_to_auto_unless_laid_out_by_hand() {
        let none: &[String] = &[];
        let eth = vec!["eth0".to_string()];
        assert_eq!(pod_devices(None, none, vec![], none), (vec![], true));
        assert_eq!(pod_devices(None, &eth, vec![], none), (vec![], false));
        assert_eq!(
            pod_devices(None, none, vec!["cni0".into()], none),
            (vec!["cni0".into()], false)
        );
        assert_eq!(
            pod_devices(Some(PodDevices::Auto), &eth, vec![], none),
            (vec![], true)
        );
        assert_eq!(
            pod_devices(Some(PodDevices::None), none, vec![], none),
            (vec![], false)
        );
        assert_eq!(
            pod_devices(
                Some(parse_pod_devices("a,b").unwrap()),
                none,
                vec!["a".into()],
                none
            ),
            (vec!["a".into(), "b".into()], false)
        );
        assert!(parse_pod_devices(",").is_err());
    }
}
