//! Element types of tensors.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Element type of a tensor.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DType {
    /// One byte, 0 or 1.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// 8-bit float, 4 exponent bits, 3 mantissa bits (OCP "e4m3fn": no infinities).
    F8E4M3,
    /// 8-bit float, 5 exponent bits, 2 mantissa bits.
    F8E5M2,
}

impl DType {
    /// Every dtype, in a fixed order.
    pub const ALL: [Self; 15] = [
        Self::Bool,
        Self::U8,
        Self::I8,
        Self::I16,
        Self::U16,
        Self::I32,
        Self::U32,
        Self::I64,
        Self::U64,
        Self::F16,
        Self::BF16,
        Self::F32,
        Self::F64,
        Self::F8E4M3,
        Self::F8E5M2,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Self::Bool | Self::U8 | Self::I8 | Self::F8E4M3 | Self::F8E5M2 => 1,
            Self::I16 | Self::U16 | Self::F16 | Self::BF16 => 2,
            Self::I32 | Self::U32 | Self::F32 => 4,
            Self::I64 | Self::U64 | Self::F64 => 8,
        }
    }

    /// The short lowercase name (`"f32"`, `"bf16"`, `"f8_e4m3"`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Bool => "bool",
            Self::U8 => "u8",
            Self::I8 => "i8",
            Self::I16 => "i16",
            Self::U16 => "u16",
            Self::I32 => "i32",
            Self::U32 => "u32",
            Self::I64 => "i64",
            Self::U64 => "u64",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
            Self::F32 => "f32",
            Self::F64 => "f64",
            Self::F8E4M3 => "f8_e4m3",
            Self::F8E5M2 => "f8_e5m2",
        }
    }

    /// Parses a name written by [`DType::name`].
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }

    /// The matching safetensors dtype.
    pub fn to_safetensors(self) -> safetensors::Dtype {
        use safetensors::Dtype as S;
        match self {
            Self::Bool => S::BOOL,
            Self::U8 => S::U8,
            Self::I8 => S::I8,
            Self::I16 => S::I16,
            Self::U16 => S::U16,
            Self::I32 => S::I32,
            Self::U32 => S::U32,
            Self::I64 => S::I64,
            Self::U64 => S::U64,
            Self::F16 => S::F16,
            Self::BF16 => S::BF16,
            Self::F32 => S::F32,
            Self::F64 => S::F64,
            Self::F8E4M3 => S::F8_E4M3,
            Self::F8E5M2 => S::F8_E5M2,
        }
    }

    /// The dtype of a safetensors tensor.
    ///
    /// # Errors
    /// [`Error::Safetensors`] for dtypes refit does not carry (sub-byte floats, e8m0, ...).
    pub fn from_safetensors(dtype: safetensors::Dtype, tensor: &str) -> Result<Self> {
        use safetensors::Dtype as S;
        Ok(match dtype {
            S::BOOL => Self::Bool,
            S::U8 => Self::U8,
            S::I8 => Self::I8,
            S::I16 => Self::I16,
            S::U16 => Self::U16,
            S::I32 => Self::I32,
            S::U32 => Self::U32,
            S::I64 => Self::I64,
            S::U64 => Self::U64,
            S::F16 => Self::F16,
            S::BF16 => Self::BF16,
            S::F32 => Self::F32,
            S::F64 => Self::F64,
            S::F8_E4M3 => Self::F8E4M3,
            S::F8_E5M2 => Self::F8E5M2,
            other => {
                return Err(Error::Safetensors {
                    source_name: "<header>".into(),
                    reason: format!(
                        "tensor `{tensor}` has dtype {other:?}, which refit does not carry"
                    ),
                });
            }
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust element type that has a [`DType`]; typed views are checked against it.
pub trait Element: bytemuck::Pod {
    /// The matching dtype.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(u8 => U8, i8 => I8, i16 => I16, u16 => U16, i32 => I32, u32 => U32, i64 => I64, u64 => U64,
    f32 => F32, f64 => F64, half::f16 => F16, half::bf16 => BF16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_safetensors_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()), Some(d));
            assert_eq!(DType::from_safetensors(d.to_safetensors(), "t").unwrap(), d);
            assert_eq!(d.size(), d.to_safetensors().bitsize() / 8, "{d}");
        }
        assert!(DType::from_name("f31").is_none());
        assert!(DType::from_safetensors(safetensors::Dtype::F4, "w").is_err());
    }
}
