//! Fragments and IPv6 extension headers.

use crate::common::*;
use crate::icmp::ct_count;
use crate::masquerade::etherparse_checksums_ok;

/// Splits the IP datagram in `frame` into fragments of at most `chunk` L4 bytes (a multiple
/// of 8), as a router does: IPv4 with MF and offsets, IPv6 with a fragment header; `id`
/// identifies the datagram.
pub(crate) fn fragment(frame: &[u8], chunk: usize, id: u32) -> Vec<Vec<u8>> {
    assert_eq!(chunk % 8, 0);
    let eth = &frame[..14];
    let v4 = frame[12..14] == [0x08, 0x00];
    let (ip, l4) = if v4 {
        (&frame[14..34], &frame[34..])
    } else {
        (&frame[14..54], &frame[54..])
    };
    let parts: Vec<&[u8]> = l4.chunks(chunk).collect();
    let mut out = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        let more = u16::from(i + 1 < parts.len());
        let off = (i * chunk / 8) as u16;
        let mut f = eth.to_vec();
        let mut h = ip.to_vec();
        if v4 {
            h[2..4].copy_from_slice(&((20 + part.len()) as u16).to_be_bytes());
            h[4..6].copy_from_slice(&(id as u16).to_be_bytes());
            h[6..8].copy_from_slice(&((more << 13) | off).to_be_bytes());
            h[10..12].copy_from_slice(&[0, 0]);
            let c = !fold(ones_sum(&h));
            h[10..12].copy_from_slice(&c.to_be_bytes());
            f.extend_from_slice(&h);
        } else {
            let next = h[6];
            h[6] = 44;
            h[4..6].copy_from_slice(&((8 + part.len()) as u16).to_be_bytes());
            f.extend_from_slice(&h);
            f.extend_from_slice(&[next, 0]);
            f.extend_from_slice(&((off << 3) | more).to_be_bytes());
            f.extend_from_slice(&id.to_be_bytes());
        }
        f.extend_from_slice(part);
        out.push(f);
    }
    out
}

/// Puts translated fragments back together into one frame, checking that every fragment
/// carries the same addresses (and, IPv4, a valid header checksum); the L4 checksum of the
/// result is the caller's to verify.
pub(crate) fn reassemble(frags: &[Vec<u8>]) -> Vec<u8> {
    let v4 = frags[0][12..14] == [0x08, 0x00];
    let (addrs, hlen) = if v4 { (26..34, 34) } else { (22..54, 62) };
    let mut l4 = Vec::new();
    for f in frags {
        assert_eq!(f[addrs.clone()], frags[0][addrs.clone()], "fragments agree");
        if v4 {
            assert_eq!(fold(ones_sum(&f[14..34])), 0xffff, "fragment IPv4 checksum");
        }
        l4.extend_from_slice(&f[hlen..]);
    }
    let mut out = frags[0][..14].to_vec();
    if v4 {
        let mut h = frags[0][14..34].to_vec();
        h[2..4].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
        h[6..8].copy_from_slice(&[0x40, 0]);
        h[10..12].copy_from_slice(&[0, 0]);
        let c = !fold(ones_sum(&h));
        h[10..12].copy_from_slice(&c.to_be_bytes());
        out.extend_from_slice(&h);
    } else {
        let mut h = frags[0][14..54].to_vec();
        h[6] = frags[0][54];
        h[4..6].copy_from_slice(&(l4.len() as u16).to_be_bytes());
        out.extend_from_slice(&h);
    }
    out.extend_from_slice(&l4);
    out
}

/// A UDP datagram beyond the MTU, fragmented, through tc and XDP, IPv4 and IPv6: its first
/// fragment is balanced, every later one follows it to the same backend with only its
/// addresses rewritten, and the reassembled datagram's checksum is valid; the backend's
/// fragmented reply comes back from the VIP the same way. A later fragment before its first
/// passes untouched (counted); one of a datagram whose first fragment was rejected passes
/// untouched too and creates no flow.
#[test]
fn fragments_follow_their_first_fragment_both_ways() {
    let mut fx = traced_fixture();
    let payload = vec![0x5a; 3000];
    let mut id = 0x100;
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4)),
        (CLIENT6.into(), VIP6.into()),
    ] {
        for hook in [Ext::Tc, Ext::Xdp] {
            let what = format!("{hook:?} {client}");
            let sport = 45_000 + u16::from(hook == Ext::Xdp);
            id += 1;
            let frags = fragment(
                &packet_with(client, sport, vip, VPORT, L4::Udp, &payload),
                1232,
                id,
            );
            assert_eq!(frags.len(), 3);
            let mut out = Vec::new();
            for (i, f) in frags.iter().enumerate() {
                let (verdict, o) = fx.external(hook, f);
                assert_eq!(verdict, hook.pass(), "{what} fragment {i}");
                let r = fx.trace_record();
                let (want_frag, want_ct) = if i == 0 {
                    (trace_frag::FIRST, trace_ct::NEW)
                } else {
                    (trace_frag::LATER, trace_ct::ESTABLISHED)
                };
                assert_eq!(
                    (r.verdict, r.frag, r.ct_state),
                    (trace_verdict::FORWARD, want_frag, want_ct),
                    "{what} fragment {i}: {r:?}"
                );
                out.push(o);
            }
            let whole = reassemble(&out);
            etherparse_checksums_ok(&whole);
            let p = parse_and_verify(&whole);
            assert_eq!((p.src, p.sport), (client, sport), "{what}");
            assert!(backends_of(vip).contains(&p.dst), "{what}: {}", p.dst);
            assert_eq!(p.dport, BPORT, "{what}");

            id += 1;
            let reply = fragment(
                &packet_with(p.dst, BPORT, client, sport, L4::Udp, &payload),
                1232,
                id,
            );
            let back: Vec<Vec<u8>> = reply
                .iter()
                .map(|f| {
                    let (verdict, o) = fx.run(prog_names::TC_POD, f);
                    assert_eq!(verdict, TC_ACT_OK, "{what} reply");
                    o
                })
                .collect();
            let whole = reassemble(&back);
            etherparse_checksums_ok(&whole);
            let r = parse_and_verify(&whole);
            assert_eq!(
                (r.src, r.sport, r.dst, r.dport),
                (vip, VPORT, client, sport),
                "{what}: the reply comes back from the VIP"
            );
        }
    }

    let before = fx.counter(metrics::TC_PASS_FRAGMENT_UNKNOWN);
    let frags = fragment(
        &packet_with(
            CLIENT4.into(),
            45_100,
            VIP4.into(),
            VPORT,
            L4::Udp,
            &payload,
        ),
        1232,
        0x1111,
    );
    for hook in [Ext::Tc, Ext::Xdp] {
        let (verdict, out) = fx.external(hook, &frags[2]);
        assert_eq!(verdict, hook.pass());
        assert_eq!(
            out, frags[2],
            "{hook:?}: a later fragment before its first is untouched"
        );
    }
    assert_eq!(fx.counter(metrics::TC_PASS_FRAGMENT_UNKNOWN) - before, 2);

    let entries = ct_count(&mut fx);
    let before = fx.counter(metrics::TC_PASS_FRAGMENT_NO_FLOW);
    let frags = fragment(
        &packet_with(
            CLIENT4.into(),
            45_200,
            EMPTY_VIP4.into(),
            VPORT,
            L4::Udp,
            &payload,
        ),
        1232,
        0x2222,
    );
    let (verdict, _) = fx.ingress(&frags[0]);
    assert_eq!(verdict, TC_ACT_REDIRECT, "the first fragment is rejected");
    for f in &frags[1..] {
        let (verdict, out) = fx.ingress(f);
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(
            &out, f,
            "a later fragment of a rejected datagram is untouched"
        );
    }
    assert_eq!(fx.counter(metrics::TC_PASS_FRAGMENT_NO_FLOW) - before, 2);
    assert_eq!(ct_count(&mut fx), entries, "no flow created");
}

/// `frame` (IPv6) with extension headers of the given types (8 bytes each; a routing header
/// with `segments_left`) between its fixed header and its L4 header.
pub(crate) fn with_ext_headers(frame: &[u8], types: &[u8], segments_left: u8) -> Vec<u8> {
    let l4_proto = frame[14 + 6];
    let mut out = frame[..54].to_vec();
    out[14 + 6] = types[0];
    let plen = u16::from_be_bytes([frame[18], frame[19]]) + 8 * types.len() as u16;
    out[18..20].copy_from_slice(&plen.to_be_bytes());
    for (i, _) in types.iter().enumerate() {
        let next = types.get(i + 1).copied().unwrap_or(l4_proto);
        if types[i] == 43 {
            // Routing type 4 (segment routing), empty.
            out.extend_from_slice(&[next, 0, 4, segments_left, 0, 0, 0, 0]);
        } else {
            // One PadN option filling the 8 bytes.
            out.extend_from_slice(&[next, 0, 1, 4, 0, 0, 0, 0]);
        }
    }
    out.extend_from_slice(&frame[54..]);
    out
}

/// `frame` without the `n` 8-byte extension headers `with_ext_headers` put in.
pub(crate) fn without_ext_headers(frame: &[u8], n: usize) -> Vec<u8> {
    let mut out = frame[..54].to_vec();
    out[14 + 6] = frame[54 + 8 * (n - 1)];
    let plen = u16::from_be_bytes([frame[18], frame[19]]) - 8 * n as u16;
    out[18..20].copy_from_slice(&plen.to_be_bytes());
    out.extend_from_slice(&frame[54 + 8 * n..]);
    out
}

/// IPv6 packets with hop-by-hop, routing (no segments left) and destination-options headers
/// are balanced, established and reverse-NATed like any, on tc and XDP, TCP and UDP, with the
/// extension headers kept and every checksum valid (etherparse reads them with the headers,
/// full recomputation without). A routing header with segments left names a waypoint, not
/// the service: untouched.
#[test]
fn ipv6_extension_headers_are_walked_to_the_l4_header() {
    let mut fx = traced_fixture();
    let types = [0u8, 43, 60];
    for (i, (first, then)) in [(L4::TcpSyn, L4::TcpAck), (L4::Udp, L4::Udp)]
        .into_iter()
        .enumerate()
    {
        for hook in [Ext::Tc, Ext::Xdp] {
            let what = format!("{hook:?} {first:?}");
            let sport = 46_000 + i as u16 * 10 + u16::from(hook == Ext::Xdp);
            let syn = with_ext_headers(
                &packet(CLIENT6.into(), sport, VIP6.into(), VPORT, first),
                &types,
                0,
            );
            let (verdict, out) = fx.external(hook, &syn);
            assert_eq!(verdict, hook.pass(), "{what}");
            assert_eq!(out[54..78], syn[54..78], "{what}: extension headers kept");
            etherparse_checksums_ok(&out);
            let p = parse_and_verify(&without_ext_headers(&out, types.len()));
            assert_eq!((p.src, p.sport), (IpAddr::from(CLIENT6), sport), "{what}");
            assert!(backends_of(VIP6.into()).contains(&p.dst), "{what}");
            let r = fx.trace_record();
            assert_eq!(
                (r.verdict, r.ct_state, r.ext_headers),
                (trace_verdict::FORWARD, trace_ct::NEW, 3),
                "{what}: {r:?}"
            );
            let again = with_ext_headers(
                &packet(CLIENT6.into(), sport, VIP6.into(), VPORT, then),
                &types,
                0,
            );
            let (_, out) = fx.external(hook, &again);
            let q = parse_and_verify(&without_ext_headers(&out, types.len()));
            assert_eq!(q.dst, p.dst, "{what}: established");
            let reply = with_ext_headers(
                &packet(p.dst, BPORT, CLIENT6.into(), sport, then),
                &types,
                0,
            );
            let (verdict, out) = fx.run(prog_names::TC_POD, &reply);
            assert_eq!(verdict, TC_ACT_OK);
            etherparse_checksums_ok(&out);
            let r = parse_and_verify(&without_ext_headers(&out, types.len()));
            assert_eq!(
                (r.src, r.sport),
                (IpAddr::from(VIP6), VPORT),
                "{what}: reply"
            );
        }
    }
    let waypoint = with_ext_headers(
        &packet(CLIENT6.into(), 46_100, VIP6.into(), VPORT, L4::TcpSyn),
        &[43],
        1,
    );
    for hook in [Ext::Tc, Ext::Xdp] {
        let (verdict, out) = fx.external(hook, &waypoint);
        assert_eq!(verdict, hook.pass());
        assert_eq!(out, waypoint, "{hook:?}: segments left: untouched");
    }
}
