//! Where policies, environments and stored data live.

use std::fmt;

use crate::error::{Error, Result};

/// A compute device. Only [`Device::Cpu`] is implemented; the others are typed so configs
/// can name them and be refused with [`Error::DeviceNotSupported`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Device {
    /// The host CPU.
    #[default]
    Cpu,
    /// A CUDA device by ordinal (not supported yet).
    Cuda(usize),
}

impl Device {
    /// Checks that this build can use the device.
    ///
    /// # Errors
    /// [`Error::DeviceNotSupported`] for anything but [`Device::Cpu`].
    pub fn check_supported(self) -> Result<()> {
        match self {
            Self::Cpu => Ok(()),
            Self::Cuda(_) => Err(Error::DeviceNotSupported(self)),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}
