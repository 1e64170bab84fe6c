//! SCTP. Packets are crafted here with a table-driven CRC32c, independent of the datapath's
//! incremental update; every output CRC is recomputed over the whole SCTP packet.

use crate::common::*;

pub(crate) const IPPROTO_SCTP: u8 = 132;

pub(crate) static CRC32C_TABLE: LazyLock<[u32; 256]> = LazyLock::new(|| {
    let mut t = [0u32; 256];
    for (i, e) in t.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82f6_3b78
            } else {
                c >> 1
            };
        }
        *e = c;
    }
    t
});

pub(crate) fn crc32c(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |c, &b| {
        CRC32C_TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
    })
}

/// The CRC32c field an SCTP packet must carry (little-endian on the wire, RFC 9260 App. B).
pub(crate) fn sctp_crc(sctp: &[u8]) -> [u8; 4] {
    let mut zeroed = sctp.to_vec();
    zeroed[8..12].fill(0);
    crc32c(&zeroed).to_le_bytes()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Chunk {
    Init,
    /// A DATA chunk carrying this many payload bytes (padded to 4).
    Data(usize),
    Abort,
    ShutdownComplete,
}

/// The SCTP packet (common header + one chunk) with a valid CRC32c.
pub(crate) fn sctp_payload(sport: u16, dport: u16, chunk: Chunk) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    // Verification tag (0 only in INIT), CRC filled in below.
    let vtag: u32 = if chunk == Chunk::Init { 0 } else { 0x1234_5678 };
    p.extend_from_slice(&vtag.to_be_bytes());
    p.extend_from_slice(&[0; 4]);
    match chunk {
        Chunk::Init => {
            p.extend_from_slice(&[1, 0, 0, 20]);
            p.extend_from_slice(&0xcafe_f00du32.to_be_bytes()); // initiate tag
            p.extend_from_slice(&65_535u32.to_be_bytes()); // a_rwnd
            p.extend_from_slice(&[0, 10, 0, 10]); // streams out/in
            p.extend_from_slice(&1u32.to_be_bytes()); // initial TSN
        }
        Chunk::Data(n) => {
            p.extend_from_slice(&[0, 0x03]);
            p.extend_from_slice(&((16 + n) as u16).to_be_bytes());
            p.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]); // TSN, stream, seq, PPID
            p.extend((0..n).map(|i| (i * 7 + 3) as u8));
            p.resize(p.len().next_multiple_of(4), 0);
        }
        Chunk::Abort => p.extend_from_slice(&[6, 0, 0, 4]),
        Chunk::ShutdownComplete => p.extend_from_slice(&[14, 0, 0, 4]),
    }
    let crc = sctp_crc(&p);
    p[8..12].copy_from_slice(&crc);
    p
}

pub(crate) fn sctp_packet(
    src: IpAddr,
    sport: u16,
    dst: IpAddr,
    dport: u16,
    chunk: Chunk,
) -> Vec<u8> {
    let payload = sctp_payload(sport, dport, chunk);
    let eth = PacketBuilder::ethernet2(MAC_A, MAC_B);
    let mut buf = Vec::new();
    let proto = etherparse::IpNumber(IPPROTO_SCTP);
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => eth
            .ipv4(s.octets(), d.octets(), 64)
            .write(&mut buf, proto, &payload),
        (IpAddr::V6(s), IpAddr::V6(d)) => eth
            .ipv6(s.octets(), d.octets(), 64)
            .write(&mut buf, proto, &payload),
        _ => panic!("mixed families"),
    }
    .expect("build packet");
    buf
}

/// The SCTP view of a frame: its endpoints, CRC field, and whether that CRC is right. The IPv4
/// header checksum is verified.
#[derive(Debug)]
pub(crate) struct SctpSeen {
    pub(crate) src: IpAddr,
    pub(crate) sport: u16,
    pub(crate) dst: IpAddr,
    pub(crate) dport: u16,
    pub(crate) crc: [u8; 4],
    pub(crate) crc_ok: bool,
}

pub(crate) fn parse_sctp(pkt: &[u8]) -> SctpSeen {
    let ip = &pkt[14..];
    let (src, dst, proto, l4): (IpAddr, IpAddr, u8, &[u8]) =
        match u16::from_be_bytes([pkt[12], pkt[13]]) {
            0x0800 => {
                let ihl = usize::from(ip[0] & 0xf) * 4;
                assert_eq!(fold(ones_sum(&ip[..ihl])), 0xffff, "IPv4 header checksum");
                let tot = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
                let s: [u8; 4] = ip[12..16].try_into().unwrap();
                let d: [u8; 4] = ip[16..20].try_into().unwrap();
                (s.into(), d.into(), ip[9], &ip[ihl..tot])
            }
            0x86dd => {
                let plen = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
                let s: [u8; 16] = ip[8..24].try_into().unwrap();
                let d: [u8; 16] = ip[24..40].try_into().unwrap();
                (s.into(), d.into(), ip[6], &ip[40..40 + plen])
            }
            other => panic!("unexpected ethertype {other:#x}"),
        };
    assert_eq!(proto, IPPROTO_SCTP);
    let crc: [u8; 4] = l4[8..12].try_into().unwrap();
    SctpSeen {
        src,
        sport: u16::from_be_bytes([l4[0], l4[1]]),
        dst,
        dport: u16::from_be_bytes([l4[2], l4[3]]),
        crc,
        crc_ok: crc == sctp_crc(l4),
    }
}

#[test]
fn crc32c_helper_matches_the_standard_check_value() {
    // The check value of CRC-32C (Castagnoli), as in RFC 3720 / every CRC catalogue.
    assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    assert_eq!(
        crc32c(&[0u8; 32]),
        0x8a91_36aa,
        "RFC 3720 B.4: 32 bytes of zeros"
    );
}

/// New associations are DNATed (address and port) with a valid CRC32c; later packets keep
/// their backend; the backend's reply comes from the VIP with a valid CRC32c; new flows reach
/// every backend.
pub(crate) fn sctp_forward_and_reply(client: IpAddr, vip: IpAddr) {
    let mut fx = fixture();
    let backends = backends_of(vip);
    let mut seen = BTreeSet::new();
    for sport in 40_000..40_060u16 {
        let init = sctp_packet(client, sport, vip, VPORT, Chunk::Init);
        let (verdict, out) = fx.ingress(&init);
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(out.len(), init.len());
        let p = parse_sctp(&out);
        assert_eq!((p.src, p.sport), (client, sport), "source untouched");
        assert!(
            backends.contains(&p.dst),
            "DNAT to a backend, got {}",
            p.dst
        );
        assert_eq!(p.dport, BPORT, "port rewritten");
        assert!(p.crc_ok, "CRC32c valid after the port rewrite: {p:?}");
        seen.insert(p.dst);

        for _ in 0..3 {
            let data = sctp_packet(client, sport, vip, VPORT, Chunk::Data(100));
            let q = parse_sctp(&fx.ingress(&data).1);
            assert_eq!(
                (q.dst, q.dport),
                (p.dst, BPORT),
                "association keeps its backend"
            );
            assert!(q.crc_ok, "{q:?}");
        }

        let reply = sctp_packet(p.dst, BPORT, client, sport, Chunk::Data(40));
        let (verdict, out) = fx.ingress(&reply);
        assert_eq!(verdict, TC_ACT_OK);
        let r = parse_sctp(&out);
        assert_eq!((r.src, r.sport), (vip, VPORT), "reply comes from the VIP");
        assert_eq!(
            (r.dst, r.dport),
            (client, sport),
            "reply destination untouched"
        );
        assert!(r.crc_ok, "CRC32c valid after the reverse NAT: {r:?}");
    }
    assert_eq!(
        seen.len(),
        3,
        "60 new associations reach all 3 backends, got {seen:?}"
    );
}

#[test]
fn ipv4_sctp_forward_established_and_reverse_nat() {
    sctp_forward_and_reply(CLIENT4.into(), VIP4.into());
}

#[test]
fn ipv6_sctp_forward_established_and_reverse_nat() {
    sctp_forward_and_reply(CLIENT6.into(), VIP6.into());
}

#[test]
fn sctp_port_preserving_service_keeps_the_crc_byte_for_byte() {
    let mut fx = fixture();
    for (client, vip) in [(CLIENT4.into(), VIP4.into()), (CLIENT6.into(), VIP6.into())] {
        let init = sctp_packet(client, 5000, vip, SAME_PORT, Chunk::Init);
        let before = parse_sctp(&init);
        let p = parse_sctp(&fx.ingress(&init).1);
        assert!(
            backends_of(vip).contains(&p.dst),
            "DNAT to a backend, got {}",
            p.dst
        );
        assert_eq!(p.dport, SAME_PORT);
        // The CRC covers no address: an address-only rewrite must leave it as it was.
        assert_eq!(p.crc, before.crc, "{vip}: CRC32c untouched");
        assert!(p.crc_ok);

        let reply = sctp_packet(p.dst, SAME_PORT, client, 5000, Chunk::Data(8));
        let r = parse_sctp(&fx.ingress(&reply).1);
        assert_eq!((r.src, r.sport), (vip, SAME_PORT));
        assert_eq!(
            r.crc,
            parse_sctp(&reply).crc,
            "{vip}: reply CRC32c untouched"
        );
    }
}

#[test]
fn sctp_crc_is_right_for_every_packet_size() {
    let mut fx = fixture();
    // From a bare chunk header up to full 1500-byte IPv4/IPv6 packets and beyond: the update
    // depends on the SCTP length through both of its tables (low and high byte).
    let sizes = [0, 1, 4, 84, 240, 241, 496, 1000, 1452, 1464, 2048, 3000];
    for (client, vip) in [(CLIENT4.into(), VIP4.into()), (CLIENT6.into(), VIP6.into())] {
        for (i, &n) in sizes.iter().enumerate() {
            let sport = 20_000 + i as u16;
            let pkt = sctp_packet(client, sport, vip, VPORT, Chunk::Data(n));
            let p = parse_sctp(&fx.ingress(&pkt).1);
            assert_eq!(p.dport, BPORT);
            assert!(p.crc_ok, "{vip}, {} bytes: {p:?}", pkt.len());
            let reply = sctp_packet(p.dst, BPORT, client, sport, Chunk::Data(n));
            let r = parse_sctp(&fx.ingress(&reply).1);
            assert_eq!(r.sport, VPORT);
            assert!(r.crc_ok, "{vip} reply, {} bytes: {r:?}", reply.len());
        }
    }
    let big = sctp_packet(CLIENT4.into(), 1, VIP4.into(), VPORT, Chunk::Data(1452));
    assert_eq!(
        big.len(),
        14 + 1500,
        "the case above includes a full 1500-byte IPv4 packet"
    );
}

#[test]
fn sctp_zero_crc_stays_zero() {
    // A local SCTP socket on a device with CRC offload leaves the CRC zero for the kernel or
    // NIC to fill in after tc (CHECKSUM_PARTIAL): a delta XORed into it would corrupt it.
    let mut fx = fixture();
    for (client, vip, l4) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4), 14 + 20),
        (CLIENT6.into(), VIP6.into(), 14 + 40),
    ] {
        let mut pkt = sctp_packet(client, 6000, vip, VPORT, Chunk::Init);
        pkt[l4 + 8..l4 + 12].fill(0);
        let p = parse_sctp(&fx.ingress(&pkt).1);
        assert_eq!(p.dport, BPORT, "still translated");
        assert_eq!(p.crc, [0; 4], "{vip}: zero CRC left zero");
    }
}

#[test]
fn truncated_sctp_passes_untouched() {
    let mut fx = fixture();
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    for (family, client, vip, l3) in [
        ("ipv4", IpAddr::from(CLIENT4), IpAddr::from(VIP4), 20),
        ("ipv6", CLIENT6.into(), VIP6.into(), 40),
    ] {
        let good = sctp_packet(client, 7000, vip, VPORT, Chunk::Init);
        // Common header cut to 8 of its 12 bytes, IP lengths saying so.
        let mut cut = good[..14 + l3 + 8].to_vec();
        let len_off = if l3 == 20 { 14 + 2 } else { 14 + 4 };
        let ip_len = if l3 == 20 { l3 + 8 } else { 8 };
        cut[len_off..len_off + 2].copy_from_slice(&(ip_len as u16).to_be_bytes());
        if l3 == 20 {
            cut[14 + 10..14 + 12].fill(0);
            let c = !fold(ones_sum(&cut[14..14 + 20]));
            cut[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
        }
        cases.push((family, cut));
        // The IP header claims more SCTP bytes than the frame holds: the CRC update would use a
        // wrong length, so the packet is not translated.
        let mut short = good.clone();
        short.truncate(good.len() - 4);
        cases.push((family, short));
    }
    for (what, pkt) in cases {
        let (verdict, out) = fx
            .try_run(prog_names::TC_INGRESS, &pkt)
            .unwrap_or_else(|e| panic!("{what}: {e:?}"));
        assert_eq!(verdict, TC_ACT_OK, "{what}");
        assert_eq!(out, pkt, "{what}: passed untouched");
    }
}

#[test]
fn sctp_conntrack_follows_init_abort_and_shutdown_complete() {
    let mut fx = fixture();
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4)),
        (CLIENT6.into(), VIP6.into()),
    ] {
        let sport = 8000;
        let entry = |fx: &mut Fixture| {
            fx.ct_entry(client, sport, vip, VPORT, IPPROTO_SCTP, ct_dir::SERVICE)
                .expect("service entry")
        };
        let backend = parse_sctp(
            &fx.ingress(&sctp_packet(client, sport, vip, VPORT, Chunk::Init))
                .1,
        )
        .dst;
        let init = entry(&mut fx);
        assert_eq!(init.flags, 0);
        let reply_entry = fx
            .ct_entry(backend, BPORT, client, sport, IPPROTO_SCTP, ct_dir::REPLY)
            .expect("reply entry");
        assert_eq!(reply_entry.backend_id, init.backend_id);

        // The backend's answer makes it established, with TCP's established lifetime.
        fx.ingress(&sctp_packet(backend, BPORT, client, sport, Chunk::Data(4)));
        let est = entry(&mut fx);
        assert_ne!(est.flags & ct_flags::SEEN_REPLY, 0, "{vip}");
        assert!(
            est.expires - init.expires > 21_600 - 60 - 5,
            "{vip}: established lives ~6 h, not the 60 s of an unanswered INIT"
        );

        // ABORT from the client closes it; an INIT on the closed entry is balanced afresh.
        fx.ingress(&sctp_packet(client, sport, vip, VPORT, Chunk::Abort));
        let closed = entry(&mut fx);
        assert_ne!(
            closed.flags & ct_flags::TX_CLOSING,
            0,
            "{vip}: ABORT closes"
        );
        assert!(
            closed.expires < init.expires,
            "{vip}: closing is shorter than INIT's 60 s"
        );
        fx.ingress(&sctp_packet(client, sport, vip, VPORT, Chunk::Init));
        assert_eq!(
            entry(&mut fx).flags,
            0,
            "{vip}: INIT after ABORT starts a new entry"
        );

        // SHUTDOWN COMPLETE from the backend closes it too.
        let backend = parse_sctp(
            &fx.ingress(&sctp_packet(client, sport, vip, VPORT, Chunk::Data(4)))
                .1,
        )
        .dst;
        fx.ingress(&sctp_packet(
            backend,
            BPORT,
            client,
            sport,
            Chunk::ShutdownComplete,
        ));
        assert_ne!(
            entry(&mut fx).flags & ct_flags::RX_CLOSING,
            0,
            "{vip}: SHUTDOWN COMPLETE closes"
        );
    }
}
