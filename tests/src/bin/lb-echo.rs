//! `lb-echo`: the backend and the client used by the demo and the network-namespace tests.
//!
//! * `lb-echo serve --name NAME --port PORT` answers every TCP line and every UDP datagram with
//!   `NAME PEER\n` (PEER: the client address it saw), on one dual-stack `[::]:PORT` socket per
//!   protocol (IPv4 arrives as v4-mapped and is shown as IPv4).
//!   It prints `ready NAME PORT` on stdout once both sockets are bound.
//! * `lb-echo client --target IP:PORT --proto tcp|udp [--count N] [--connected-udp]
//!   [--timeout-ms MS]` sends `hello\n` N times, each time from a fresh socket (a new flow with a
//!   new source port), and prints one JSON line per request:
//!   `{"seq":0,"backend":"NAME","seen_by_backend":"IP:PORT","peer":"IP:PORT","local":"IP:PORT"}` or
//!   `{"seq":0,"error":"…"}`. `peer` is what the kernel reports as the other end (TCP:
//!   `getpeername`; UDP: the source of the reply from `recvfrom`, or `getpeername` with
//!   `--connected-udp`). `local` is the socket's local address; for unconnected UDP its IP is the
//!   destination address of the reply (from `IP_PKTINFO`/`IPV6_PKTINFO`). The exit code is 1 if
//!   any request failed.
//! * `lb-echo stream --target IP:PORT [--interval-ms 10] --duration-ms MS` behaves like a DNS
//!   resolver's connected UDP socket: one socket connect()ed to the target, a datagram every
//!   interval, replies read in between; on any error it closes the socket and connects a new
//!   one. One JSON line per event, `t_ms` since start: `{"t_ms":0,"event":"connect",...}`,
//!   `{"t_ms":..,"event":"reply","backend":"NAME"}`, `{"t_ms":..,"event":"error","op":"send"|
//!   "recv","errno":N,"error":"…"}`, and last `{"event":"done","sent":N,"received":M}`.
//! * `lb-echo multi --target IP:PORT --target IP:PORT… [--rounds N]` is an unconnected UDP
//!   client talking to several services from one socket (a resolver with several name
//!   servers): each round one `send_to` per target, in order, each followed by its reply. One
//!   JSON line per request: `{"round":0,"target":"IP:PORT","backend":"NAME","peer":"IP:PORT"}`
//!   (`peer`: the reply's source from `recvfrom`) or `{"round":0,"target":…,"error":"…"}`.
//!   The socket has the first target's family.
//! * `lb-echo ping --target IP [--count N] [--timeout-ms MS]` is `ping`: N ICMP/ICMPv6 echo
//!   requests from a raw socket (root), one JSON line each: `{"seq":0,"reply_from":"IP",
//!   "ttl":64}` (the reply's TTL; 0 for IPv6), or `{"seq":0,"error":"…"}` (an unreachable
//!   error's type and sender, or a timeout). The exit code is 1 if any request got no reply.
use std::{
    io::{self, BufRead, BufReader, Read as _, Write as _},
    mem,
    net::{
        IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener, TcpStream,
        UdpSocket,
    },
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    process::ExitCode,
    thread,
    time::Duration,
};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand, ValueEnum};

/// The request every client sends.
const HELLO: &[u8] = b"hello\n";
/// What pads a UDP reply after its line (to answer a large request with a large datagram).
const PAD: u8 = b'#';
/// Longest reply line the client accepts.
const MAX_REPLY: u64 = 4096;

#[derive(Parser)]
#[command(name = "lb-echo", about = "Echo backend and client for lb tests")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Answer every TCP line and UDP datagram with `NAME PEER\n` on [::]:PORT (IPv4 and IPv6).
    Serve {
        #[arg(long)]
        name: String,
        #[arg(long)]
        port: u16,
    },
    /// Send `hello\n` COUNT times, each from a fresh socket, and print one JSON line per request.
    Client {
        /// `198.19.0.1:80` or `[2001:db8:ffff::1]:80`.
        #[arg(long)]
        target: SocketAddr,
        #[arg(long, value_enum)]
        proto: Proto,
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// connect() the UDP socket to the target; report `peer` from getpeername().
        #[arg(long)]
        connected_udp: bool,
        /// Timeout of each connect and each read, in milliseconds.
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
        /// Pause between requests, in milliseconds (continuous load across a restart).
        #[arg(long, default_value_t = 0)]
        interval_ms: u64,
        /// TCP: send every request over one connection (a long-lived flow) instead of a
        /// fresh socket each; a reset or stall fails the rest.
        #[arg(long)]
        keep_connection: bool,
        /// This many bytes of padding in every request line: a bulk upload over TCP (the echo
        /// server answers once the whole line is in); over UDP a datagram that large, which
        /// the server answers with one as large (beyond the MTU: fragments both ways).
        #[arg(long, default_value_t = 0)]
        payload_bytes: usize,
        /// Before every request after the first, wait until this file exists (a test
        /// changes the network between requests, e.g. the path MTU).
        #[arg(long)]
        go_file: Option<std::path::PathBuf>,
    },
    /// One unconnected UDP socket sending to every target in turn, ROUNDS times.
    Multi {
        #[arg(long = "target", required = true)]
        targets: Vec<SocketAddr>,
        #[arg(long, default_value_t = 1)]
        rounds: u32,
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
    },
    /// ICMP/ICMPv6 echo requests (ping), one JSON line per request.
    Ping {
        #[arg(long)]
        target: IpAddr,
        #[arg(long, default_value_t = 1)]
        count: u16,
        /// Timeout of each request, in milliseconds.
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
    },
    /// A resolver-like connected UDP socket sending every interval, reconnecting on errors.
    Stream {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long, default_value_t = 10)]
        interval_ms: u64,
        #[arg(long)]
        duration_ms: u64,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Proto {
    Tcp,
    Udp,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Serve { name, port } => serve(&name, port).map(|()| ExitCode::SUCCESS),
        Cmd::Client {
            target,
            proto,
            count,
            connected_udp,
            timeout_ms,
            interval_ms,
            keep_connection,
            payload_bytes,
            go_file,
        } => client(
            target,
            proto,
            count,
            connected_udp,
            Duration::from_millis(timeout_ms),
            Duration::from_millis(interval_ms),
            Request {
                keep_connection,
                line: request_line(payload_bytes),
                go_file,
            },
        ),
        Cmd::Multi {
            targets,
            rounds,
            timeout_ms,
        } => multi(&targets, rounds, Duration::from_millis(timeout_ms)),
        Cmd::Ping {
            target,
            count,
            timeout_ms,
        } => ping(target, count, Duration::from_millis(timeout_ms)),
        Cmd::Stream {
            target,
            interval_ms,
            duration_ms,
        } => stream(
            target,
            Duration::from_millis(interval_ms.max(1)),
            Duration::from_millis(duration_ms),
        )
        .map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("lb-echo: {err:#}");
            ExitCode::from(2)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// serve

fn serve(name: &str, port: u16) -> anyhow::Result<()> {
    // Replies are "NAME PEER": the backend's name and the client address it saw, so tests can
    // tell whether the source was rewritten on the way.
    let name: &'static str = name.to_owned().leak();
    let tcp = dual_stack_socket(libc::SOCK_STREAM, port).context("TCP socket")?;
    // SAFETY: the fd is a valid socket we own.
    if unsafe { libc::listen(tcp.as_raw_fd(), 1024) } != 0 {
        return Err(io::Error::last_os_error()).context("listen");
    }
    let tcp = TcpListener::from(tcp);
    let udp = UdpSocket::from(dual_stack_socket(libc::SOCK_DGRAM, port).context("UDP socket")?);

    thread::Builder::new()
        .name("udp".into())
        .spawn(move || serve_udp(&udp, name))
        .context("spawn UDP thread")?;

    {
        let mut out = io::stdout().lock();
        writeln!(out, "ready {name} {port}")?;
        out.flush()?;
    }

    for conn in tcp.incoming() {
        match conn {
            Ok(stream) => {
                if let Err(err) = thread::Builder::new().spawn(move || serve_tcp(stream, name)) {
                    eprintln!("lb-echo: spawn connection thread: {err}");
                }
            }
            // E.g. ECONNABORTED or EMFILE: keep serving.
            Err(err) => {
                eprintln!("lb-echo: accept: {err}");
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
    Ok(())
}

/// An AF_INET6 socket with IPV6_V6ONLY=0 and SO_REUSEADDR bound to `[::]:port`.
fn dual_stack_socket(ty: libc::c_int, port: u16) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_INET6, ty | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    setsockopt_int(&fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 0)?;
    setsockopt_int(&fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    // SAFETY: sockaddr_in6 is plain old data; all-zero is the unspecified address, port 0.
    let mut sa: libc::sockaddr_in6 = unsafe { mem::zeroed() };
    sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    sa.sin6_port = port.to_be();
    // SAFETY: sa is a valid sockaddr_in6 and the length matches it.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const sa).cast(),
            socklen_of::<libc::sockaddr_in6>(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

fn setsockopt_int(
    fd: &impl std::os::fd::AsRawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: value is a c_int that lives across the call; the length matches it.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&raw const value).cast(),
            socklen_of::<libc::c_int>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn socklen_of<T>() -> libc::socklen_t {
    libc::socklen_t::try_from(size_of::<T>()).unwrap_or(libc::socklen_t::MAX)
}

/// The reply line: name and the peer as the backend saw it (IPv4 clients of the dual-stack
/// socket shown as IPv4).
fn reply_for(name: &str, peer: SocketAddr) -> Vec<u8> {
    let seen = SocketAddr::new(peer.ip().to_canonical(), peer.port());
    format!("{name} {seen}\n").into_bytes()
}

fn serve_udp(sock: &UdpSocket, name: &str) {
    let mut buf = [0u8; 65536];
    loop {
        match sock.recv_from(&mut buf) {
            Ok((n, peer)) => {
                // A large request gets an answer as large: the reply line, then padding.
                let mut reply = reply_for(name, peer);
                if n > reply.len() {
                    reply.resize(n, PAD);
                }
                if let Err(err) = sock.send_to(&reply, peer) {
                    eprintln!("lb-echo: UDP send_to {peer}: {err}");
                }
            }
            Err(err) => {
                eprintln!("lb-echo: UDP recv_from: {err}");
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn serve_tcp(stream: TcpStream, name: &str) {
    let reply = match stream.peer_addr() {
        Ok(peer) => reply_for(name, peer),
        Err(err) => {
            eprintln!("lb-echo: TCP peer address: {err}");
            return;
        }
    };
    let mut writer = match stream.try_clone() {
        Ok(w) => w,
        Err(err) => {
            eprintln!("lb-echo: clone TCP stream: {err}");
            return;
        }
    };
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                if writer.write_all(&reply).is_err() {
                    return;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// client

struct Reply {
    backend: String,
    /// The client address the backend saw.
    seen: String,
    peer: SocketAddr,
    local: SocketAddr,
}

/// How the client's TCP requests go.
struct Request {
    keep_connection: bool,
    /// What each request sends.
    line: Vec<u8>,
    go_file: Option<std::path::PathBuf>,
}

/// `hello`, padded with `payload` bytes, and a newline.
fn request_line(payload: usize) -> Vec<u8> {
    let mut line = HELLO[..HELLO.len() - 1].to_vec();
    line.resize(line.len() + payload, b'x');
    line.push(b'\n');
    line
}

/// Waits until `path` exists (polling), at most `limit`.
fn wait_for_file(path: &std::path::Path, limit: Duration) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    while !path.exists() {
        if start.elapsed() > limit {
            bail!("{} did not appear within {limit:?}", path.display());
        }
        thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

fn client(
    target: SocketAddr,
    proto: Proto,
    count: u32,
    connected_udp: bool,
    timeout: Duration,
    interval: Duration,
    req: Request,
) -> anyhow::Result<ExitCode> {
    if timeout.is_zero() {
        bail!("--timeout-ms must be positive");
    }
    let mut failed = false;
    let mut out = io::stdout().lock();
    let mut kept: Option<(TcpStream, BufReader<TcpStream>)> = None;
    for seq in 0..count {
        if seq > 0 && !interval.is_zero() {
            thread::sleep(interval);
        }
        if let Some(go) = req.go_file.as_deref().filter(|_| seq > 0) {
            wait_for_file(go, Duration::from_secs(120))?;
        }
        let result = match proto {
            Proto::Tcp if req.keep_connection => {
                request_kept(&mut kept, target, timeout, &req.line)
            }
            Proto::Tcp => request_tcp(target, timeout, &req.line),
            Proto::Udp if connected_udp => request_udp_connected(target, timeout, &req.line),
            Proto::Udp => request_udp(target, timeout, &req.line),
        };
        let line = match result {
            Ok(r) => serde_json::json!({
                "seq": seq,
                "backend": r.backend,
                "seen_by_backend": r.seen,
                "peer": r.peer.to_string(),
                "local": r.local.to_string(),
            }),
            Err(err) => {
                failed = true;
                serde_json::json!({ "seq": seq, "error": format!("{err:#}") })
            }
        };
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn request_tcp(target: SocketAddr, timeout: Duration, line: &[u8]) -> anyhow::Result<Reply> {
    let stream = connect_tcp(target, timeout)?;
    exchange(&stream, &mut BufReader::new(&stream), line)
}

/// One request over the connection in `kept`, opened on first use. A failure keeps the
/// connection broken: the rest fail too, as a reset flow would for an application.
fn request_kept(
    kept: &mut Option<(TcpStream, BufReader<TcpStream>)>,
    target: SocketAddr,
    timeout: Duration,
    line: &[u8],
) -> anyhow::Result<Reply> {
    let (stream, reader) = match kept {
        Some(k) => k,
        None => {
            let stream = connect_tcp(target, timeout)?;
            let reader = BufReader::new(stream.try_clone()?);
            kept.insert((stream, reader))
        }
    };
    exchange(stream, reader, line)
}

/// A TCP connection to `target` whose connect, reads and writes time out after `timeout`.
fn connect_tcp(target: SocketAddr, timeout: Duration) -> anyhow::Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&target, timeout).context("connect")?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    Ok(stream)
}

/// Sends `request` (a line) on `stream` and reads the reply line from `reader`, which reads
/// the same connection.
fn exchange(
    stream: &TcpStream,
    reader: &mut impl BufRead,
    request: &[u8],
) -> anyhow::Result<Reply> {
    let peer = stream.peer_addr().context("getpeername")?;
    let local = stream.local_addr().context("getsockname")?;
    (&*stream).write_all(request).context("send")?;
    let mut line = Vec::new();
    reader
        .take(MAX_REPLY)
        .read_until(b'\n', &mut line)
        .map_err(timeout_err)
        .context("read reply")?;
    if line.last() != Some(&b'\n') {
        bail!(
            "connection closed before a full reply line ({} bytes)",
            line.len()
        );
    }
    let (backend, seen) = parse_reply(&line)?;
    Ok(Reply {
        backend,
        seen,
        peer,
        local,
    })
}

/// A fresh UDP socket of the target's family on an ephemeral port.
fn udp_socket(target: SocketAddr, timeout: Duration) -> anyhow::Result<UdpSocket> {
    let any: SocketAddr = match target {
        SocketAddr::V4(_) => SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, 0, 0, 0).into(),
    };
    let sock = UdpSocket::bind(any).context("bind UDP socket")?;
    sock.set_read_timeout(Some(timeout))?;
    sock.set_write_timeout(Some(timeout))?;
    Ok(sock)
}

/// `lb-echo multi`: one socket, every target in turn; exit code 1 if a request failed.
fn multi(targets: &[SocketAddr], rounds: u32, timeout: Duration) -> anyhow::Result<ExitCode> {
    let first = *targets.first().context("no target")?;
    let sock = udp_socket(first, timeout)?;
    let mut out = io::stdout().lock();
    let mut failed = false;
    let mut buf = vec![0u8; 65536];
    for round in 0..rounds {
        for target in targets {
            let reply = sock
                .send_to(HELLO, target)
                .context("send_to")
                .and_then(|_| {
                    sock.recv_from(&mut buf)
                        .map_err(timeout_err)
                        .context("recv_from")
                })
                .and_then(|(n, peer)| Ok((parse_reply(&buf[..n])?.0, peer)));
            let line = match reply {
                Ok((backend, peer)) => serde_json::json!({
                    "round": round, "target": target.to_string(),
                    "backend": backend, "peer": peer.to_string(),
                }),
                Err(err) => {
                    failed = true;
                    serde_json::json!({
                        "round": round, "target": target.to_string(), "error": format!("{err:#}"),
                    })
                }
            };
            writeln!(out, "{line}")?;
        }
    }
    out.flush()?;
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn request_udp_connected(
    target: SocketAddr,
    timeout: Duration,
    request: &[u8],
) -> anyhow::Result<Reply> {
    let sock = udp_socket(target, timeout)?;
    sock.connect(target).context("connect")?;
    sock.send(request).context("send")?;
    let mut buf = vec![0u8; 65536];
    let n = sock.recv(&mut buf).map_err(timeout_err).context("recv")?;
    let (backend, seen) = parse_reply(&buf[..n])?;
    Ok(Reply {
        backend,
        seen,
        peer: sock.peer_addr().context("getpeername")?,
        local: sock.local_addr().context("getsockname")?,
    })
}

fn request_udp(target: SocketAddr, timeout: Duration, request: &[u8]) -> anyhow::Result<Reply> {
    let sock = udp_socket(target, timeout)?;
    match target {
        SocketAddr::V4(_) => setsockopt_int(&sock, libc::IPPROTO_IP, libc::IP_PKTINFO, 1),
        SocketAddr::V6(_) => setsockopt_int(&sock, libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO, 1),
    }
    .context("enable PKTINFO")?;
    sock.send_to(request, target).context("send_to")?;
    let mut buf = vec![0u8; 65536];
    let (n, peer, dst) = recv_with_dst(&sock, &mut buf)
        .map_err(timeout_err)
        .context("recv_from")?;
    let mut local = sock.local_addr().context("getsockname")?;
    if let Some(dst) = dst {
        local.set_ip(dst);
    }
    let (backend, seen) = parse_reply(&buf[..n])?;
    Ok(Reply {
        backend,
        seen,
        peer,
        local,
    })
}

/// recvmsg(2): the datagram's length, its source, and its destination address (from PKTINFO).
fn recv_with_dst(
    sock: &UdpSocket,
    buf: &mut [u8],
) -> io::Result<(usize, SocketAddr, Option<IpAddr>)> {
    // SAFETY (all blocks below): the pointers handed to recvmsg point into locals that outlive
    // the call, with matching lengths; the cmsg walk uses the libc macros on that same msghdr, and
    // payloads are read unaligned with the type the kernel writes for (level, type).
    let mut src: libc::sockaddr_storage = unsafe { mem::zeroed() };
    let mut cmsg_buf = [0u64; 32];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_name = (&raw mut src).cast();
    msg.msg_namelen = socklen_of::<libc::sockaddr_storage>();
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg_buf.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&cmsg_buf);
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &raw mut msg, 0) };
    let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    let peer = match libc::c_int::from(src.ss_family) {
        libc::AF_INET => {
            let sa: libc::sockaddr_in =
                unsafe { (&raw const src).cast::<libc::sockaddr_in>().read() };
            SocketAddr::from((
                Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
                u16::from_be(sa.sin_port),
            ))
        }
        libc::AF_INET6 => {
            let sa: libc::sockaddr_in6 =
                unsafe { (&raw const src).cast::<libc::sockaddr_in6>().read() };
            SocketAddrV6::new(
                Ipv6Addr::from(sa.sin6_addr.s6_addr),
                u16::from_be(sa.sin6_port),
                sa.sin6_flowinfo,
                sa.sin6_scope_id,
            )
            .into()
        }
        family => {
            return Err(io::Error::other(format!(
                "recvmsg: unexpected address family {family}"
            )));
        }
    };
    let mut dst = None;
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&raw const msg) };
    while !cmsg.is_null() {
        let hdr = unsafe { cmsg.read_unaligned() };
        let data = unsafe { libc::CMSG_DATA(cmsg) };
        if hdr.cmsg_level == libc::IPPROTO_IP && hdr.cmsg_type == libc::IP_PKTINFO {
            let info = unsafe { data.cast::<libc::in_pktinfo>().read_unaligned() };
            dst = Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                info.ipi_addr.s_addr,
            ))));
        } else if hdr.cmsg_level == libc::IPPROTO_IPV6 && hdr.cmsg_type == libc::IPV6_PKTINFO {
            let info = unsafe { data.cast::<libc::in6_pktinfo>().read_unaligned() };
            dst = Some(IpAddr::V6(Ipv6Addr::from(info.ipi6_addr.s6_addr)));
        }
        cmsg = unsafe { libc::CMSG_NXTHDR(&raw const msg, cmsg) };
    }
    Ok((n, peer, dst))
}

// ---------------------------------------------------------------------------------------------
// stream

fn stream(target: SocketAddr, interval: Duration, duration: Duration) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    let mut out = io::stdout().lock();
    let mut emit = |mut v: serde_json::Value| -> anyhow::Result<()> {
        v["t_ms"] = serde_json::json!(start.elapsed().as_secs_f64() * 1000.0);
        writeln!(out, "{v}")?;
        Ok(out.flush()?)
    };
    let connect = || -> anyhow::Result<UdpSocket> {
        let sock = udp_socket(target, interval)?;
        sock.connect(target).context("connect")?;
        Ok(sock)
    };
    let mut sock = connect()?;
    emit(serde_json::json!({"event": "connect", "local": sock.local_addr()?.to_string()}))?;
    let (mut sent, mut received) = (0u64, 0u64);
    let mut next_send = start;
    let mut buf = [0u8; 4096];
    while start.elapsed() < duration {
        let now = std::time::Instant::now();
        let mut failed = None;
        if now >= next_send {
            next_send += interval;
            match sock.send(HELLO) {
                Ok(_) => sent += 1,
                Err(e) => failed = Some(("send", e)),
            }
        }
        if failed.is_none() {
            let wait = next_send
                .saturating_duration_since(std::time::Instant::now())
                .max(Duration::from_millis(1));
            sock.set_read_timeout(Some(wait))?;
            match sock.recv(&mut buf) {
                Ok(n) => {
                    received += 1;
                    let (backend, _) = parse_reply(&buf[..n])?;
                    emit(serde_json::json!({"event": "reply", "backend": backend}))?;
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => failed = Some(("recv", e)),
            }
        }
        if let Some((op, e)) = failed {
            emit(serde_json::json!({
                "event": "error", "op": op, "errno": e.raw_os_error(), "error": e.to_string(),
            }))?;
            // What a resolver does: drop the socket, connect a new one (socket LB balances it).
            sock = connect()?;
            emit(serde_json::json!({"event": "connect", "local": sock.local_addr()?.to_string()}))?;
        }
    }
    writeln!(
        out,
        "{}",
        serde_json::json!({"event": "done", "sent": sent, "received": received})
    )?;
    Ok(())
}

/// SO_RCVTIMEO expiry shows up as EAGAIN; call it a timeout.
fn timeout_err(err: io::Error) -> io::Error {
    if err.kind() == io::ErrorKind::WouldBlock {
        io::Error::new(io::ErrorKind::TimedOut, "timed out")
    } else {
        err
    }
}

/// Splits a reply line `NAME PEER` into the backend's name and the address it saw.
fn parse_reply(reply: &[u8]) -> anyhow::Result<(String, String)> {
    // A UDP reply may carry padding after its line.
    let reply = match reply.iter().position(|&b| b == b'\n') {
        Some(end) if reply[end + 1..].iter().all(|&b| b == PAD) => &reply[..=end],
        _ => reply,
    };
    let text = std::str::from_utf8(reply).context("reply is not UTF-8")?;
    let line = text.trim_end_matches(['\n', '\r']);
    match line.split_once(' ') {
        Some((name, seen)) if !name.is_empty() && !seen.is_empty() && !line.contains('\n') => {
            Ok((name.to_owned(), seen.to_owned()))
        }
        _ => bail!("unexpected reply {text:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// ping

/// Sends `count` echo requests to `target`, one at a time, and prints what came back.
fn ping(target: IpAddr, count: u16, timeout: Duration) -> anyhow::Result<ExitCode> {
    let v6 = target.is_ipv6();
    let (family, proto) = if v6 {
        (libc::AF_INET6, libc::IPPROTO_ICMPV6)
    } else {
        (libc::AF_INET, libc::IPPROTO_ICMP)
    };
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe { libc::socket(family, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) };
    if fd < 0 {
        return Err(io::Error::last_os_error()).context("raw ICMP socket (root?)");
    }
    // SAFETY: fd is a fresh socket that nothing else owns. A raw socket takes the same
    // connect/send/recv calls as a UDP one (the port is ignored), so std's wrapper serves.
    let sock = UdpSocket::from(unsafe { OwnedFd::from_raw_fd(fd) });
    // connect(): the kernel then hands this socket only packets from the target.
    sock.connect(SocketAddr::new(target, 0))
        .with_context(|| format!("connect {target}"))?;
    sock.set_read_timeout(Some(timeout))?;
    let id = (std::process::id() & 0xffff) as u16;
    let mut failed = false;
    for seq in 0..count {
        let mut req = vec![if v6 { 128 } else { 8 }, 0, 0, 0];
        req.extend_from_slice(&id.to_be_bytes());
        req.extend_from_slice(&seq.to_be_bytes());
        req.extend_from_slice(b"lb-echo ping");
        if !v6 {
            // ICMPv6's checksum (with its pseudo-header) is the kernel's on a raw socket.
            let c = icmp_checksum(&req);
            req[2..4].copy_from_slice(&c.to_be_bytes());
        }
        sock.send(&req).context("send")?;
        let line = match ping_reply(&sock, v6, id, seq) {
            Ok(ttl) => {
                serde_json::json!({"seq": seq, "reply_from": target.to_string(), "ttl": ttl})
            }
            Err(err) => {
                failed = true;
                serde_json::json!({"seq": seq, "error": format!("{err:#}")})
            }
        };
        println!("{line}");
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Waits for the answer to echo request (`id`, `seq`): its TTL (IPv4; an IPv6 raw socket sees
/// no IP header: 0), or an error naming an ICMP unreachable about it (or the timeout).
fn ping_reply(sock: &UdpSocket, v6: bool, id: u16, seq: u16) -> anyhow::Result<u8> {
    let mut buf = [0u8; 2048];
    loop {
        // A connected raw socket gets a port unreachable about its own request as an error.
        let n = match sock.recv(&mut buf) {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                bail!("unreachable (port unreachable: {e})")
            }
            r => r.context("no answer")?,
        };
        let pkt = &buf[..n];
        let (ttl, icmp) = if v6 {
            (0, pkt)
        } else {
            let ihl = usize::from(pkt.first().copied().unwrap_or(0) & 0x0f) * 4;
            (
                pkt.get(8).copied().unwrap_or(0),
                pkt.get(ihl..).unwrap_or_default(),
            )
        };
        let field = |o: usize| icmp.get(o..o + 2).map(|b| u16::from_be_bytes([b[0], b[1]]));
        let (reply, unreachable) = if v6 { (129, 1) } else { (0, 3) };
        match icmp.first().copied() {
            Some(t) if t == reply && field(4) == Some(id) && field(6) == Some(seq) => {
                return Ok(ttl);
            }
            Some(t) if t == unreachable => {
                bail!("unreachable (code {})", icmp.get(1).copied().unwrap_or(0))
            }
            // Our own request looped back, other pings' replies, neighbour discovery.
            _ => {}
        }
    }
}

/// The Internet checksum of `data`.
fn icmp_checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}
