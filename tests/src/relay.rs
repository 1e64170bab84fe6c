//! [`Relay`]: a TCP relay from `127.0.0.1:<port>` inside a netns to an address in the caller's
//! netns, so a process in a testbed's node netns (lb) reaches a control plane on the host's
//! loopback without any route between the two namespaces. Several node netns can share one
//! API server that way, each through a relay of its own.
use std::{
    io,
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
};

use anyhow::Context as _;

use crate::netns::in_netns;

/// The relay; see the [module docs](self). Dropping it stops accepting; relayed connections
/// end with either side.
pub struct Relay {
    /// The port on `127.0.0.1` inside the netns.
    pub port: u16,
    ns: String,
    stop: Arc<AtomicBool>,
    accept: Option<thread::JoinHandle<()>>,
}

impl Relay {
    /// Listens on `127.0.0.1:0` inside netns `ns` and relays each connection to `upstream`,
    /// connected from the caller's netns.
    pub fn start(ns: &str, upstream: SocketAddr) -> anyhow::Result<Self> {
        // A socket stays in the netns it was created in, whichever thread uses it later.
        let listener = in_netns(ns, || {
            TcpListener::bind("127.0.0.1:0").context("bind 127.0.0.1:0 in the netns")
        })?;
        let port = listener.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let accept = thread::Builder::new()
            .name(format!("relay-{port}"))
            .spawn(move || {
                for down in listener.incoming() {
                    if stop2.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(down) = down else { continue };
                    // A failed connect closes the client's connection: it sees a reset.
                    if let Ok(up) = TcpStream::connect(upstream) {
                        let _ = pipe(down, up);
                    }
                }
            })
            .context("spawn relay thread")?;
        Ok(Self {
            port,
            ns: ns.to_owned(),
            stop,
            accept: Some(accept),
        })
    }

    /// `https://127.0.0.1:<port>`: the server address for a kubeconfig used inside the netns.
    pub fn https_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }
}

/// Copies both ways on two threads; each direction ends by shutting down the other side.
fn pipe(down: TcpStream, up: TcpStream) -> io::Result<()> {
    let (down2, up2) = (down.try_clone()?, up.try_clone()?);
    let copy = |mut from: TcpStream, mut to: TcpStream| {
        move || {
            let _ = io::copy(&mut from, &mut to);
            let _ = to.shutdown(Shutdown::Write);
        }
    };
    thread::Builder::new().spawn(copy(down, up2))?;
    thread::Builder::new().spawn(copy(up, down2))?;
    Ok(())
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop with one last connection so it sees the flag and ends.
        let port = self.port;
        let woke = in_netns(&self.ns, || Ok(TcpStream::connect(("127.0.0.1", port))?));
        if woke.is_ok()
            && let Some(accept) = self.accept.take()
        {
            let _ = accept.join();
        }
    }
}
