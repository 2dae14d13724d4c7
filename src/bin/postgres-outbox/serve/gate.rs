//! Connections between their acceptance and a handler. Each is read on a thread of its own
//! with a deadline counted from when it was accepted, so sockets that send nothing hold
//! only their own reader, never a handler nor a place in the handlers' queue: a request
//! reaches the queue whole. Readers are capped in all and, beyond loopback, per peer, so
//! one host on the network cannot take them all. (On loopback every client is 127.0.0.1:
//! a cap per peer there would let one local program lock the operator out.)

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Connections read or queued at once, in all and from one peer beyond loopback. A browser
/// opens six to a host.
const MAX_CONNECTIONS: usize = 256;
const MAX_PER_PEER: usize = 16;

#[derive(Default)]
pub struct Gate {
    counts: Mutex<Counts>,
}

#[derive(Default)]
struct Counts {
    all: usize,
    by_peer: HashMap<IpAddr, usize>,
}

/// One admitted connection's place, given back when dropped (its answer written, or it
/// given up on).
pub struct Place {
    gate: Arc<Gate>,
    peer: IpAddr,
}

impl Gate {
    /// A place for a connection from `peer`, unless the caps are reached.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Option<Place> {
        let mut counts = self.counts.lock().ok()?;
        let from_peer = counts.by_peer.get(&peer).copied().unwrap_or(0);
        if counts.all >= MAX_CONNECTIONS || (!peer.is_loopback() && from_peer >= MAX_PER_PEER) {
            return None;
        }
        counts.all += 1;
        counts.by_peer.insert(peer, from_peer + 1);
        Some(Place {
            gate: self.clone(),
            peer,
        })
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Ok(mut counts) = self.gate.counts.lock() {
            counts.all -= 1;
            if let Some(n) = counts.by_peer.get_mut(&self.peer) {
                *n -= 1;
                if *n == 0 {
                    counts.by_peer.remove(&self.peer);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_beyond_loopback_gets_its_share_and_its_places_come_back() {
        let gate = Arc::new(Gate::default());
        let far: IpAddr = [192, 0, 2, 1].into();
        let held: Vec<Place> = (0..MAX_PER_PEER).filter_map(|_| gate.admit(far)).collect();
        assert_eq!(held.len(), MAX_PER_PEER);
        assert!(gate.admit(far).is_none());
        assert!(gate.admit([192, 0, 2, 2].into()).is_some(), "another peer");
        let local: Vec<Place> = (0..MAX_PER_PEER * 2)
            .filter_map(|_| gate.admit([127, 0, 0, 1].into()))
            .collect();
        assert_eq!(
            local.len(),
            MAX_PER_PEER * 2,
            "loopback has no share of its own"
        );
        drop(held);
        assert!(gate.admit(far).is_some());
    }
}
