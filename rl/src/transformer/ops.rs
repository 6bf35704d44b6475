//! Fused candle ops with hand-written backward passes, for the trainer's hot spots: GELU
//! (candle's goes through glibc's `tanhf`, `expm1f` and `powf`, a quarter of a training
//! step) and the attention softmax (five ops and their backward in candle's composition).
//! The generator computes the same GELU ([`gelu`]), so both sides agree to rounding.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use crate::policy::tanh;

const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
const CUBIC: f32 = 0.044_715;

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))`.
pub(crate) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + tanh(SQRT_TWO_OVER_PI * x * (1.0 + CUBIC * x * x)))
}

/// `d gelu(x) / dx`.
fn gelu_grad(x: f32) -> f32 {
    let t = tanh(SQRT_TWO_OVER_PI * x * (1.0 + CUBIC * x * x));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_TWO_OVER_PI * (1.0 + 3.0 * CUBIC * x * x)
}

fn contiguous_f32<'a>(
    name: &str,
    storage: &'a CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        return Err(candle_core::Error::Msg(format!("{name} takes f32 only")));
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(candle_core::Error::Msg(format!(
            "{name} takes contiguous tensors only"
        )));
    };
    Ok(&data[start..end])
}

/// [`gelu`] as a candle op.
pub(crate) struct FastGelu;

impl CustomOp1 for FastGelu {
    fn name(&self) -> &'static str {
        "refit-fast-gelu"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(self.name(), storage, layout)?;
        let out = x.iter().map(|&v| gelu(v)).collect();
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let x = arg.flatten_all()?.to_vec1::<f32>()?;
        let d: Vec<f32> = x.iter().map(|&v| gelu_grad(v)).collect();
        let d = Tensor::from_vec(d, arg.shape(), arg.device())?;
        Ok(Some(grad.mul(&d)?))
    }
}

/// Softmax over the last axis as one candle op; its backward is
/// `y ⊙ (g - Σ g ⊙ y)` per row.
pub(crate) struct SoftmaxLast;

impl CustomOp1 for SoftmaxLast {
    fn name(&self) -> &'static str {
        "refit-softmax-last"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(self.name(), storage, layout)?;
        let n = layout.shape().dims().last().copied().unwrap_or(1).max(1);
        let mut out = vec![0.0f32; x.len()];
        for (xr, yr) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            let max = xr.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let mut sum = 0.0;
            for (y, &v) in yr.iter_mut().zip(xr) {
                *y = (v - max).exp();
                sum += *y;
            }
            let inv = 1.0 / sum;
            yr.iter_mut().for_each(|y| *y *= inv);
        }
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let n = res.dims().last().copied().unwrap_or(1).max(1);
        let y = res.flatten_all()?.to_vec1::<f32>()?;
        let g = grad.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let mut dx = vec![0.0f32; y.len()];
        for ((yr, gr), dr) in y
            .chunks_exact(n)
            .zip(g.chunks_exact(n))
            .zip(dx.chunks_exact_mut(n))
        {
            let dot: f32 = yr.iter().zip(gr).map(|(a, b)| a * b).sum();
            for ((d, &yv), &gv) in dr.iter_mut().zip(yr).zip(gr) {
                *d = yv * (gv - dot);
            }
        }
        Ok(Some(Tensor::from_vec(dx, res.shape(), res.device())?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{D, Device, Var};

    use super::*;

    fn grad_of(x: &Var, f: impl Fn(&Tensor) -> Tensor, w: &Tensor) -> Vec<f32> {
        let y = f(x.as_tensor());
        let loss = (y * w).unwrap().sum_all().unwrap();
        let g = loss.backward().unwrap();
        g.get(x.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    fn close(a: &[f32], b: &[f32], tol: f32) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{x} vs {y}");
        }
    }

    #[test]
    fn fused_ops_match_candles_forward_and_backward() {
        let dev = Device::Cpu;
        let vals: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
        let x = Var::from_vec(vals, (4, 6), &dev).unwrap();
        let w = Tensor::from_vec(
            (0..24).map(|i| (i as f32 * 0.11).cos()).collect(),
            (4, 6),
            &dev,
        )
        .unwrap();
        let ours = |t: &Tensor| t.apply_op1(FastGelu).unwrap();
        let theirs = |t: &Tensor| t.gelu().unwrap();
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        close(
            &flat(ours(x.as_tensor())),
            &flat(theirs(x.as_tensor())),
            1e-5,
        );
        close(&grad_of(&x, ours, &w), &grad_of(&x, theirs, &w), 1e-4);
        let ours = |t: &Tensor| t.apply_op1(SoftmaxLast).unwrap();
        let theirs = |t: &Tensor| candle_nn::ops::softmax(t, D::Minus1).unwrap();
        close(
            &flat(ours(x.as_tensor())),
            &flat(theirs(x.as_tensor())),
            1e-6,
        );
        close(&grad_of(&x, ours, &w), &grad_of(&x, theirs, &w), 1e-5);
        // Rows masked with -inf get zero weight and zero gradient there.
        let m = Tensor::from_vec(vec![0.0f32, f32::NEG_INFINITY, 0.0], (1, 3), &dev).unwrap();
        let y = flat(m.apply_op1(SoftmaxLast).unwrap());
        assert_eq!(y, vec![0.5, 0.0, 0.5]);
    }
}
