//! The tc entry points: each names its hook and runs the per-packet pipeline (`packet`).
use aya_ebpf::{macros::classifier, programs::TcContext};

use crate::packet::{self, Hook};

/// Ingress of external-facing devices: frontends' external scope.
#[classifier]
pub fn lb_tc_ingress(ctx: TcContext) -> i32 {
    packet::run(&ctx, Hook::External)
}

/// Ingress of pod-facing devices (host side of pod veths): in-cluster clients.
#[classifier]
pub fn lb_tc_pod(ctx: TcContext) -> i32 {
    packet::run(&ctx, Hook::Pod)
}

/// Egress: reverse NAT of replies only.
#[classifier]
pub fn lb_tc_egress(ctx: TcContext) -> i32 {
    packet::run(&ctx, Hook::Egress)
}
