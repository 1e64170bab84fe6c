//! Frames built byte by byte (no library decides what is valid): a seeded PRNG, a frame
//! builder with IPv4 options, IPv6 extension headers, fragments and VLAN tags, checksums of
//! every kind, and the mutations the fuzzer applies on top.
use std::net::IpAddr;

/// SplitMix64: small, fast, and the same sequence for the same seed everywhere.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 32) * n as u64) >> 32) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `pct`/100.
    pub fn pct(&mut self, pct: usize) -> bool {
        self.below(100) < pct
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    pub fn u8(&mut self) -> u8 {
        self.next_u64() as u8
    }

    pub fn u16(&mut self) -> u16 {
        self.next_u64() as u16
    }

    pub fn u32(&mut self) -> u32 {
        self.next_u64() as u32
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.u8()).collect()
    }
}

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const SCTP: u8 = 132;
pub const ICMP: u8 = 1;
pub const ICMPV6: u8 = 58;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_PSH: u8 = 0x08;
pub const TCP_ACK: u8 = 0x10;

const MAC_A: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
const MAC_B: [u8; 6] = [0x02, 0, 0, 0, 0, 2];

// ---------------------------------------------------------------------------------------------
// Checksums, computed in full (the datapath updates them incrementally).

/// Sum of the big-endian 16-bit words of `data` (an odd byte padded with zero), unfolded.
pub fn word_sum(data: &[u8]) -> u64 {
    data.chunks(2)
        .map(|c| u64::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum()
}

/// The Internet checksum of a sum, as stored.
pub fn inet_csum(sum: u64) -> u16 {
    let mut s = sum;
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// The pseudo-header sum of an L4 packet of `len` bytes of `proto` from `src` to `dst`.
pub fn pseudo_sum(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> u64 {
    let addrs = |a: IpAddr| match a {
        IpAddr::V4(a) => word_sum(&a.octets()),
        IpAddr::V6(a) => word_sum(&a.octets()),
    };
    addrs(src) + addrs(dst) + u64::from(proto) + word_sum(&(len as u32).to_be_bytes())
}

static CRC32C_TABLE: std::sync::LazyLock<[u32; 256]> = std::sync::LazyLock::new(|| {
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

pub fn crc32c(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |c, &b| {
        CRC32C_TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
    })
}

/// The CRC32c of an SCTP packet with its CRC field taken as zero (stored little-endian).
pub fn sctp_crc(sctp: &[u8]) -> u32 {
    let mut z = sctp.to_vec();
    z[8..12].fill(0);
    crc32c(&z)
}

// ---------------------------------------------------------------------------------------------
// L4 payloads (checksum fields left zero; `Frame::build` fills them in).

pub fn tcp(
    sport: u16,
    dport: u16,
    flags: u8,
    opts: &[u8],
    payload: &[u8],
    rng: &mut Rng,
) -> Vec<u8> {
    let mut opts = opts.to_vec();
    opts.resize(opts.len().next_multiple_of(4).min(40), 1);
    let mut t = Vec::with_capacity(20 + opts.len() + payload.len());
    t.extend_from_slice(&sport.to_be_bytes());
    t.extend_from_slice(&dport.to_be_bytes());
    t.extend_from_slice(&rng.u32().to_be_bytes());
    let ack = if flags & TCP_ACK != 0 { rng.u32() } else { 0 };
    t.extend_from_slice(&ack.to_be_bytes());
    t.push((((20 + opts.len()) / 4) as u8) << 4);
    t.push(flags);
    t.extend_from_slice(&64_240u16.to_be_bytes());
    t.extend_from_slice(&[0, 0, 0, 0]);
    t.extend_from_slice(&opts);
    t.extend_from_slice(payload);
    t
}

pub fn udp(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let mut u = Vec::with_capacity(8 + payload.len());
    u.extend_from_slice(&sport.to_be_bytes());
    u.extend_from_slice(&dport.to_be_bytes());
    u.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    u.extend_from_slice(&[0, 0]);
    u.extend_from_slice(payload);
    u
}

/// An SCTP packet: common header and one chunk of `chunk` type (0xff: no chunk at all).
pub fn sctp(sport: u16, dport: u16, chunk: u8, data: usize, rng: &mut Rng) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    let vtag = if chunk == 1 { 0 } else { rng.u32() };
    p.extend_from_slice(&vtag.to_be_bytes());
    p.extend_from_slice(&[0; 4]);
    match chunk {
        0xff => {}
        1 => {
            p.extend_from_slice(&[1, 0, 0, 20]);
            p.extend_from_slice(&rng.u32().to_be_bytes());
            p.extend_from_slice(&65_535u32.to_be_bytes());
            p.extend_from_slice(&[0, 10, 0, 10]);
            p.extend_from_slice(&rng.u32().to_be_bytes());
        }
        0 => {
            p.extend_from_slice(&[0, 0x03]);
            p.extend_from_slice(&((16 + data) as u16).to_be_bytes());
            p.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]);
            p.extend(rng.bytes(data));
            p.resize(p.len().next_multiple_of(4), 0);
        }
        ty => p.extend_from_slice(&[ty, 0, 0, 4]),
    }
    p
}

/// An ICMP (or ICMPv6) message: type, code, a rest-of-header word and its body (for errors,
/// the quoted packet from its IP header on).
pub fn icmp(ty: u8, code: u8, rest: u32, body: &[u8]) -> Vec<u8> {
    let mut m = vec![ty, code, 0, 0];
    m.extend_from_slice(&rest.to_be_bytes());
    m.extend_from_slice(body);
    m
}

// ---------------------------------------------------------------------------------------------
// Frames.

/// What goes around an L4 packet: addresses, IP options or extension headers, fragmenting and
/// VLAN tags.
#[derive(Clone, Debug)]
pub struct Frame {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    pub ttl: u8,
    /// IPv4 options (padded to a multiple of 4, at most 40 bytes).
    pub v4_opts: Vec<u8>,
    /// IPv6 extension headers before the L4 header: (header type, body after the two bytes of
    /// next header and length; padded to 8-byte units). Type 44 (fragment) takes its 6 bytes
    /// from `frag`.
    pub v6_ext: Vec<(u8, Vec<u8>)>,
    /// (fragment offset in 8-byte units, more fragments).
    pub frag: Option<(u16, bool)>,
    /// 802.1Q / 802.1ad tags, outermost first: (TPID, TCI).
    pub vlans: Vec<(u16, u16)>,
    /// Leave the L4 checksum as it is in `l4` (zero or deliberately wrong).
    pub keep_l4_csum: bool,
}

impl Frame {
    pub fn new(src: IpAddr, dst: IpAddr, proto: u8) -> Self {
        Self {
            src,
            dst,
            proto,
            ttl: 64,
            v4_opts: Vec::new(),
            v6_ext: Vec::new(),
            frag: None,
            vlans: Vec::new(),
            keep_l4_csum: false,
        }
    }

    /// The IP packet (header on) carrying `l4`, its L4 checksum filled in unless kept.
    pub fn ip_packet(&self, l4: &[u8]) -> Vec<u8> {
        let mut l4 = l4.to_vec();
        if !self.keep_l4_csum {
            fill_l4_csum(self.src, self.dst, self.proto, &mut l4);
        }
        match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let mut opts = self.v4_opts.clone();
                opts.truncate(40);
                opts.resize(opts.len().next_multiple_of(4), 0);
                let hl = 20 + opts.len();
                let mut ip = vec![0u8; hl];
                ip[0] = 0x40 | (hl / 4) as u8;
                ip[2..4].copy_from_slice(&((hl + l4.len()) as u16).to_be_bytes());
                ip[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
                let frag = match self.frag {
                    Some((off, mf)) => (off & 0x1fff) | if mf { 0x2000 } else { 0 },
                    None => 0x4000, // DF
                };
                ip[6..8].copy_from_slice(&frag.to_be_bytes());
                ip[8] = self.ttl;
                ip[9] = self.proto;
                ip[12..16].copy_from_slice(&s.octets());
                ip[16..20].copy_from_slice(&d.octets());
                ip[20..].copy_from_slice(&opts);
                let c = inet_csum(word_sum(&ip));
                ip[10..12].copy_from_slice(&c.to_be_bytes());
                ip.extend_from_slice(&l4);
                ip
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let mut ext = Vec::new();
                let mut headers: Vec<(u8, Vec<u8>)> = self.v6_ext.clone();
                if self.frag.is_some() && !headers.iter().any(|(t, _)| *t == 44) {
                    headers.push((44, Vec::new()));
                }
                let first = headers.first().map_or(self.proto, |(t, _)| *t);
                for (i, (ty, body)) in headers.iter().enumerate() {
                    let next = headers.get(i + 1).map_or(self.proto, |(t, _)| *t);
                    if *ty == 44 {
                        let (off, mf) = self.frag.unwrap_or((0, false));
                        ext.extend_from_slice(&[next, 0]);
                        ext.extend_from_slice(&((off << 3) | u16::from(mf)).to_be_bytes());
                        ext.extend_from_slice(&0xdead_beefu32.to_be_bytes());
                    } else {
                        let mut b = body.clone();
                        b.resize((b.len() + 2).next_multiple_of(8) - 2, 0);
                        ext.push(next);
                        ext.push(((b.len() + 2) / 8 - 1) as u8);
                        ext.extend_from_slice(&b);
                    }
                }
                let mut ip = vec![0u8; 40];
                ip[0] = 0x60;
                ip[4..6].copy_from_slice(&((ext.len() + l4.len()) as u16).to_be_bytes());
                ip[6] = first;
                ip[7] = self.ttl;
                ip[8..24].copy_from_slice(&s.octets());
                ip[24..40].copy_from_slice(&d.octets());
                ip.extend_from_slice(&ext);
                ip.extend_from_slice(&l4);
                ip
            }
            _ => panic!("mixed families"),
        }
    }

    /// The Ethernet frame carrying `l4`.
    pub fn build(&self, l4: &[u8]) -> Vec<u8> {
        let ip = self.ip_packet(l4);
        let mut f = Vec::with_capacity(14 + 8 + ip.len());
        f.extend_from_slice(&MAC_B);
        f.extend_from_slice(&MAC_A);
        for (tpid, tci) in &self.vlans {
            f.extend_from_slice(&tpid.to_be_bytes());
            f.extend_from_slice(&tci.to_be_bytes());
        }
        let ethertype: u16 = if self.src.is_ipv4() { 0x0800 } else { 0x86dd };
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(&ip);
        f
    }
}

/// Writes the right checksum into an L4 packet of `proto` from `src` to `dst`.
pub fn fill_l4_csum(src: IpAddr, dst: IpAddr, proto: u8, l4: &mut [u8]) {
    match proto {
        TCP if l4.len() >= 20 => {
            l4[16..18].fill(0);
            let c = inet_csum(pseudo_sum(src, dst, proto, l4.len()) + word_sum(l4));
            l4[16..18].copy_from_slice(&c.to_be_bytes());
        }
        UDP if l4.len() >= 8 => {
            l4[6..8].fill(0);
            let mut c = inet_csum(pseudo_sum(src, dst, proto, l4.len()) + word_sum(l4));
            if c == 0 {
                c = 0xffff;
            }
            l4[6..8].copy_from_slice(&c.to_be_bytes());
        }
        SCTP if l4.len() >= 12 => {
            let c = sctp_crc(l4);
            l4[8..12].copy_from_slice(&c.to_le_bytes());
        }
        ICMP if l4.len() >= 4 => {
            l4[2..4].fill(0);
            let c = inet_csum(word_sum(l4));
            l4[2..4].copy_from_slice(&c.to_be_bytes());
        }
        ICMPV6 if l4.len() >= 4 => {
            l4[2..4].fill(0);
            let c = inet_csum(pseudo_sum(src, dst, proto, l4.len()) + word_sum(l4));
            l4[2..4].copy_from_slice(&c.to_be_bytes());
        }
        _ => {}
    }
}

/// IPv4 options the fuzzer picks from: NOP/EOL padding, record route, timestamp, router
/// alert, and random bytes.
pub fn v4_options(rng: &mut Rng) -> Vec<u8> {
    match rng.below(5) {
        0 => vec![1, 1, 1, 0],
        1 => {
            let slots = rng.range(1, 9);
            let mut o = vec![7, (3 + 4 * slots) as u8, 4];
            o.resize(3 + 4 * slots, 0);
            o
        }
        2 => vec![148, 4, 0, 0],
        3 => {
            let mut o = vec![68, 12, 5, 0];
            o.resize(12, 0);
            o
        }
        _ => {
            let n = rng.range(1, 40);
            rng.bytes(n)
        }
    }
}

/// A chain of 1–3 IPv6 extension headers: hop-by-hop (first only), routing, fragment,
/// destination options, and sometimes an unknown one.
pub fn v6_ext_chain(rng: &mut Rng) -> Vec<(u8, Vec<u8>)> {
    let mut chain = Vec::new();
    if rng.pct(50) {
        chain.push((0, vec![1, 4, 0, 0, 0, 0]));
    }
    for _ in 0..rng.range(usize::from(chain.is_empty()), 2) {
        let h = match rng.below(5) {
            0 => (43, {
                let mut b = vec![4, 0, 0, 0, 0, 0];
                b.extend_from_slice(&rng.bytes(16));
                b
            }),
            1 => (44, Vec::new()),
            2 => (60, vec![1, 2, 0, 0, 0, 0]),
            3 => (253, rng.bytes(6)),
            _ => (60, rng.bytes(14)),
        };
        chain.push(h);
    }
    chain
}

// ---------------------------------------------------------------------------------------------
// Mutations of a built frame.

/// Applies one random mutation to `f` (at least 14 bytes stay: BPF_PROG_TEST_RUN refuses
/// shorter frames), and names it.
pub fn mutate(f: &mut Vec<u8>, rng: &mut Rng) -> &'static str {
    let l3 = 14;
    let v4 = f.len() > 14 && f[12..14] == [0x08, 0x00];
    match rng.below(12) {
        0 => {
            let cut = rng.range(14, f.len().max(14));
            f.truncate(cut);
            "truncated"
        }
        1 if v4 && f.len() >= l3 + 4 => {
            let len = u16::from_be_bytes([f[l3 + 2], f[l3 + 3]]);
            let new = if rng.pct(50) {
                len.wrapping_add(rng.range(1, 64) as u16)
            } else {
                len.wrapping_sub(rng.range(1, 64) as u16)
            };
            f[l3 + 2..l3 + 4].copy_from_slice(&new.to_be_bytes());
            "IPv4 total length"
        }
        1 if f.len() >= l3 + 6 => {
            let len = u16::from_be_bytes([f[l3 + 4], f[l3 + 5]]);
            let new = if rng.pct(50) {
                len.wrapping_add(rng.range(1, 64) as u16)
            } else {
                len.wrapping_sub(rng.range(1, 64) as u16)
            };
            f[l3 + 4..l3 + 6].copy_from_slice(&new.to_be_bytes());
            "IPv6 payload length"
        }
        2 if v4 && f.len() > l3 => {
            f[l3] = 0x40 | rng.below(16) as u8;
            "IHL"
        }
        3 if f.len() > l3 + 30 => {
            // Somewhere in the L4 header: its checksum, a port, a length.
            let off = l3 + rng.range(20, 30.min(f.len() - l3 - 1));
            f[off] ^= rng.range(1, 255) as u8;
            "L4 header byte"
        }
        4 if v4 && f.len() >= l3 + 12 => {
            f[l3 + 10] ^= rng.range(1, 255) as u8;
            "IPv4 header checksum"
        }
        5 => {
            for _ in 0..rng.range(1, 4) {
                let off = rng.below(f.len());
                f[off] ^= 1 << rng.below(8);
            }
            "bit flips"
        }
        6 => {
            let n = rng.range(1, 64);
            f.extend(rng.bytes(n));
            "trailing bytes"
        }
        7 if f.len() > l3 => {
            f[l3] = (f[l3] & 0x0f) | (rng.below(16) as u8) << 4;
            "IP version"
        }
        8 if f.len() > l3 + 8 => {
            f[l3 + if v4 { 8 } else { 7 }] = rng.below(3) as u8;
            "TTL 0..2"
        }
        9 if f.len() > l3 + 10 => {
            let off = rng.range(l3, f.len() - 1);
            f[off] = rng.u8();
            "random byte"
        }
        10 if f.len() > l3 => {
            // The protocol / next header.
            let off = l3 + if v4 { 9 } else { 6 };
            if off < f.len() {
                f[off] = *rng.pick(&[TCP, UDP, SCTP, ICMP, ICMPV6, 0, 43, 44, 60, 255]);
            }
            "protocol"
        }
        _ => {
            let off = rng.below(f.len());
            let n = rng.range(1, 8).min(f.len() - off);
            let junk = rng.bytes(n);
            f[off..off + n].copy_from_slice(&junk);
            "random bytes"
        }
    }
}
