//! Launch conventions shared with torchrun and friends: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` in the environment; rank 0 serves the rendezvous store at the master
//! address.

use std::net::{SocketAddr, ToSocketAddrs};

use crate::error::{Error, Result};

/// Where this process stands in a launched job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank, `0..world_size`.
    pub rank: u32,
    /// Number of processes in the job.
    pub world_size: u32,
    /// Host of the rank-0 process (name or address).
    pub master_addr: String,
    /// Port of the rendezvous store on the master.
    pub master_port: u16,
}

fn parse<T: std::str::FromStr>(
    var: &'static str,
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<T> {
    let raw = lookup(var).ok_or_else(|| Error::Launch {
        var,
        reason: "not set".into(),
    })?;
    raw.trim().parse().map_err(|_| Error::Launch {
        var,
        reason: format!("{raw:?} is not a valid number"),
    })
}

impl LaunchEnv {
    /// Reads the four variables from the environment.
    ///
    /// # Errors
    /// [`Error::Launch`] naming the variable that is missing or bad, or a rank out of range.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the four variables through `lookup` (for tests and custom launchers).
    ///
    /// # Errors
    /// As [`LaunchEnv::from_env`].
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let rank: u32 = parse("RANK", &lookup)?;
        let world_size: u32 = parse("WORLD_SIZE", &lookup)?;
        if world_size == 0 {
            return Err(Error::Launch {
                var: "WORLD_SIZE",
                reason: "must be at least 1".into(),
            });
        }
        if rank >= world_size {
            return Err(Error::Launch {
                var: "RANK",
                reason: format!("{rank} is not below WORLD_SIZE {world_size}"),
            });
        }
        let master_addr = lookup("MASTER_ADDR")
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .ok_or_else(|| Error::Launch {
                var: "MASTER_ADDR",
                reason: "not set".into(),
            })?;
        let master_port: u16 = parse("MASTER_PORT", &lookup)?;
        if master_port == 0 {
            return Err(Error::Launch {
                var: "MASTER_PORT",
                reason: "port 0 cannot be reached".into(),
            });
        }
        Ok(Self {
            rank,
            world_size,
            master_addr,
            master_port,
        })
    }

    /// True for rank 0, which serves the store.
    pub fn is_master(&self) -> bool {
        self.rank == 0
    }

    /// The master's socket address (resolving a host name).
    ///
    /// # Errors
    /// [`Error::Launch`] when `MASTER_ADDR` does not resolve.
    pub fn master(&self) -> Result<SocketAddr> {
        (self.master_addr.as_str(), self.master_port)
            .to_socket_addrs()
            .map_err(|e| Error::Launch {
                var: "MASTER_ADDR",
                reason: format!("{:?} does not resolve: {e}", self.master_addr),
            })?
            .next()
            .ok_or_else(|| Error::Launch {
                var: "MASTER_ADDR",
                reason: format!("{:?} resolves to nothing", self.master_addr),
            })
    }

    /// The variables as `(name, value)` pairs, to hand to a child process.
    pub fn vars(&self) -> [(&'static str, String); 4] {
        [
            ("RANK", self.rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn launch_variables_are_typed_and_named_when_bad() {
        let ok = [
            ("RANK", "1"),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let l = LaunchEnv::from_lookup(env(&ok)).unwrap();
        assert_eq!((l.rank, l.world_size, l.master_port), (1, 3, 29500));
        assert!(!l.is_master());
        assert_eq!(l.master().unwrap().port(), 29500);
        let again = LaunchEnv::from_lookup(env(&l
            .vars()
            .iter()
            .map(|(k, v)| (*k, v.as_str()))
            .collect::<Vec<_>>()))
        .unwrap();
        assert_eq!(again, l);
        let cases: [(&[(&str, &str)], &str); 5] = [
            (&ok[1..], "launch variable `RANK`: not set"),
            (
                &[("RANK", "x"), ok[1], ok[2], ok[3]],
                "launch variable `RANK`: \"x\" is not a valid number",
            ),
            (
                &[("RANK", "3"), ok[1], ok[2], ok[3]],
                "not below WORLD_SIZE 3",
            ),
            (&[ok[0], ok[1], ok[3]], "`MASTER_ADDR`: not set"),
            (
                &[ok[0], ok[1], ok[2], ("MASTER_PORT", "70000")],
                "`MASTER_PORT`",
            ),
        ];
        for (vars, want) in cases {
            let e = LaunchEnv::from_lookup(env(vars)).unwrap_err().to_string();
            assert!(e.contains(want), "{e} lacks {want}");
        }
    }
}
