//! Bring a candle model (feature `candle`): the variables of a candle-nn [`VarMap`] as a
//! [`WeightSet`], and back.
//!
//! - [`manifest`] describes a `VarMap`'s variables (sorted by name) as a [`Manifest`], to
//!   open links with before the first version exists;
//! - [`export`] copies every variable into a new weight set (one copy per tensor, from the
//!   variable's storage straight into the arena); [`export_into`] writes into a weight set
//!   that already exists (a slot a transport lent, or last version's arena);
//! - [`import`] writes a weight set into a `VarMap`'s variables, on their devices: every
//!   tensor is checked against its variable first (name, dtype, shape), and nothing is
//!   written unless all match;
//! - [`to_var_map`] makes a fresh `VarMap` from a weight set, for a model built afterwards
//!   (`VarBuilder::from_varmap` finds its variables there).
//!
//! candle's dtypes map one to one (`u8`, `u32`, `i16`, `i32`, `i64`, `bf16`, `f16`, `f32`,
//! `f64`, `f8_e4m3`); its 4- and 6-bit types are refused, naming the variable.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{CpuStorage, DType as CDType, Device, Storage, Tensor, Var};
use candle_nn::VarMap;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ids::{ModelId, Version};
use crate::manifest::Manifest;
use crate::weights::WeightSet;

const LIBRARY: &str = "candle";

fn bridge(tensor: &str, reason: impl std::fmt::Display) -> Error {
    Error::Bridge {
        library: LIBRARY,
        tensor: tensor.to_string(),
        reason: reason.to_string(),
    }
}

/// Refit's dtype of a candle dtype.
///
/// # Errors
/// [`Error::Bridge`] naming `tensor` for candle's 4- and 6-bit types and `f8_e8m0`, which
/// have no Refit dtype.
pub fn dtype_of(tensor: &str, dtype: CDType) -> Result<DType> {
    Ok(match dtype {
        CDType::U8 => DType::U8,
        CDType::U32 => DType::U32,
        CDType::I16 => DType::I16,
        CDType::I32 => DType::I32,
        CDType::I64 => DType::I64,
        CDType::BF16 => DType::BF16,
        CDType::F16 => DType::F16,
        CDType::F32 => DType::F32,
        CDType::F64 => DType::F64,
        CDType::F8E4M3 => DType::F8E4M3,
        other => {
            return Err(bridge(
                tensor,
                format!("dtype {other:?} has no refit dtype"),
            ));
        }
    })
}

/// candle's dtype of a Refit dtype.
///
/// # Errors
/// [`Error::Bridge`] naming `tensor` for `bool`, `i8`, `u16`, `u64` and `f8_e5m2`, which
/// candle does not have.
pub fn candle_dtype_of(tensor: &str, dtype: DType) -> Result<CDType> {
    Ok(match dtype {
        DType::U8 => CDType::U8,
        DType::U32 => CDType::U32,
        DType::I16 => CDType::I16,
        DType::I32 => CDType::I32,
        DType::I64 => CDType::I64,
        DType::BF16 => CDType::BF16,
        DType::F16 => CDType::F16,
        DType::F32 => CDType::F32,
        DType::F64 => CDType::F64,
        DType::F8E4M3 => CDType::F8E4M3,
        other => return Err(bridge(tensor, format!("dtype {other} has no candle dtype"))),
    })
}

/// The variables of `vars`, sorted by name.
fn sorted(vars: &VarMap) -> Vec<(String, Var)> {
    let data = vars
        .data()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut out: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The layout of `vars`: one tensor per variable, sorted by name, with its dtype and shape.
///
/// # Errors
/// [`Error::Bridge`] for a variable of a dtype Refit does not have;
/// [`Error::InvalidManifest`] for an empty `VarMap`.
pub fn manifest(vars: &VarMap) -> Result<Manifest> {
    let mut b = Manifest::builder();
    for (name, var) in sorted(vars) {
        b.push(name.as_str(), dtype_of(&name, var.dtype())?, var.dims());
    }
    b.build()
}

/// Copies the bytes of `tensor` (any device, any layout) into `out`, which holds exactly
/// its bytes.
fn copy_out(name: &str, tensor: &Tensor, out: &mut [u8]) -> Result<()> {
    let on_cpu;
    let tensor = if tensor.device().is_cpu() && tensor.is_contiguous() {
        tensor
    } else {
        on_cpu = tensor
            .to_device(&Device::Cpu)
            .and_then(|t| t.contiguous())
            .map_err(|e| bridge(name, format!("copying it to the host: {e}")))?;
        &on_cpu
    };
    let (storage, layout) = tensor.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(bridge(
            name,
            "its storage is not on the host after a copy there",
        ));
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| bridge(name, "not contiguous after `contiguous()`"))?;
    let bytes: &[u8] = match cpu {
        CpuStorage::U8(v) => &v[start..end],
        CpuStorage::U32(v) => bytemuck::cast_slice(&v[start..end]),
        CpuStorage::I16(v) => bytemuck::cast_slice(&v[start..end]),
        CpuStorage::I32(v) => bytemuck::cast_slice(&v[start..end]),
        CpuStorage::I64(v) => bytemuck::cast_slice(&v[start..end]),
        CpuStorage::BF16(v) => bytemuck::cast_slice(&v[start..end]),
        CpuStorage::F16(v) => bytemuck::cast_slice(&v[start..end]),
        CpuStorage::F32(v) => bytemuck::cast_slice(&v[start..end]),
        CpuStorage::F64(v) => bytemuck::cast_slice(&v[start..end]),
        CpuStorage::F8E4M3(v) => {
            let v = &v[start..end];
            if v.len() != out.len() {
                return Err(size(name, out.len(), v.len()));
            }
            for (o, x) in out.iter_mut().zip(v) {
                *o = x.to_bits();
            }
            return Ok(());
        }
        _ => {
            return Err(bridge(
                name,
                format!("dtype {:?} has no refit dtype", tensor.dtype()),
            ));
        }
    };
    if bytes.len() != out.len() {
        return Err(size(name, out.len(), bytes.len()));
    }
    crate::copy::copy_parallel(out, bytes, crate::copy::copy_threads());
    Ok(())
}

fn size(name: &str, expected: usize, found: usize) -> Error {
    bridge(
        name,
        format!("{found} bytes, where the weight set holds {expected}"),
    )
}

/// A new weight set of `model` at `version` holding every variable of `vars` (the layout
/// of [`manifest`]).
///
/// # Errors
/// As [`manifest`]; [`Error::Bridge`] naming the variable when its bytes cannot be read
/// (a device copy that fails).
pub fn export(model: ModelId, version: Version, vars: &VarMap) -> Result<WeightSet> {
    let mut ws = WeightSet::zeroed(model, Arc::new(manifest(vars)?));
    ws.set_version(version);
    export_into(vars, &mut ws)?;
    Ok(ws)
}

/// Writes every variable of `vars` into `weights`, whose manifest must name the same
/// tensors with the same dtypes and shapes (its version is left as it is).
///
/// # Errors
/// [`Error::Bridge`] naming the first tensor that is missing on either side or differs in
/// dtype or shape (checked before anything is written), or whose bytes cannot be read;
/// [`Error::ReadOnly`] for shared storage.
pub fn export_into(vars: &VarMap, weights: &mut WeightSet) -> Result<()> {
    let vars = sorted(vars);
    check(weights.model(), weights.manifest(), &vars)?;
    for (name, var) in &vars {
        copy_out(name, var.as_tensor(), weights.tensor_bytes_mut(name)?)?;
    }
    Ok(())
}

/// Checks that `vars` and `manifest` name the same tensors with the same dtypes and shapes.
fn check(model: &ModelId, manifest: &Manifest, vars: &[(String, Var)]) -> Result<()> {
    let by_name: HashMap<&str, &Var> = vars.iter().map(|(k, v)| (k.as_str(), v)).collect();
    for spec in manifest.tensors() {
        let name = spec.name.as_str();
        let Some(var) = by_name.get(name) else {
            return Err(bridge(
                name,
                format!(
                    "model `{model}`: the weight set holds it, the VarMap has no such variable"
                ),
            ));
        };
        let dtype = dtype_of(name, var.dtype())?;
        if dtype != spec.dtype {
            return Err(bridge(
                name,
                format!(
                    "model `{model}`: dtype {} in the weight set, {dtype} in the VarMap",
                    spec.dtype
                ),
            ));
        }
        if var.dims() != spec.shape.as_slice() {
            return Err(bridge(
                name,
                format!(
                    "model `{model}`: shape {:?} in the weight set, {:?} in the VarMap",
                    spec.shape,
                    var.dims()
                ),
            ));
        }
    }
    if let Some((name, _)) = vars.iter().find(|(k, _)| manifest.get(k).is_none()) {
        return Err(bridge(
            name,
            format!(
                "model `{model}`: a variable of the VarMap, which the weight set does not hold"
            ),
        ));
    }
    Ok(())
}

/// Writes `weights` into the variables of `vars` of the same names, each on its own device.
/// Every tensor is checked first: nothing is written unless each names a variable of the
/// same dtype and shape, and each variable has its tensor.
///
/// # Errors
/// [`Error::Bridge`] naming the tensor: one no variable of `vars` takes, a variable without
/// a tensor, another dtype or shape than its variable's (all checked before anything is
/// written), or a write candle refuses (a device out of memory).
pub fn import(weights: &WeightSet, vars: &VarMap) -> Result<()> {
    let vars = sorted(vars);
    check(weights.model(), weights.manifest(), &vars)?;
    for (name, var) in &vars {
        let t = weights.tensor(name)?;
        let dtype = candle_dtype_of(name, t.dtype())?;
        let value = Tensor::from_raw_buffer(t.bytes(), dtype, t.shape(), var.device())
            .map_err(|e| bridge(name, format!("making its tensor: {e}")))?;
        var.set(&value)
            .map_err(|e| bridge(name, format!("writing the variable: {e}")))?;
    }
    Ok(())
}

/// A fresh `VarMap` holding one variable per tensor of `weights`, on `device`. A model
/// built from it (`VarBuilder::from_varmap`) takes these variables where the names and
/// shapes match.
///
/// # Errors
/// [`Error::Bridge`] naming the tensor: a dtype candle does not have, or a variable candle
/// cannot make on `device`.
pub fn to_var_map(weights: &WeightSet, device: &Device) -> Result<VarMap> {
    let vars = VarMap::new();
    {
        let mut data = vars
            .data()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for t in weights.tensors() {
            let dtype = candle_dtype_of(t.name(), t.dtype())?;
            let value = Tensor::from_raw_buffer(t.bytes(), dtype, t.shape(), device)
                .and_then(|v| Var::from_tensor(&v))
                .map_err(|e| bridge(t.name(), format!("making its variable: {e}")))?;
            data.insert(t.name().to_string(), value);
        }
    }
    Ok(vars)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_nn::{Init, Module, VarBuilder};

    fn mlp_vars() -> VarMap {
        let vars = VarMap::new();
        let vb = VarBuilder::from_varmap(&vars, CDType::F32, &Device::Cpu);
        candle_nn::linear(4, 8, vb.pp("fc1")).unwrap();
        candle_nn::linear(8, 2, vb.pp("fc2")).unwrap();
        vars
    }

    fn policy() -> ModelId {
        ModelId::new("policy").unwrap()
    }

    #[test]
    fn every_dtype_round_trips_bit_for_bit() {
        let vars = VarMap::new();
        let dev = Device::Cpu;
        for (i, dtype) in [
            CDType::U8,
            CDType::U32,
            CDType::I16,
            CDType::I32,
            CDType::I64,
            CDType::BF16,
            CDType::F16,
            CDType::F32,
            CDType::F64,
            CDType::F8E4M3,
        ]
        .into_iter()
        .enumerate()
        {
            // distinct values of every width: 0..n as f32, then cast
            let t = Tensor::arange(0f32, 6.0, &dev)
                .unwrap()
                .affine(1.0, i as f64)
                .unwrap()
                .reshape((2, 3))
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let mut data = vars.data().lock().unwrap();
            data.insert(format!("t{i:02}"), Var::from_tensor(&t).unwrap());
        }
        let ws = export(policy(), Version(3), &vars).unwrap();
        assert_eq!(ws.version(), Version(3));
        assert_eq!(ws.manifest().len(), 10);
        assert_eq!(
            ws.tensor("t07").unwrap().as_slice::<f32>().unwrap()[5],
            12.0
        );
        let back = to_var_map(&ws, &dev).unwrap();
        let again = export(policy(), Version(3), &back).unwrap();
        assert_eq!(ws.bytes(), again.bytes());
        // and into variables that exist: zero them, import, compare
        let fresh = to_var_map(&WeightSet::zeroed(policy(), ws.manifest().clone()), &dev).unwrap();
        assert_ne!(
            export(policy(), Version(3), &fresh).unwrap().bytes(),
            ws.bytes()
        );
        import(&ws, &fresh).unwrap();
        assert_eq!(
            export(policy(), Version(3), &fresh).unwrap().bytes(),
            ws.bytes()
        );
    }

    #[test]
    fn a_model_imported_computes_what_it_computed() {
        let vars = mlp_vars();
        let ws = export(policy(), Version(1), &vars).unwrap();
        let names: Vec<&str> = ws
            .manifest()
            .tensors()
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(names, ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]);
        // a second model, other random weights, then the first one's imported
        let other = mlp_vars();
        let vb = VarBuilder::from_varmap(&other, CDType::F32, &Device::Cpu);
        let l1 = candle_nn::linear(4, 8, vb.pp("fc1")).unwrap();
        let x = Tensor::new(&[[0.5f32, -1.0, 2.0, 0.25]], &Device::Cpu).unwrap();
        let before = l1.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        import(&ws, &other).unwrap();
        let after = l1.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        let vb = VarBuilder::from_varmap(&vars, CDType::F32, &Device::Cpu);
        let want = candle_nn::linear(4, 8, vb.pp("fc1"))
            .unwrap()
            .forward(&x)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_ne!(before, want);
        assert_eq!(after, want);
    }

    #[test]
    fn a_weight_set_that_does_not_fit_is_refused_whole() {
        let vars = mlp_vars();
        let ws = export(policy(), Version(1), &vars).unwrap();
        let snapshot = |v: &VarMap| export(policy(), Version(1), v).unwrap().bytes().to_vec();
        // another shape for fc2.weight: refused, naming it, and fc1 (checked before) untouched
        let wide = VarMap::new();
        let vb = VarBuilder::from_varmap(&wide, CDType::F32, &Device::Cpu);
        candle_nn::linear(4, 8, vb.pp("fc1")).unwrap();
        candle_nn::linear(8, 3, vb.pp("fc2")).unwrap();
        let before = snapshot(&wide);
        let e = import(&ws, &wide).unwrap_err().to_string();
        assert!(
            e.contains("candle tensor `fc2.bias`: model `policy`: shape [2] in the weight set, [3] in the VarMap"),
            "{e}"
        );
        assert_eq!(snapshot(&wide), before);
        // a variable the weights lack, a tensor no variable takes
        let more = mlp_vars();
        more.get(3, "extra", Init::Const(1.0), CDType::F32, &Device::Cpu)
            .unwrap();
        let e = import(&ws, &more).unwrap_err().to_string();
        assert!(e.contains("`extra`") && e.contains("does not hold"), "{e}");
        let fewer = VarMap::new();
        let vb = VarBuilder::from_varmap(&fewer, CDType::F32, &Device::Cpu);
        candle_nn::linear(4, 8, vb.pp("fc1")).unwrap();
        let e = import(&ws, &fewer).unwrap_err().to_string();
        assert!(
            e.contains("`fc2.bias`") && e.contains("no such variable"),
            "{e}"
        );
        // another dtype
        let half = VarMap::new();
        let vb = VarBuilder::from_varmap(&half, CDType::F16, &Device::Cpu);
        candle_nn::linear(4, 8, vb.pp("fc1")).unwrap();
        candle_nn::linear(8, 2, vb.pp("fc2")).unwrap();
        let e = import(&ws, &half).unwrap_err().to_string();
        assert!(
            e.contains("fc1.bias") && e.contains("dtype f32 in the weight set, f16 in the VarMap"),
            "{e}"
        );
        // exporting into a weight set of another layout is refused the same way
        let mut small = export(policy(), Version(1), &fewer).unwrap();
        let e = export_into(&vars, &mut small).unwrap_err().to_string();
        assert!(e.contains("fc2") && e.contains("does not hold"), "{e}");
    }

    #[test]
    fn dtypes_without_a_counterpart_are_named() {
        let e = dtype_of("w", CDType::F4).unwrap_err().to_string();
        assert!(e.contains("candle tensor `w`") && e.contains("F4"), "{e}");
        let e = candle_dtype_of("mask", DType::Bool)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`mask`") && e.contains("bool"), "{e}");
        let vars = VarMap::new();
        let t = Tensor::zeros(4, CDType::U8, &Device::Cpu).unwrap();
        let mut m = WeightSet::zeroed(
            policy(),
            Arc::new(
                Manifest::builder()
                    .tensor("m", DType::Bool, &[4])
                    .build()
                    .unwrap(),
            ),
        );
        vars.data()
            .lock()
            .unwrap()
            .insert("m".into(), Var::from_tensor(&t).unwrap());
        let e = export_into(&vars, &mut m).unwrap_err().to_string();
        assert!(e.contains("`m`") && e.contains("dtype"), "{e}");
        let e = to_var_map(&m, &Device::Cpu).err().unwrap().to_string();
        assert!(e.contains("`m`") && e.contains("no candle dtype"), "{e}");
    }
}
