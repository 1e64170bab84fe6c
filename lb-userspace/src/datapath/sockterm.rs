//! Destroying connected UDP sockets that socket LB pinned to a backend that has left its
//! service (Cilium's `bpf_sock_term.c`), on kernels with the `bpf_sock_destroy` kfunc (6.5+).
//!
//! A connected UDP socket is translated once, at connect(): `udp_sendmsg` runs no sendmsg
//! hook for a socket sending to its connected peer, so without this it keeps sending to the
//! removed backend until the application reconnects by itself. The program here is an
//! `iter/udp` program: for every connected UDP socket of a network namespace whose peer is in
//! its `lb*_sk_store` slot or, by socket cookie, in `lb*_sk_revnat` (socket LB steered it
//! there) and whose
//! (frontend, backend) pair is in `lb_udp_destroy` (the pair is gone), it calls
//! `bpf_sock_destroy`. The socket then reports ECONNABORTED (`udp_abort`) and is disconnected:
//! the application's next recv() fails with it, its next send() with EDESTADDRREQ, and a
//! resolver reconnects, through socket LB, to a live backend.
//!
//! aya's loader cannot link kfunc calls (no `.ksyms` / `BPF_PSEUDO_KFUNC_CALL` support), so
//! the program is assembled here (about 70 instructions) and loaded with raw `bpf(2)` calls; the
//! kfunc's, the iterator target's and `sock_common`'s BTF ids and offsets come from
//! `/sys/kernel/btf/vmlinux`. An iterator walks the network namespace current when it is
//! created (`BPF_ITER_CREATE`), so [`Destroyer::pass`] enters each namespace in turn.
use std::{
    collections::HashMap,
    fs::File,
    io::{self, Read as _},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
    path::Path,
};

use anyhow::{Context as _, bail, ensure};
use lb_common::map_names;

/// Name of the (unpinned) map of gone (frontend, backend) pairs.
pub const DESTROY_MAP: &str = "lb_udp_destroy";
/// Name of the iterator program, as bpftool shows it.
pub const PROG_NAME: &str = "lb_udp_sockterm";
/// Most pairs one pass handles; a larger removal takes several passes.
pub const MAX_PAIRS: u32 = 4096;

/// Key of `lb_udp_destroy` (and of `lb_udp_gone`): a frontend and one backend that left it,
/// as socket LB recorded them in `lb*_sk_revnat`. The destroy map's value is a `u64` the
/// program increments for every socket it destroyed.
pub type DestroyKey = lb_common::UdpGoneKey;

fn key_bytes(key: &DestroyKey) -> &[u8] {
    bytemuck::bytes_of(key)
}

// ---------------------------------------------------------------------------------------------
// vmlinux BTF: just what the program needs (type ids by name, member offsets).

const BTF_KIND_STRUCT: u32 = 4;
const BTF_KIND_UNION: u32 = 5;
const BTF_KIND_TYPEDEF: u32 = 8;
const BTF_KIND_VOLATILE: u32 = 9;
const BTF_KIND_CONST: u32 = 10;
const BTF_KIND_FUNC: u32 = 12;

/// A parsed BTF blob: the offset of each type record, by id.
struct Btf {
    data: Vec<u8>,
    /// `types[id - 1]`: where type `id`'s record starts.
    types: Vec<usize>,
    strings: usize,
    strings_len: usize,
}

impl Btf {
    fn parse(data: Vec<u8>) -> anyhow::Result<Self> {
        let u32_at = |d: &[u8], o: usize| -> anyhow::Result<u32> {
            let b = d.get(o..o + 4).context("BTF truncated")?;
            Ok(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        };
        ensure!(
            data.get(..2) == Some(&0xeb9fu16.to_ne_bytes()[..]),
            "not BTF (bad magic)"
        );
        let hdr_len = u32_at(&data, 4)? as usize;
        let type_off = hdr_len + u32_at(&data, 8)? as usize;
        let type_end = type_off + u32_at(&data, 12)? as usize;
        let strings = hdr_len + u32_at(&data, 16)? as usize;
        let strings_len = u32_at(&data, 20)? as usize;
        ensure!(
            type_end <= data.len() && strings + strings_len <= data.len(),
            "BTF sections out of bounds"
        );
        let mut types = Vec::new();
        let mut at = type_off;
        while at < type_end {
            let info = u32_at(&data, at + 4)?;
            let vlen = (info & 0xffff) as usize;
            let extra = match (info >> 24) & 0x1f {
                1 => 4,                    // INT
                3 => 12,                   // ARRAY
                4 | 5 => 12 * vlen,        // STRUCT, UNION
                6 => 8 * vlen,             // ENUM
                13 => 8 * vlen,            // FUNC_PROTO
                14 => 4,                   // VAR
                15 => 12 * vlen,           // DATASEC
                17 => 4,                   // DECL_TAG
                19 => 12 * vlen,           // ENUM64
                2 | 7..=12 | 16 | 18 => 0, // PTR, FWD, TYPEDEF.., FUNC, FLOAT, TYPE_TAG
                k => bail!("unknown BTF kind {k}"),
            };
            types.push(at);
            at += 12 + extra;
        }
        Ok(Self {
            data,
            types,
            strings,
            strings_len,
        })
    }

    fn u32_at(&self, o: usize) -> u32 {
        self.data
            .get(o..o + 4)
            .map_or(0, |b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn name(&self, name_off: u32) -> &[u8] {
        let start = self.strings + name_off as usize;
        let end = self.strings + self.strings_len;
        let s = self.data.get(start..end).unwrap_or_default();
        &s[..s.iter().position(|&c| c == 0).unwrap_or(s.len())]
    }

    fn kind(&self, id: u32) -> Option<(usize, u32, u32)> {
        let at = *self.types.get((id as usize).checked_sub(1)?)?;
        let info = self.u32_at(at + 4);
        Some((at, (info >> 24) & 0x1f, info))
    }

    /// The id of the type named `name` of `kind`.
    fn find(&self, name: &str, kind: u32) -> Option<u32> {
        (1..=self.types.len() as u32).find(|&id| {
            self.kind(id).is_some_and(|(at, k, _)| {
                k == kind && self.name(self.u32_at(at)) == name.as_bytes()
            })
        })
    }

    /// Skips typedefs and qualifiers.
    fn resolve(&self, mut id: u32) -> u32 {
        for _ in 0..16 {
            match self.kind(id) {
                Some((at, BTF_KIND_TYPEDEF | BTF_KIND_VOLATILE | BTF_KIND_CONST, _)) => {
                    id = self.u32_at(at + 8);
                }
                _ => break,
            }
        }
        id
    }

    /// Byte offset of member `name` in struct or union `id`, looking into anonymous members.
    fn member_offset(&self, id: u32, name: &str) -> Option<u32> {
        let (at, kind, info) = self.kind(self.resolve(id))?;
        if kind != BTF_KIND_STRUCT && kind != BTF_KIND_UNION {
            return None;
        }
        let bitfields = info >> 31 != 0;
        for m in 0..(info & 0xffff) as usize {
            let rec = at + 12 + 12 * m;
            let off = self.u32_at(rec + 8);
            let bits = if bitfields { off & 0xff_ffff } else { off };
            let name_off = self.u32_at(rec);
            if name_off == 0 {
                if let Some(inner) = self.member_offset(self.u32_at(rec + 4), name) {
                    return Some(bits / 8 + inner);
                }
            } else if self.name(name_off) == name.as_bytes() {
                return (bits % 8 == 0).then_some(bits / 8);
            }
        }
        None
    }
}

/// What the program needs from vmlinux BTF.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct KernelIds {
    iter_udp: u32,
    sock_destroy: u32,
    daddr: i16,
    dport: i16,
    family: i16,
    state: i16,
    v6_daddr: i16,
}

impl KernelIds {
    fn from_btf(btf: &Btf) -> anyhow::Result<Self> {
        let func = |name: &str| {
            btf.find(name, BTF_KIND_FUNC)
                .with_context(|| format!("no {name} in vmlinux BTF"))
        };
        let sock_common = btf
            .find("sock_common", BTF_KIND_STRUCT)
            .context("no struct sock_common in vmlinux BTF")?;
        let off = |name: &str| -> anyhow::Result<i16> {
            let o = btf
                .member_offset(sock_common, name)
                .with_context(|| format!("no sock_common.{name} in vmlinux BTF"))?;
            i16::try_from(o).context("offset out of range")
        };
        Ok(Self {
            iter_udp: func("bpf_iter_udp")?,
            sock_destroy: func("bpf_sock_destroy")?,
            daddr: off("skc_daddr")?,
            dport: off("skc_dport")?,
            family: off("skc_family")?,
            state: off("skc_state")?,
            v6_daddr: off("skc_v6_daddr")?,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The program.

/// One `struct bpf_insn`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

const R0: u8 = 0;
const R1: u8 = 1;
const R2: u8 = 2;
const R3: u8 = 3;
const R4: u8 = 4;
const R6: u8 = 6;
const R7: u8 = 7;
const R9: u8 = 9;
const FP: u8 = 10;

const AF_INET: i32 = 2;
const AF_INET6: i32 = 10;
/// `skc_state` of a connected UDP socket.
const TCP_ESTABLISHED: i32 = 1;
const BPF_FUNC_MAP_LOOKUP_ELEM: i32 = 1;
const BPF_FUNC_GET_SOCKET_COOKIE: i32 = 46;
const BPF_FUNC_SK_STORAGE_GET: i32 = 107;
const BPF_PSEUDO_MAP_FD: u8 = 1;
const BPF_PSEUDO_KFUNC_CALL: u8 = 2;

/// A tiny assembler: instructions plus forward jumps to named labels.
#[derive(Default)]
struct Asm {
    insns: Vec<Insn>,
    labels: HashMap<&'static str, usize>,
    jumps: Vec<(usize, &'static str)>,
}

/// Sizes of loads and stores.
#[derive(Clone, Copy)]
enum Sz {
    B = 0x10,
    H = 0x08,
    W = 0x00,
    Dw = 0x18,
}

impl Asm {
    fn raw(&mut self, code: u8, dst: u8, src: u8, off: i16, imm: i32) {
        self.insns.push(Insn {
            code,
            regs: (src << 4) | dst,
            off,
            imm,
        });
    }
    fn ldx(&mut self, sz: Sz, dst: u8, src: u8, off: i16) {
        self.raw(0x61 | sz as u8, dst, src, off, 0);
    }
    fn stx(&mut self, sz: Sz, dst: u8, off: i16, src: u8) {
        self.raw(0x63 | sz as u8, dst, src, off, 0);
    }
    fn st(&mut self, sz: Sz, dst: u8, off: i16, imm: i32) {
        self.raw(0x62 | sz as u8, dst, 0, off, imm);
    }
    fn mov(&mut self, dst: u8, src: u8) {
        self.raw(0xbf, dst, src, 0, 0);
    }
    fn mov_imm(&mut self, dst: u8, imm: i32) {
        self.raw(0xb7, dst, 0, 0, imm);
    }
    fn add_imm(&mut self, dst: u8, imm: i32) {
        self.raw(0x07, dst, 0, 0, imm);
    }
    /// `dst = bswap16(dst)` on little-endian (network to host order).
    fn be16(&mut self, dst: u8) {
        self.raw(0xdc, dst, 0, 0, 16);
    }
    fn jump(&mut self, code: u8, dst: u8, imm: i32, to: &'static str) {
        self.jumps.push((self.insns.len(), to));
        self.raw(code, dst, 0, 0, imm);
    }
    fn jeq(&mut self, dst: u8, imm: i32, to: &'static str) {
        self.jump(0x15, dst, imm, to);
    }
    fn jne(&mut self, dst: u8, imm: i32, to: &'static str) {
        self.jump(0x55, dst, imm, to);
    }
    /// `if dst != src goto to`.
    fn jne_reg(&mut self, dst: u8, src: u8, to: &'static str) {
        self.jumps.push((self.insns.len(), to));
        self.raw(0x5d, dst, src, 0, 0);
    }
    /// 32-bit compare (an immediate with the top bit set is not sign-extended).
    fn jeq32(&mut self, dst: u8, imm: u32, to: &'static str) {
        self.jump(0x16, dst, imm as i32, to);
    }
    fn ja(&mut self, to: &'static str) {
        self.jump(0x05, 0, 0, to);
    }
    fn call(&mut self, helper: i32) {
        self.raw(0x85, 0, 0, 0, helper);
    }
    fn call_kfunc(&mut self, btf_id: u32) {
        self.raw(0x85, 0, BPF_PSEUDO_KFUNC_CALL, 0, btf_id as i32);
    }
    fn ld_map_fd(&mut self, dst: u8, fd: RawFd) {
        self.raw(0x18, dst, BPF_PSEUDO_MAP_FD, 0, fd);
        self.raw(0, 0, 0, 0, 0);
    }
    /// `r0 = bpf_map_lookup_elem(map, fp + key)`; no entry jumps to `out`.
    fn lookup_or_out(&mut self, map: RawFd, key: i16) {
        self.ld_map_fd(R1, map);
        self.mov(R2, FP);
        self.add_imm(R2, key.into());
        self.call(BPF_FUNC_MAP_LOOKUP_ELEM);
        self.jeq(R0, 0, "out");
    }
    fn label(&mut self, name: &'static str) {
        self.labels.insert(name, self.insns.len());
    }
    fn finish(mut self) -> anyhow::Result<Vec<Insn>> {
        for (at, to) in &self.jumps {
            let target = *self.labels.get(to).context("undefined label")?;
            self.insns[*at].off = i16::try_from(target as i64 - *at as i64 - 1)?;
        }
        Ok(self.insns)
    }
}

// Stack layout: the `lb*_sk_revnat` key at fp-32 (32 bytes; the IPv4 key uses the first 16),
// the `lb_udp_destroy` key at fp-72 (40 bytes).
const K: i16 = -32;
const D: i16 = -72;

/// The maps the program reads and writes (fds).
struct ProgMaps {
    revnat4: RawFd,
    revnat6: RawFd,
    /// `lb*_sk_store`, where the pins exist (socket LB writes them where the kernel lets it).
    store4: Option<RawFd>,
    store6: Option<RawFd>,
    destroy: RawFd,
}

/// The `iter/udp` program. Each part below writes one stretch of it, jumping between them by
/// label.
fn program(ids: &KernelIds, maps: &ProgMaps) -> Vec<Insn> {
    let mut a = Asm::default();
    socket_keys(&mut a, ids);
    frontend6(&mut a, ids, maps);
    frontend4(&mut a, ids, maps);
    destroy_pinned(&mut a, ids, maps.destroy);
    // Every label is defined above.
    a.finish().unwrap_or_default()
}

/// The socket's storage in `store` (r6), slot 0, if it holds the peer (`words` 32-bit words
/// of address at `addr_at` in the slot, the key's copy at `K + 8`; the port at `port_at`,
/// the key's at `key_port`): its frontend into the destroy key and on to `pair`; anything
/// else on to `miss`. A socket LB connected holds its one pair in slot 0 (`sk_store`).
fn from_store(a: &mut Asm, store: RawFd, words: i16, key_port: i16, miss: &'static str) {
    let (addr_at, front_at) = (4, 4 + 4 * words);
    let port_at = 4 + 8 * words;
    a.ld_map_fd(R1, store);
    a.mov(R2, R6);
    a.mov_imm(R3, 0);
    a.mov_imm(R4, 0);
    a.call(BPF_FUNC_SK_STORAGE_GET);
    a.jeq(R0, 0, miss);
    // `used`: no slot, no pair.
    a.ldx(Sz::B, R2, R0, 0);
    a.jeq(R2, 0, miss);
    for w in 0..words {
        a.ldx(Sz::W, R2, R0, addr_at + 4 * w);
        a.ldx(Sz::W, R1, FP, K + 8 + 4 * w);
        a.jne_reg(R2, R1, miss);
    }
    a.ldx(Sz::H, R2, R0, port_at);
    a.ldx(Sz::H, R1, FP, key_port);
    a.jne_reg(R2, R1, miss);
    for w in 0..words {
        a.ldx(Sz::W, R2, R0, front_at + 4 * w);
        a.stx(Sz::W, FP, D + 4 * w, R2);
    }
    a.ldx(Sz::H, R2, R0, port_at + 2);
    a.stx(Sz::H, FP, D + 32, R2);
    a.ja("pair");
}

/// Reads the socket: skips all but connected ones, fills the keys' socket cookie and backend
/// port, and branches by family (`v4`, `v6`) or to `out`. The parts after rely on r6 (the
/// socket) and r3 (the backend port) it leaves.
fn socket_keys(a: &mut Asm, ids: &KernelIds) {
    // r6 = ctx->udp_sk (`struct bpf_iter__udp`: meta, udp_sk, ...); NULL at the end of the walk.
    a.ldx(Sz::Dw, R6, R1, 8);
    a.jeq(R6, 0, "out");
    a.ldx(Sz::B, R2, R6, ids.state);
    a.jne(R2, TCP_ESTABLISHED, "out");
    a.ldx(Sz::H, R7, R6, ids.family);
    for i in 1..=9 {
        a.st(Sz::Dw, FP, -8 * i, 0);
    }
    a.mov(R1, R6);
    a.call(BPF_FUNC_GET_SOCKET_COOKIE);
    a.stx(Sz::Dw, FP, K, R0);
    // r3 = the peer port in host order: the destroy key's backend port.
    a.ldx(Sz::H, R3, R6, ids.dport);
    a.be16(R3);
    a.stx(Sz::H, FP, D + 34, R3);
    a.jeq(R7, AF_INET, "v4");
    a.jne(R7, AF_INET6, "out");
    // An IPv6 socket connected to ::ffff:a.b.c.d: socket LB used the IPv4 maps, and the
    // kernel keeps the IPv4 peer in skc_daddr too.
    a.ldx(Sz::W, R2, R6, ids.v6_daddr);
    a.jne(R2, 0, "v6");
    a.ldx(Sz::W, R2, R6, ids.v6_daddr + 4);
    a.jne(R2, 0, "v6");
    a.ldx(Sz::W, R2, R6, ids.v6_daddr + 8);
    a.jeq32(R2, u32::from_ne_bytes([0, 0, 0xff, 0xff]), "v4");
}

/// `v6`: the socket's `lb6_sk_store`, else the `lb6_sk_revnat` lookup; the frontend into the
/// destroy key, then `pair`.
fn frontend6(a: &mut Asm, ids: &KernelIds, maps: &ProgMaps) {
    a.label("v6");
    for w in 0..4 {
        a.ldx(Sz::W, R2, R6, ids.v6_daddr + 4 * w);
        a.stx(Sz::W, FP, K + 8 + 4 * w, R2);
        a.stx(Sz::W, FP, D + 16 + 4 * w, R2);
    }
    a.stx(Sz::H, FP, K + 24, R3);
    a.st(Sz::B, FP, D + 36, 6);
    if let Some(store) = maps.store6 {
        from_store(a, store, 4, K + 24, "lru6");
    }
    a.label("lru6");
    a.lookup_or_out(maps.revnat6, K);
    // `SkRevNat6Value`: the frontend's address, then its port.
    for w in 0..4 {
        a.ldx(Sz::W, R2, R0, 4 * w);
        a.stx(Sz::W, FP, D + 4 * w, R2);
    }
    a.ldx(Sz::H, R2, R0, 16);
    a.stx(Sz::H, FP, D + 32, R2);
    a.ja("pair");
}

/// `v4`: the socket's `lb4_sk_store`, else the `lb4_sk_revnat` lookup; the frontend into the
/// destroy key.
fn frontend4(a: &mut Asm, ids: &KernelIds, maps: &ProgMaps) {
    a.label("v4");
    a.ldx(Sz::W, R2, R6, ids.daddr);
    a.stx(Sz::W, FP, K + 8, R2);
    a.stx(Sz::W, FP, D + 16, R2);
    a.stx(Sz::H, FP, K + 12, R3);
    a.st(Sz::B, FP, D + 36, 4);
    if let Some(store) = maps.store4 {
        from_store(a, store, 1, K + 12, "lru4");
    }
    a.label("lru4");
    a.lookup_or_out(maps.revnat4, K);
    // `SkRevNat4Value`.
    a.ldx(Sz::W, R2, R0, 0);
    a.stx(Sz::W, FP, D, R2);
    a.ldx(Sz::H, R2, R0, 4);
    a.stx(Sz::H, FP, D + 32, R2);
}

/// `pair`: destroys the socket if `lb_udp_destroy` holds its (frontend, backend) pair, counting
/// it there; `out`: the end.
fn destroy_pinned(a: &mut Asm, ids: &KernelIds, destroy: RawFd) {
    a.label("pair");
    a.lookup_or_out(destroy, D);
    a.mov(R9, R0);
    a.mov(R1, R6);
    a.call_kfunc(ids.sock_destroy);
    a.jne(R0, 0, "out");
    // Atomic add of 1 to the pair's counter.
    a.mov_imm(R1, 1);
    a.raw(0xdb, R9, R1, 0, 0);
    a.label("out");
    a.mov_imm(R0, 0);
    a.raw(0x95, 0, 0, 0, 0);
}

// ---------------------------------------------------------------------------------------------
// bpf(2).

const BPF_MAP_CREATE: u32 = 0;
const BPF_MAP_LOOKUP_ELEM: u32 = 1;
const BPF_MAP_UPDATE_ELEM: u32 = 2;
const BPF_MAP_DELETE_ELEM: u32 = 3;
const BPF_PROG_LOAD: u32 = 5;
const BPF_OBJ_GET: u32 = 7;
const BPF_LINK_CREATE: u32 = 28;
const BPF_ITER_CREATE: u32 = 33;
const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_PROG_TYPE_TRACING: u32 = 26;
const BPF_TRACE_ITER: u32 = 28;

/// A `union bpf_attr`, written field by field at the kernel's offsets.
struct Attr([u8; 128]);

impl Attr {
    fn new() -> Self {
        Self([0; 128])
    }
    fn u32(mut self, off: usize, v: u32) -> Self {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(mut self, off: usize, v: u64) -> Self {
        self.0[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn name(mut self, off: usize, name: &str) -> Self {
        let n = name.len().min(15);
        self.0[off..off + n].copy_from_slice(&name.as_bytes()[..n]);
        self
    }
    fn sys(&mut self, cmd: u32) -> io::Result<i64> {
        // SAFETY: bpf(2) reads (and for some commands writes) at most `size` bytes of the
        // attribute buffer, which lives for the call; pointers inside it point at live data
        // owned by the caller.
        let r = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                self.0.as_mut_ptr(),
                self.0.len() as libc::c_uint,
            )
        };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }
    fn fd(&mut self, cmd: u32) -> io::Result<OwnedFd> {
        let fd = RawFd::try_from(self.sys(cmd)?).map_err(io::Error::other)?;
        // SAFETY: the command returned a new file descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

fn map_update(map: &OwnedFd, key: &[u8], value: &[u8]) -> io::Result<()> {
    Attr::new()
        .u32(0, map.as_raw_fd() as u32)
        .u64(8, key.as_ptr() as u64)
        .u64(16, value.as_ptr() as u64)
        .sys(BPF_MAP_UPDATE_ELEM)
        .map(drop)
}

fn map_lookup(map: &OwnedFd, key: &[u8], value: &mut [u8]) -> io::Result<()> {
    Attr::new()
        .u32(0, map.as_raw_fd() as u32)
        .u64(8, key.as_ptr() as u64)
        .u64(16, value.as_mut_ptr() as u64)
        .sys(BPF_MAP_LOOKUP_ELEM)
        .map(drop)
}

fn map_delete(map: &OwnedFd, key: &[u8]) -> io::Result<()> {
    Attr::new()
        .u32(0, map.as_raw_fd() as u32)
        .u64(8, key.as_ptr() as u64)
        .sys(BPF_MAP_DELETE_ELEM)
        .map(drop)
}

/// `lb_udp_gone`, the pairs `lb_sk_egress` drops datagrams for (the fallback where a socket
/// cannot be destroyed).
#[derive(Debug)]
pub struct GoneMap(pub OwnedFd);

impl GoneMap {
    pub fn insert(&self, key: &DestroyKey) -> io::Result<()> {
        map_update(&self.0, key_bytes(key), &0u32.to_ne_bytes())
    }

    /// Removes `key`; absent is fine.
    pub fn remove(&self, key: &DestroyKey) -> io::Result<()> {
        match map_delete(&self.0, key_bytes(key)) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            r => r,
        }
    }
}

fn obj_get(path: &Path) -> anyhow::Result<OwnedFd> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    Attr::new()
        .u64(0, c.as_ptr() as u64)
        .fd(BPF_OBJ_GET)
        .with_context(|| format!("opening {}", path.display()))
}

/// The loaded iterator: its map of gone pairs and its link.
#[derive(Debug)]
pub struct Destroyer {
    map: OwnedFd,
    link: OwnedFd,
    _prog: OwnedFd,
}

/// What one pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Sockets destroyed.
    pub destroyed: u64,
    /// Network namespaces walked.
    pub netns: usize,
    /// Namespaces that could not be entered or walked, with why.
    pub failed: Vec<String>,
}

impl Destroyer {
    /// Loads the program against the `lb*_sk_revnat` maps pinned in `pin_dir`. Fails with the
    /// reason on kernels without `bpf_sock_destroy`, iter/udp or vmlinux BTF.
    pub fn load(pin_dir: &Path) -> anyhow::Result<Self> {
        let raw = std::fs::read("/sys/kernel/btf/vmlinux").context("reading vmlinux BTF")?;
        let ids = KernelIds::from_btf(&Btf::parse(raw)?)?;
        let revnat4 = obj_get(&pin_dir.join(map_names::SK_REVNAT4))?;
        let revnat6 = obj_get(&pin_dir.join(map_names::SK_REVNAT6))?;
        // Absent only in pins of an older lb, which wrote nothing there.
        let store4 = obj_get(&pin_dir.join(map_names::SK_STORE4)).ok();
        let store6 = obj_get(&pin_dir.join(map_names::SK_STORE6)).ok();
        let map = Attr::new()
            .u32(0, BPF_MAP_TYPE_HASH)
            .u32(4, size_of::<DestroyKey>() as u32)
            .u32(8, 8)
            .u32(12, MAX_PAIRS)
            .name(28, DESTROY_MAP)
            .fd(BPF_MAP_CREATE)
            .context("creating lb_udp_destroy")?;
        let insns = program(
            &ids,
            &ProgMaps {
                revnat4: revnat4.as_raw_fd(),
                revnat6: revnat6.as_raw_fd(),
                store4: store4.as_ref().map(|f| f.as_raw_fd()),
                store6: store6.as_ref().map(|f| f.as_raw_fd()),
                destroy: map.as_raw_fd(),
            },
        );
        let license = c"Dual MIT/GPL";
        let mut log = vec![0u8; 1 << 16];
        let load = |log_level: u32, log: &mut [u8]| {
            Attr::new()
                .u32(0, BPF_PROG_TYPE_TRACING)
                .u32(4, insns.len() as u32)
                .u64(8, insns.as_ptr() as u64)
                .u64(16, license.as_ptr() as u64)
                .u32(24, log_level)
                .u32(28, if log_level > 0 { log.len() as u32 } else { 0 })
                .u64(
                    32,
                    if log_level > 0 {
                        log.as_mut_ptr() as u64
                    } else {
                        0
                    },
                )
                .name(48, PROG_NAME)
                .u32(68, BPF_TRACE_ITER)
                .u32(108, ids.iter_udp)
                .fd(BPF_PROG_LOAD)
        };
        let prog = match load(0, &mut log) {
            Ok(p) => p,
            Err(e) => {
                // Again with the verifier's log, for the error.
                let _ = load(1, &mut log);
                let end = log.iter().position(|&c| c == 0).unwrap_or(log.len());
                let text = String::from_utf8_lossy(&log[..end]);
                let tail: Vec<&str> = text.lines().rev().take(6).collect();
                bail!(
                    "loading {PROG_NAME}: {e}; verifier: {}",
                    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                );
            }
        };
        let link = Attr::new()
            .u32(0, prog.as_raw_fd() as u32)
            .u32(8, BPF_TRACE_ITER)
            .fd(BPF_LINK_CREATE)
            .context("creating the iter/udp link")?;
        Ok(Self {
            map,
            link,
            _prog: prog,
        })
    }

    fn update(&self, key: &DestroyKey) -> io::Result<()> {
        map_update(&self.map, key_bytes(key), &0u64.to_ne_bytes())
    }

    fn take(&self, key: &DestroyKey) -> u64 {
        let mut v = [0u8; 8];
        let found = map_lookup(&self.map, key_bytes(key), &mut v).is_ok();
        let _ = map_delete(&self.map, key_bytes(key));
        if found { u64::from_ne_bytes(v) } else { 0 }
    }

    /// Runs the iterator once in the calling thread's current network namespace.
    fn walk(&self) -> io::Result<()> {
        let iter = Attr::new()
            .u32(0, self.link.as_raw_fd() as u32)
            .fd(BPF_ITER_CREATE)?;
        let mut f = File::from(iter);
        let mut buf = [0u8; 256];
        // The program prints nothing: the walk is done when read() returns 0.
        while f.read(&mut buf)? > 0 {}
        Ok(())
    }

    /// Destroys the connected UDP sockets socket LB pinned to one of `pairs`, in each of
    /// `netns` (open `/proc/PID/ns/net` files). Enters each namespace on the calling thread
    /// (`setns`, CAP_SYS_ADMIN) and returns to `home` after.
    pub fn pass(&self, pairs: &[DestroyKey], netns: &[(String, File)], home: &File) -> PassReport {
        let mut report = PassReport::default();
        let mut used = Vec::new();
        for chunk in pairs.chunks(MAX_PAIRS as usize) {
            used.clear();
            for p in chunk {
                match self.update(p) {
                    Ok(()) => used.push(*p),
                    Err(e) => report.failed.push(format!("lb_udp_destroy: {e}")),
                }
            }
            for (name, ns) in netns {
                let r = nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(io::Error::from)
                    .and_then(|()| self.walk());
                match r {
                    Ok(()) => report.netns += 1,
                    Err(e) => report.failed.push(format!("{name}: {e}")),
                }
            }
            if let Err(e) = nix::sched::setns(home, nix::sched::CloneFlags::CLONE_NEWNET) {
                report.failed.push(format!("back to lb's netns: {e}"));
            }
            report.destroyed += used.iter().map(|p| self.take(p)).sum::<u64>();
        }
        report
    }
}

/// The network namespaces of every process in cgroup `root` and below (socket LB's cgroup),
/// deduplicated, each with a name for logs (`pid N`). Processes that vanish or whose namespace
/// cannot be opened (CAP_SYS_PTRACE for other users' processes) are counted in the second
/// value.
pub fn netns_in_cgroup(root: &Path) -> (Vec<(String, File)>, usize) {
    use std::os::unix::fs::MetadataExt as _;
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    let mut unreadable = 0;
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            for pid in text.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
                let opened = File::open(format!("/proc/{pid}/ns/net"))
                    .and_then(|f| f.metadata().map(|m| (f, (m.dev(), m.ino()))));
                match opened {
                    Ok((f, id)) => {
                        if seen.insert(id) {
                            out.push((format!("pid {pid}"), f));
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(_) => unreadable += 1,
                }
            }
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(e.path());
                }
            }
        }
    }
    (out, unreadable)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> KernelIds {
        KernelIds {
            iter_udp: 100,
            sock_destroy: 200,
            daddr: 0,
            dport: 12,
            family: 16,
            state: 18,
            v6_daddr: 56,
        }
    }

    #[test]
    fn program_jumps_stay_inside_and_it_ends_with_exit() {
        // Without the socket storage maps (pins of an older lb) and with them.
        for (store4, store6, want) in [
            (None, None, vec![4, 3, 5]),
            (Some(6), Some(7), vec![7, 4, 6, 3, 5]),
        ] {
            let maps = ProgMaps {
                revnat4: 3,
                revnat6: 4,
                store4,
                store6,
                destroy: 5,
            };
            let p = program(&ids(), &maps);
            assert!(p.len() > 40 && p.len() < 180, "{} insns", p.len());
            assert_eq!(p.last().map(|i| i.code), Some(0x95));
            for (at, i) in p.iter().enumerate() {
                let class = i.code & 0x07;
                if (class == 0x05 || class == 0x06) && i.code != 0x85 && i.code != 0x95 {
                    let target = at as i64 + 1 + i64::from(i.off);
                    assert!(i.off >= 0 && (target as usize) < p.len(), "jump at {at}");
                }
            }
            // Exactly one kfunc call, to the id given.
            let kfuncs: Vec<_> = p
                .iter()
                .filter(|i| i.code == 0x85 && i.regs >> 4 == BPF_PSEUDO_KFUNC_CALL)
                .collect();
            assert_eq!(kfuncs.len(), 1);
            assert_eq!(kfuncs[0].imm, 200);
            // The maps, by fd: each family's storage before its LRU.
            let fds: Vec<i32> = p.iter().filter(|i| i.code == 0x18).map(|i| i.imm).collect();
            assert_eq!(fds, want);
        }
    }

    #[test]
    fn destroy_key_bytes_follow_the_layout() {
        let k = DestroyKey {
            frontend: [1; 16],
            backend: [2; 16],
            frontend_port: 53,
            backend_port: 8080,
            family: 4,
            pad: [0; 3],
        };
        // The offsets the program writes the key at (D + 16, D + 32, D + 34, D + 36).
        let b = key_bytes(&k);
        assert_eq!(b.len(), 40);
        assert_eq!(b[0], 1);
        assert_eq!(b[16], 2);
        assert_eq!(u16::from_ne_bytes([b[32], b[33]]), 53);
        assert_eq!(u16::from_ne_bytes([b[34], b[35]]), 8080);
        assert_eq!(b[36], 4);
    }

    /// The running kernel's BTF (when it has one) yields sock_common's well-known head.
    #[test]
    fn reads_sock_common_from_vmlinux_btf() {
        let Ok(raw) = std::fs::read("/sys/kernel/btf/vmlinux") else {
            eprintln!("skipped: no /sys/kernel/btf/vmlinux");
            return;
        };
        let btf = Btf::parse(raw).unwrap();
        let sc = btf.find("sock_common", BTF_KIND_STRUCT).unwrap();
        assert_eq!(btf.member_offset(sc, "skc_daddr"), Some(0));
        assert_eq!(btf.member_offset(sc, "skc_dport"), Some(12));
        assert_eq!(btf.member_offset(sc, "skc_family"), Some(16));
        assert_eq!(btf.member_offset(sc, "skc_state"), Some(18));
        assert!(btf.member_offset(sc, "skc_v6_daddr").is_some());
        assert!(btf.find("bpf_iter_udp", BTF_KIND_FUNC).is_some());
    }

    /// Where the kernel has the kfunc, the verifier takes the program and a walk of this
    /// netns runs (against maps of the `lb*_sk_revnat` layout pinned in a fresh directory).
    #[test]
    fn loads_and_walks_where_the_kfunc_exists() {
        let syms = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        if !syms.lines().any(|l| l.ends_with(" bpf_sock_destroy")) {
            eprintln!("skipped: no bpf_sock_destroy (before 6.5)");
            return;
        }
        let dir = Path::new("/sys/fs/bpf").join(format!("lb-sockterm-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pin = |name: &str, key: u32, value: u32| {
            let fd = Attr::new()
                .u32(0, 9) // BPF_MAP_TYPE_LRU_HASH
                .u32(4, key)
                .u32(8, value)
                .u32(12, 16)
                .fd(BPF_MAP_CREATE)
                .unwrap();
            let path =
                std::ffi::CString::new(dir.join(name).as_os_str().as_encoded_bytes()).unwrap();
            Attr::new()
                .u64(0, path.as_ptr() as u64)
                .u32(8, fd.as_raw_fd() as u32)
                .sys(6) // BPF_OBJ_PIN
                .unwrap();
        };
        pin(map_names::SK_REVNAT4, 16, 12);
        pin(map_names::SK_REVNAT6, 32, 24);
        let loaded = Destroyer::load(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        let d = loaded.unwrap();
        let home = File::open("/proc/thread-self/ns/net").unwrap();
        let ns = vec![(
            "self".to_string(),
            File::open("/proc/thread-self/ns/net").unwrap(),
        )];
        let r = d.pass(&[DestroyKey::default()], &ns, &home);
        assert_eq!(
            r,
            PassReport {
                destroyed: 0,
                netns: 1,
                failed: vec![]
            }
        );
    }
}
