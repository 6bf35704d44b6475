//! `[model.convert]`: the engine's layout and dtypes of one model, declared in the file (the
//! [`Want`] an engine would otherwise give in code).
//!
//! ```toml
//! [[model]]
//! id = "policy"
//! [model.convert]
//! layout = [
//!   { fuse = ["blocks.{i}.attn.q.weight", "blocks.{i}.attn.k.weight", "blocks.{i}.attn.v.weight"],
//!     to = "blocks.{i}.attn.qkv.weight", axis = 0 },
//! ]
//! keep_unmatched = true
//! cast = [{ dtype = "f32", to = "bf16" }]
//! ```

use serde::{Deserialize, Serialize};

use crate::cast::{CastRules, CastTo};
use crate::convert::Want;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::LayoutRules;

/// One layout rule as written: exactly one of `rename`, `transpose`, `fuse`, `split`, `keep`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayoutRuleSection {
    /// Same bytes under the name `to`.
    pub rename: Option<String>,
    /// A 2-D tensor transposed under the name `to`.
    pub transpose: Option<String>,
    /// These tensors concatenated along `axis` into `to`.
    pub fuse: Option<Vec<String>>,
    /// This tensor cut along `axis` into the names of `to` (equal parts, or `sizes`).
    pub split: Option<String>,
    /// Tensors matching this pattern pass unchanged.
    pub keep: Option<String>,
    /// The target name (`rename`, `transpose`, `fuse`) or names (`split`).
    pub to: Option<toml::Value>,
    /// The axis of a `fuse` or `split` (default 0).
    #[serde(default)]
    pub axis: usize,
    /// The parts' sizes along `axis` of a `split` (default: equal parts).
    pub sizes: Option<Vec<usize>>,
}

/// One cast rule as written: `tensors` (a name pattern) or `dtype`, and `to`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CastRuleSection {
    /// Tensors whose name matches this pattern.
    pub tensors: Option<String>,
    /// Every tensor of this dtype (`f32`, `bf16`, ...).
    pub dtype: Option<String>,
    /// `bf16`, `f16`, `f32`, `e4m3` or `e5m2` (fp8 with one scale per tensor, saturating).
    pub to: String,
}

/// `[model.convert]`: the layout rules, then the cast rules (written against the names the
/// layout produces).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConvertSection {
    /// Layout rules, in order.
    #[serde(default)]
    pub layout: Vec<LayoutRuleSection>,
    /// Tensors no layout rule matches pass unchanged (otherwise they are an error).
    #[serde(default)]
    pub keep_unmatched: bool,
    /// Cast rules.
    #[serde(default)]
    pub cast: Vec<CastRuleSection>,
}

fn bad(key: &str, reason: impl Into<String>) -> Error {
    Error::Topology {
        key: key.into(),
        reason: reason.into(),
    }
}

fn one_name(key: &str, to: Option<&toml::Value>) -> Result<String> {
    match to {
        Some(toml::Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(bad(
            key,
            format!("`to` must be one name here, not a {}", other.type_str()),
        )),
        None => Err(bad(key, "`to` is missing")),
    }
}

fn names(key: &str, to: Option<&toml::Value>) -> Result<Vec<String>> {
    let Some(toml::Value::Array(items)) = to else {
        return Err(bad(key, "`to` must be a list of names for a split"));
    };
    items
        .iter()
        .map(|v| {
            v.as_str()
                .map(str::to_owned)
                .ok_or_else(|| bad(key, format!("`to` holds a {}, not a name", v.type_str())))
        })
        .collect()
}

fn cast_to(key: &str, to: &str) -> Result<CastTo> {
    match to.trim().to_ascii_lowercase().as_str() {
        "bf16" => Ok(CastTo::BF16),
        "f16" => Ok(CastTo::F16),
        "f32" => Ok(CastTo::F32),
        "e4m3" => Ok(CastTo::E4M3_PER_TENSOR),
        "e5m2" => Ok(CastTo::E5M2 {
            scaling: crate::cast::Scaling::PerTensor,
            overflow: crate::cast::Overflow::Saturate,
        }),
        other => Err(bad(
            key,
            format!("`{other}` is not one of bf16, f16, f32, e4m3, e5m2"),
        )),
    }
}

impl ConvertSection {
    /// The [`Want`] these rules describe; `key` names the section in errors
    /// (`model[policy].convert`).
    ///
    /// # Errors
    /// [`Error::Topology`] naming the rule: none or several of `rename`, `transpose`,
    /// `fuse`, `split`, `keep` in one rule, a missing or mistyped `to`, a cast rule without
    /// `tensors` or `dtype` (or with both), an unknown dtype or cast target. Whether the
    /// rules fit the trainer's tensors is checked when the link opens (naming the tensor).
    pub fn want(&self, key: &str) -> Result<Want> {
        let mut want = Want::new();
        if !self.layout.is_empty() || self.keep_unmatched {
            let mut rules = LayoutRules::new();
            for (i, r) in self.layout.iter().enumerate() {
                let k = format!("{key}.layout[{i}]");
                let kinds = [
                    r.rename.is_some(),
                    r.transpose.is_some(),
                    r.fuse.is_some(),
                    r.split.is_some(),
                    r.keep.is_some(),
                ];
                if kinds.iter().filter(|k| **k).count() != 1 {
                    return Err(bad(
                        &k,
                        "a rule holds exactly one of rename, transpose, fuse, split, keep",
                    ));
                }
                rules = if let Some(from) = &r.rename {
                    rules.rename(from, &one_name(&k, r.to.as_ref())?)
                } else if let Some(from) = &r.transpose {
                    rules.transpose(from, &one_name(&k, r.to.as_ref())?)
                } else if let Some(from) = &r.fuse {
                    let from: Vec<&str> = from.iter().map(String::as_str).collect();
                    rules.fuse(from, &one_name(&k, r.to.as_ref())?, r.axis)
                } else if let Some(from) = &r.split {
                    let to = names(&k, r.to.as_ref())?;
                    let to: Vec<&str> = to.iter().map(String::as_str).collect();
                    match &r.sizes {
                        Some(sizes) if sizes.len() != to.len() => {
                            return Err(bad(
                                &k,
                                format!(
                                    "`sizes` has {} entries for {} names in `to`",
                                    sizes.len(),
                                    to.len()
                                ),
                            ));
                        }
                        Some(sizes) => rules.split_sizes(
                            from,
                            to.iter().copied().zip(sizes.iter().copied()),
                            r.axis,
                        ),
                        None => rules.split(from, to, r.axis),
                    }
                } else if let Some(p) = &r.keep {
                    rules.keep(p)
                } else {
                    rules
                };
            }
            if self.keep_unmatched {
                rules = rules.keep_unmatched();
            }
            want = want.layout(rules);
        }
        if !self.cast.is_empty() {
            let mut rules = CastRules::new();
            for (i, c) in self.cast.iter().enumerate() {
                let k = format!("{key}.cast[{i}]");
                let to = cast_to(&k, &c.to)?;
                rules = match (&c.tensors, &c.dtype) {
                    (Some(p), None) => rules.tensors(p, to),
                    (None, Some(d)) => {
                        let from = DType::from_name(d.trim())
                            .ok_or_else(|| bad(&k, format!("`{d}` is not a dtype")))?;
                        rules.dtype(from, to)
                    }
                    _ => {
                        return Err(bad(&k, "a cast rule holds one of `tensors` or `dtype`"));
                    }
                };
            }
            want = want.cast(rules);
        }
        Ok(want)
    }
}
