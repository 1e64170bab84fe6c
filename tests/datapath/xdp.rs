//! The XDP program: the same pipeline as tc ingress, and what it leaves to tc.

use crate::common::*;

/// XDP rewrites with its own checksum code (no skb helpers): every case tc passes, it passes
/// too, checked by full recomputation.
#[test]
fn xdp_forwards_and_reverse_nats_with_valid_checksums() {
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4)),
        (CLIENT6.into(), VIP6.into()),
    ] {
        forward_and_reply_on(Ext::Xdp, client, vip, L4::TcpSyn, L4::TcpAck);
        forward_and_reply_on(Ext::Xdp, client, vip, L4::Udp, L4::Udp);
    }
}

/// XDP never changes what is not a service packet it fully parsed: other destinations, other
/// protocols, truncated and non-IP frames leave byte for byte as they came, with XDP_PASS.
#[test]
fn xdp_passes_everything_else_untouched() {
    let mut fx = fixture();
    let mut frames = vec![
        packet(
            CLIENT4.into(),
            40_000,
            Ipv4Addr::new(198, 18, 77, 7).into(),
            VPORT,
            L4::TcpSyn,
        ),
        packet(
            CLIENT6.into(),
            40_000,
            "2001:db8:77::7".parse().unwrap(),
            VPORT,
            L4::Udp,
        ),
        packet(CLIENT4.into(), 40_000, VIP4.into(), VPORT + 1, L4::Udp),
    ];
    let full = packet(CLIENT4.into(), 40_000, VIP4.into(), VPORT, L4::TcpSyn);
    // BPF_PROG_TEST_RUN refuses XDP frames shorter than an Ethernet header.
    for cut in [14, 20, 33, 40] {
        frames.push(full[..cut].to_vec());
    }
    let mut arp = full.clone();
    arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    frames.push(arp);
    for f in &frames {
        let (verdict, out) = fx.xdp(f);
        assert_eq!(verdict, XDP_PASS, "{f:02x?}");
        assert_eq!(&out, f, "untouched");
    }
}

/// XDP builds no replies: a packet kube-proxy would REJECT leaves XDP untouched, counted as
/// handed to tc, and tc ingress on the same device answers it.
#[test]
fn xdp_leaves_rejects_to_tc_ingress() {
    let mut fx = fixture();
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(EMPTY_VIP4)),
        (CLIENT6.into(), EMPTY_VIP6.into()),
    ] {
        let before = fx.counter(metrics::XDP_PASS_TO_TC);
        let syn = packet(client, 40_000, vip, VPORT, L4::TcpSyn);
        let (verdict, out) = fx.xdp(&syn);
        assert_eq!((verdict, &out), (XDP_PASS, &syn), "{vip}: untouched for tc");
        assert_eq!(fx.counter(metrics::XDP_PASS_TO_TC), before + 1);
        let (verdict, rst) = fx.ingress(&out);
        assert_eq!(verdict, TC_ACT_REDIRECT, "{vip}: tc rejects it");
        let r = parse_and_verify(&rst);
        assert_eq!((r.src, r.dst, r.proto), (vip, client, 6), "{vip}: the RST");
    }
}
