//! A rendezvous store served by one node (as torch.distributed's TCPStore at
//! `MASTER_ADDR:MASTER_PORT`): `set`, `get`, `add` (an atomic counter) and `wait` for keys,
//! every call with a deadline.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use tokio::sync::watch;
use uuid::Uuid;

use super::{Node, Peer};
use crate::error::{Error, Result};
use refit_runtime::Error as CoreError;

/// The handler target of the store on its node.
pub const STORE_TARGET: Uuid = Uuid::from_u128(0x7265_6669_745f_7374_6f72_6500_0000_0001);

/// Longest key, in bytes.
pub const MAX_KEY: usize = 1024;

#[derive(Default)]
struct State {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Option<watch::Sender<u64>>,
}

impl State {
    fn map(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // plain map; a panicking handler leaves it consistent
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        if let Some(tx) = &self.changed {
            tx.send_modify(|n| *n += 1);
        }
    }
}

fn check_key(key: &str) -> Result<()> {
    if key.is_empty() || key.len() > MAX_KEY {
        return Err(Error::from(CoreError::Wire(format!(
            "store key of {} bytes (1..={MAX_KEY} accepted)",
            key.len()
        ))));
    }
    Ok(())
}

#[derive(Serialize, Deserialize)]
struct SetReq {
    key: String,
    value: ByteBuf,
}

#[derive(Serialize, Deserialize)]
struct KeyReq {
    key: String,
}

#[derive(Serialize, Deserialize)]
struct AddReq {
    key: String,
    delta: i64,
}

#[derive(Serialize, Deserialize)]
struct WaitReq {
    keys: Vec<String>,
}

/// The serving side: handlers on a node. Dropping it changes nothing; the store lives as
/// long as the node.
#[derive(Debug, Clone, Copy)]
pub struct Store;

impl Store {
    /// Serves a store on `node`.
    pub fn serve(node: &Node) -> Self {
        let (tx, _rx) = watch::channel(0u64);
        let state = Arc::new(State {
            map: Mutex::default(),
            changed: Some(tx),
        });
        let st = Arc::clone(&state);
        node.register(STORE_TARGET, "set", move |_, r: SetReq| {
            let st = Arc::clone(&st);
            async move {
                check_key(&r.key)?;
                st.map().insert(r.key, r.value.into_vec());
                st.bump();
                Ok::<_, Error>(())
            }
        });
        let st = Arc::clone(&state);
        node.register(STORE_TARGET, "get", move |_, r: KeyReq| {
            let v = st.map().get(&r.key).cloned().map(ByteBuf::from);
            async move { Ok::<_, Error>(v) }
        });
        let st = Arc::clone(&state);
        node.register(STORE_TARGET, "add", move |_, r: AddReq| {
            let st = Arc::clone(&st);
            async move {
                check_key(&r.key)?;
                let next = {
                    let mut map = st.map();
                    let cur = match map.get(&r.key) {
                        None => 0,
                        Some(v) => std::str::from_utf8(v)
                            .ok()
                            .and_then(|s| s.parse::<i64>().ok())
                            .ok_or_else(|| {
                                Error::from(CoreError::Wire(format!(
                                    "store key `{}` is not a counter",
                                    r.key
                                )))
                            })?,
                    };
                    let next = cur.checked_add(r.delta).ok_or_else(|| {
                        Error::from(CoreError::Wire(format!(
                            "store counter `{}` overflows",
                            r.key
                        )))
                    })?;
                    map.insert(r.key, next.to_string().into_bytes());
                    next
                };
                st.bump();
                Ok::<_, Error>(next)
            }
        });
        let st = Arc::clone(&state);
        node.register(STORE_TARGET, "wait", move |info, r: WaitReq| {
            let st = Arc::clone(&st);
            async move {
                let Some(tx) = &st.changed else {
                    return Ok::<_, Error>(r.keys);
                };
                let mut rx = tx.subscribe();
                let deadline = tokio::time::Instant::from_std(info.deadline)
                    .checked_sub(Duration::from_millis(200))
                    .unwrap_or_else(tokio::time::Instant::now);
                loop {
                    let missing: Vec<String> = {
                        let map = st.map();
                        r.keys
                            .iter()
                            .filter(|k| !map.contains_key(*k))
                            .cloned()
                            .collect()
                    };
                    if missing.is_empty() {
                        return Ok(missing);
                    }
                    match tokio::time::timeout_at(deadline, rx.changed()).await {
                        Ok(Ok(())) => {}
                        _ => return Ok(missing),
                    }
                }
            }
        });
        Self
    }
}

/// The client side of a store.
#[derive(Debug, Clone)]
pub struct StoreClient {
    peer: Peer,
    timeout: Duration,
}

impl StoreClient {
    /// Connects to the store served by the node at `addr`.
    ///
    /// # Errors
    /// As [`Node::connect`].
    pub fn connect(node: &Node, addr: SocketAddr, timeout: Duration) -> Result<Self> {
        Ok(Self {
            peer: node.connect(addr, timeout)?,
            timeout: Duration::from_secs(10),
        })
    }

    /// Uses an existing connection.
    pub fn from_peer(peer: Peer) -> Self {
        Self {
            peer,
            timeout: Duration::from_secs(10),
        }
    }

    /// Deadline of `set`, `get` and `add` (default 10 s).
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets `key` to `value`, waking whoever waits for it.
    ///
    /// # Errors
    /// [`Timeout`](refit_runtime::Error::Timeout), [`PeerGone`](refit_runtime::Error::PeerGone), [`Error::Remote`] for a bad key.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let req = SetReq {
            key: key.to_owned(),
            value: ByteBuf::from(value),
        };
        self.peer.call(STORE_TARGET, "set", &req, self.timeout)
    }

    /// The value of `key`, if set (does not wait).
    ///
    /// # Errors
    /// As [`StoreClient::set`].
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let req = KeyReq {
            key: key.to_owned(),
        };
        let v: Option<ByteBuf> = self.peer.call(STORE_TARGET, "get", &req, self.timeout)?;
        Ok(v.map(ByteBuf::into_vec))
    }

    /// Adds `delta` to the counter `key` (created at 0) and returns the new value.
    ///
    /// # Errors
    /// As [`StoreClient::set`]; [`Error::Remote`] when the key holds no counter.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let req = AddReq {
            key: key.to_owned(),
            delta,
        };
        self.peer.call(STORE_TARGET, "add", &req, self.timeout)
    }

    /// Waits until every key is set.
    ///
    /// # Errors
    /// [`Timeout`](refit_runtime::Error::Timeout) naming the keys still missing; [`PeerGone`](refit_runtime::Error::PeerGone).
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let req = WaitReq {
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        };
        let missing: Vec<String> = self.peer.call(
            STORE_TARGET,
            "wait",
            &req,
            timeout + Duration::from_millis(200),
        )?;
        if missing.is_empty() {
            Ok(())
        } else {
            Err(Error::from(CoreError::Timeout {
                what: format!("store keys {missing:?}"),
                after: timeout,
            }))
        }
    }

    /// Waits for `key`, then returns its value.
    ///
    /// # Errors
    /// As [`StoreClient::wait`].
    pub fn wait_get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait(&[key], timeout)?;
        self.get(key)?.ok_or_else(|| {
            Error::from(CoreError::Timeout {
                what: format!("store key {key:?}"),
                after: timeout,
            })
        })
    }

    /// The connection.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }
}
