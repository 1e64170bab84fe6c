//! The plain option types more than one layer uses: `lb run`'s and `lb trace`'s shared flags
//! (devices and XDP, the load-balancing algorithm, conntrack sizes and lifetimes) and their
//! parsers. The ground of lb-userspace: it imports nothing of lb's but `model`, so the command
//! line (`cli`), the daemon (`daemon`) and the loader (`datapath::load`) all take
//! their options from here and no one of them imports another for a type.
use std::path::Path;

use lb_common::{ct_timeouts, map_names, map_sizes};

use crate::model::LbAlgorithm;

/// The external devices and how XDP runs on them; `lb run` attaches there, `lb trace` runs
/// external packets through the same programs.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct DeviceArgs {
    /// External devices (comma-separated or repeated): `lb_xdp` (per --xdp) and tc ingress
    /// balance NodePort, LoadBalancer and external-IP traffic arriving there [default: the
    /// devices holding the node IPs, unless any --tc-* device is given].
    #[arg(long, value_delimiter = ',')]
    pub devices: Vec<String>,
    /// XDP on the external devices; a device where native XDP cannot attach keeps tc only.
    #[arg(long, value_enum, default_value = "auto")]
    pub xdp: XdpMode,
}

/// The load-balancing algorithm and Maglev's table shape; `lb run` programs with them, and
/// `lb trace --manifests` builds the same state.
#[derive(Clone, Debug, clap::Args)]
pub struct AlgorithmArgs {
    /// How a frontend picks the backend of a new flow, unless its Service's
    /// `lb.io/lb-algorithm` annotation (`random` or `maglev`) says otherwise.
    #[arg(long, value_enum, default_value = "random")]
    pub lb_algorithm: LbAlgorithm,
    /// Cells (M) of each Maglev table, one of the primes 251, 509, 1021, 2039, 4093, 8191,
    /// 16381, 32749, 65521, 131071; keep it above 100 × a frontend's backends. A pinned
    /// lb_maglev of another M is refused.
    #[arg(long, default_value_t = lb_common::maglev::DEFAULT_TABLE_SIZE,
          value_parser = parse_table_size)]
    pub maglev_table_size: u32,
    /// Maglev tables in lb_maglev, one per Maglev frontend (and scope); each costs M × 8
    /// bytes (128 KiB at the default M). Frontends beyond it fall back to random
    /// [default: what the pinned lb_maglev holds, else 256 with --lb-algorithm maglev, else 16].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub bpf_maglev_tables: Option<u32>,
}

impl AlgorithmArgs {
    /// `--bpf-maglev-tables`, or the default for the node's algorithm.
    pub fn tables(&self) -> u32 {
        self.bpf_maglev_tables.unwrap_or(match self.lb_algorithm {
            LbAlgorithm::Maglev => lb_common::maglev::DEFAULT_TABLES,
            LbAlgorithm::Random => lb_common::maglev::DEFAULT_TABLES_RANDOM,
        })
    }
}

/// How `lb_xdp` is attached to external devices (`--xdp`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum XdpMode {
    /// Native on physical devices, none (tc only) on virtual ones such as veth, where an XDP
    /// redirect or TX only arrives if the peer has NAPI (GRO on, or an XDP program of its
    /// own), which lb cannot see.
    #[default]
    Auto,
    /// In the driver (the fast path; veth, virtio-net and most NICs have it).
    Native,
    /// On the skb, for devices without native XDP (no faster than tc, but the same code).
    Generic,
    /// No XDP: tc ingress alone.
    Off,
}

impl XdpMode {
    /// The mode `iface` gets: `Auto` is native on a physical device (one sysfs links to a
    /// bus device), off on a virtual one.
    pub fn resolve(self, iface: &str) -> XdpMode {
        match self {
            XdpMode::Auto
                if Path::new("/sys/class/net")
                    .join(iface)
                    .join("device")
                    .exists() =>
            {
                XdpMode::Native
            }
            XdpMode::Auto => XdpMode::Off,
            m => m,
        }
    }
}

/// Whether `m` is a table size lb accepts (`lb_common::maglev::TABLE_SIZES`).
pub fn valid_table_size(m: u32) -> bool {
    lb_common::maglev::TABLE_SIZES.contains(&m)
}

/// Parses `--maglev-table-size`: one of the allowed primes, else an error listing them.
pub fn parse_table_size(s: &str) -> Result<u32, String> {
    let sizes = || {
        lb_common::maglev::TABLE_SIZES
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    match s.parse::<u32>() {
        Ok(m) if valid_table_size(m) => Ok(m),
        _ => Err(format!(
            "{s:?} is not an allowed Maglev table size (a prime): {}",
            sizes()
        )),
    }
}

/// The conntrack flags of `lb run` and `lb trace --manifests` (Cilium's names).
#[derive(Clone, Debug, clap::Args)]
pub struct CtArgs {
    /// Entries of each family's TCP conntrack map (`lb4_ct_tcp`, `lb6_ct_tcp`). A pinned map of
    /// another size is refused: resizing needs a fresh pin directory.
    #[arg(long, default_value_t = map_sizes::CT_TCP, value_parser = clap::value_parser!(u32).range(1..))]
    pub bpf_ct_global_tcp_max: u32,
    /// Entries of each family's conntrack map for UDP, SCTP and the rest (`lb4_ct_any`,
    /// `lb6_ct_any`).
    #[arg(long, default_value_t = map_sizes::CT_ANY, value_parser = clap::value_parser!(u32).range(1..))]
    pub bpf_ct_global_any_max: u32,
    /// Seconds a TCP (or SCTP) flow lives until the backend answers.
    #[arg(long, default_value_t = ct_timeouts::TCP_SYN, value_parser = timeout_secs)]
    pub bpf_ct_timeout_regular_tcp_syn: u32,
    /// Seconds an established TCP (or SCTP) flow lives without packets.
    #[arg(long, default_value_t = ct_timeouts::TCP_ESTABLISHED, value_parser = timeout_secs)]
    pub bpf_ct_timeout_regular_tcp: u32,
    /// Seconds a TCP (or SCTP) flow lives after a FIN or RST from either side.
    #[arg(long, default_value_t = ct_timeouts::TCP_CLOSING, value_parser = timeout_secs)]
    pub bpf_ct_timeout_regular_tcp_fin: u32,
    /// Seconds a UDP (or other connectionless) flow lives without packets.
    #[arg(long, default_value_t = ct_timeouts::NON_TCP, value_parser = timeout_secs)]
    pub bpf_ct_timeout_regular_any: u32,
}

impl Default for CtArgs {
    fn default() -> Self {
        Self {
            bpf_ct_global_tcp_max: map_sizes::CT_TCP,
            bpf_ct_global_any_max: map_sizes::CT_ANY,
            bpf_ct_timeout_regular_tcp_syn: ct_timeouts::TCP_SYN,
            bpf_ct_timeout_regular_tcp: ct_timeouts::TCP_ESTABLISHED,
            bpf_ct_timeout_regular_tcp_fin: ct_timeouts::TCP_CLOSING,
            bpf_ct_timeout_regular_any: ct_timeouts::NON_TCP,
        }
    }
}

/// The longest lifetime accepted: a year. Expiries are `u32` seconds of uptime, so anything
/// near 2^32 would wrap into the past.
pub const MAX_TIMEOUT: u32 = 365 * 24 * 3600;

fn timeout_secs(s: &str) -> Result<u32, String> {
    let n: u32 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number of seconds: {e}"))?;
    if n == 0 || n > MAX_TIMEOUT {
        return Err(format!(
            "{n} s: a conntrack lifetime must be 1..={MAX_TIMEOUT} seconds"
        ));
    }
    Ok(n)
}

impl CtArgs {
    /// The lifetimes the datapath gets.
    pub fn timeouts(&self) -> CtTimeouts {
        CtTimeouts {
            tcp_syn: self.bpf_ct_timeout_regular_tcp_syn,
            tcp: self.bpf_ct_timeout_regular_tcp,
            tcp_fin: self.bpf_ct_timeout_regular_tcp_fin,
            any: self.bpf_ct_timeout_regular_any,
        }
    }

    /// max_entries of the four conntrack maps, as `LoadOptions::max_entries` takes them.
    pub fn map_sizes(&self) -> [(&'static str, u32); 4] {
        [
            (map_names::CT_TCP4, self.bpf_ct_global_tcp_max),
            (map_names::CT_TCP6, self.bpf_ct_global_tcp_max),
            (map_names::CT_ANY4, self.bpf_ct_global_any_max),
            (map_names::CT_ANY6, self.bpf_ct_global_any_max),
        ]
    }
}

/// Conntrack lifetimes in seconds, set as the datapath's read-only globals at load
/// (`lb_common::globals::CT_TIMEOUT_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtTimeouts {
    pub tcp_syn: u32,
    pub tcp: u32,
    pub tcp_fin: u32,
    pub any: u32,
}

impl Default for CtTimeouts {
    fn default() -> Self {
        CtArgs::default().timeouts()
    }
}

impl CtTimeouts {
    /// Refuses lifetimes the datapath cannot use (zero, or long enough to wrap).
    pub fn validate(&self) -> anyhow::Result<()> {
        for (flag, v) in [
            ("--bpf-ct-timeout-regular-tcp-syn", self.tcp_syn),
            ("--bpf-ct-timeout-regular-tcp", self.tcp),
            ("--bpf-ct-timeout-regular-tcp-fin", self.tcp_fin),
            ("--bpf-ct-timeout-regular-any", self.any),
        ] {
            if v == 0 || v > MAX_TIMEOUT {
                anyhow::bail!("{flag} {v}: a conntrack lifetime must be 1..={MAX_TIMEOUT} seconds");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_sizes_are_checked() {
        assert_eq!(parse_table_size("16381"), Ok(16381));
        assert_eq!(parse_table_size("251"), Ok(251));
        let e = parse_table_size("16384").unwrap_err();
        assert!(e.contains("16381") && e.contains("not an allowed"), "{e}");
        assert!(parse_table_size("x").is_err());
        for m in lb_common::maglev::TABLE_SIZES {
            assert!(
                (2..m).take_while(|d| d * d <= m).all(|d| m % d != 0),
                "{m} is prime"
            );
        }
    }

    #[test]
    fn timeouts_refuse_zero_and_wrapping_values() {
        assert!(timeout_secs("0").is_err());
        assert!(timeout_secs("-1").is_err());
        assert!(timeout_secs(&(MAX_TIMEOUT + 1).to_string()).is_err());
        assert_eq!(timeout_secs("10"), Ok(10));
        assert!(CtTimeouts::default().validate().is_ok());
        let zero = CtTimeouts {
            tcp_fin: 0,
            ..CtTimeouts::default()
        };
        let e = zero.validate().unwrap_err().to_string();
        assert!(e.contains("--bpf-ct-timeout-regular-tcp-fin"), "{e}");
    }
}
