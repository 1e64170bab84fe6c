//! The network devices of lb's network namespace as rtnetlink reports them: a dump of the
//! links there now (`links`), and a watch of links appearing and going (`watch`), which `lb run`
//! uses to attach `lb_tc_pod` to every pod veth, including those the CNI creates later.
//!
//! A raw `NETLINK_ROUTE` socket: the dump is one `RTM_GETLINK` request, the watch a socket
//! bound to the `RTMGRP_LINK` group. Only what lb needs is parsed: the ifindex, `IFLA_IFNAME`
//! and `IFLA_LINKINFO`/`IFLA_INFO_KIND` (`veth`, `bridge`, ...). sysfs is no substitute: it
//! shows the devices of the netns it was mounted in, not necessarily lb's.
use std::{
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
};

/// One network device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// `IFLA_INFO_KIND` (`veth`, `bridge`, `vxlan`, ...); empty for a device without one (a
    /// physical NIC, `lo`).
    pub kind: String,
}

/// What the watch saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkEvent {
    /// A link appeared or changed (`RTM_NEWLINK`: also sent on up/down, rename, new master).
    New(Link),
    /// A link went away (`RTM_DELLINK`).
    Del(Link),
    /// Events were lost (the socket's buffer overran): the listener re-reads `links()`.
    Resync,
}

const NLMSG_HDRLEN: usize = 16;
const IFINFOMSG_LEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_GETLINK: u16 = 18;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const RTMGRP_LINK: u32 = 1;
const NLA_TYPE_MASK: u16 = 0x3fff;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn socket(groups: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_nl is plain old data; all-zero is the kernel-assigned address.
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    addr.nl_groups = groups;
    // SAFETY: bind(2) with a valid sockaddr_nl of the size given.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const addr).cast(),
            size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

fn recv(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: recv(2) into a buffer of the length given.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(off..off + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(off..off + 4)?.try_into().ok()?))
}

/// The attributes in `b`: (type, payload).
fn attrs(mut b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let len = usize::from(u16_at(b, 0)?);
        let ty = u16_at(b, 2)? & NLA_TYPE_MASK;
        if len < 4 || len > b.len() {
            return None;
        }
        let payload = &b[4..len];
        b = b.get(align4(len)..).unwrap_or_default();
        Some((ty, payload))
    })
}

fn c_string(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// The link an `RTM_NEWLINK`/`RTM_DELLINK` payload (`ifinfomsg` and attributes) describes.
fn parse_link(payload: &[u8]) -> Option<Link> {
    let index = u32_at(payload, 4)?;
    let mut link = Link {
        index,
        name: String::new(),
        kind: String::new(),
    };
    for (ty, value) in attrs(payload.get(IFINFOMSG_LEN..)?) {
        match ty {
            IFLA_IFNAME => link.name = c_string(value),
            IFLA_LINKINFO => {
                if let Some((_, kind)) = attrs(value).find(|(t, _)| *t == IFLA_INFO_KIND) {
                    link.kind = c_string(kind);
                }
            }
            _ => {}
        }
    }
    (!link.name.is_empty()).then_some(link)
}

/// The netlink messages in one datagram: (type, payload); `Err` for an `NLMSG_ERROR` with a
/// non-zero error.
fn messages(mut b: &[u8]) -> impl Iterator<Item = io::Result<(u16, &[u8])>> {
    std::iter::from_fn(move || {
        let len = u32_at(b, 0)? as usize;
        let ty = u16_at(b, 4)?;
        if len < NLMSG_HDRLEN || len > b.len() {
            return None;
        }
        let payload = &b[NLMSG_HDRLEN..len];
        b = b.get(align4(len)..).unwrap_or_default();
        if ty == NLMSG_ERROR {
            let errno = u32_at(payload, 0).map_or(0, |e| e as i32);
            if errno != 0 {
                return Some(Err(io::Error::from_raw_os_error(-errno)));
            }
        }
        Some(Ok((ty, payload)))
    })
}

/// Every link of this network namespace.
pub fn links() -> io::Result<Vec<Link>> {
    let fd = socket(0)?;
    // nlmsghdr + ifinfomsg (AF_UNSPEC: every link).
    let mut req = [0u8; NLMSG_HDRLEN + IFINFOMSG_LEN];
    req[0..4].copy_from_slice(&((NLMSG_HDRLEN + IFINFOMSG_LEN) as u32).to_ne_bytes());
    req[4..6].copy_from_slice(&RTM_GETLINK.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    req[6..8].copy_from_slice(&flags.to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    // SAFETY: send(2) of a buffer of the length given on our socket (to the kernel: pid 0).
    let n = unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = recv(&fd, &mut buf)?;
        for m in messages(&buf[..n]) {
            match m? {
                (NLMSG_DONE, _) => return Ok(out),
                (RTM_NEWLINK, payload) => out.extend(parse_link(payload)),
                _ => {}
            }
        }
        if n == 0 {
            return Ok(out);
        }
    }
}

/// Subscribes to link changes now, then calls `on_event` for each from a thread of its own
/// ("lb-linkwatch") until `on_event` returns `false` or the socket fails (logged). Events
/// between the subscription and the first read are kept, so a caller that lists `links()` after
/// this returns misses nothing.
pub fn watch(
    mut on_event: impl FnMut(LinkEvent) -> bool + Send + 'static,
) -> io::Result<std::thread::JoinHandle<()>> {
    let fd = socket(RTMGRP_LINK)?;
    // A burst of pod starts must not overrun it; ENOBUFS still resyncs.
    let size: libc::c_int = 1 << 20;
    // SAFETY: setsockopt(2) with an int of the size given; failure only leaves the default.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&raw const size).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    std::thread::Builder::new()
        .name("lb-linkwatch".into())
        .spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match recv(&fd, &mut buf) {
                    Ok(n) => n,
                    Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                        if !on_event(LinkEvent::Resync) {
                            return;
                        }
                        continue;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "link watch failed: new pod devices are not attached");
                        return;
                    }
                };
                for m in messages(&buf[..n]) {
                    let event = match m {
                        Ok((RTM_NEWLINK, p)) => parse_link(p).map(LinkEvent::New),
                        Ok((RTM_DELLINK, p)) => parse_link(p).map(LinkEvent::Del),
                        _ => None,
                    };
                    if let Some(event) = event
                        && !on_event(event)
                    {
                        return;
                    }
                }
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(ty: u16, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
        v.extend_from_slice(&ty.to_ne_bytes());
        v.extend_from_slice(payload);
        v.resize(align4(v.len()), 0);
        v
    }

    #[test]
    fn parses_a_newlink_message() {
        let mut ifinfo = vec![0u8; IFINFOMSG_LEN];
        ifinfo[4..8].copy_from_slice(&7u32.to_ne_bytes());
        let mut payload = ifinfo;
        payload.extend(attr(IFLA_IFNAME, b"veth1234\0"));
        payload.extend(attr(IFLA_LINKINFO, &attr(IFLA_INFO_KIND, b"veth\0")));
        let mut msg = Vec::new();
        msg.extend_from_slice(&((NLMSG_HDRLEN + payload.len()) as u32).to_ne_bytes());
        msg.extend_from_slice(&RTM_NEWLINK.to_ne_bytes());
        msg.extend_from_slice(&[0; 10]);
        msg.extend(payload);
        let parsed: Vec<_> = messages(&msg).collect::<io::Result<_>>().unwrap();
        assert_eq!(parsed.len(), 1);
        assert_eq!(parsed[0].0, RTM_NEWLINK);
        assert_eq!(
            parse_link(parsed[0].1),
            Some(Link {
                index: 7,
                name: "veth1234".into(),
                kind: "veth".into()
            })
        );
    }

    #[test]
    fn truncated_input_ends_the_iteration() {
        assert_eq!(messages(&[1, 0, 0]).count(), 0);
        assert_eq!(attrs(&[200, 0, 3, 0, b'x']).count(), 0);
        assert_eq!(parse_link(&[0; 3]), None);
    }
}
