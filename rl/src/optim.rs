//! AdamW (decoupled weight decay) over candle variables, whose state a checkpoint can take
//! and give back: the first and second moments of every variable and the step count.
//! The update is the textbook one: `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`,
//! `theta = theta (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)` with the bias corrections
//! `m_hat = m / (1 - b1^t)` and `v_hat = v / (1 - b2^t)`.

use candle_core::Var;
use candle_core::backprop::GradStore;

use crate::error::{Error, Result};
use crate::state::{LearnerState, StateWriter};

/// AdamW's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWParams {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

struct Slot {
    var: Var,
    m: Var,
    v: Var,
}

/// AdamW over a fixed list of variables.
pub struct AdamW {
    slots: Vec<Slot>,
    step: u64,
    params: AdamWParams,
}

impl std::fmt::Debug for AdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW")
            .field("vars", &self.slots.len())
            .field("step", &self.step)
            .field("params", &self.params)
            .finish()
    }
}

impl AdamW {
    /// An optimiser of `vars` (the floating-point ones; others are left alone), moments
    /// zero, step 0.
    ///
    /// # Errors
    /// Candle errors allocating the moments.
    pub fn new(vars: Vec<Var>, params: AdamWParams) -> Result<Self> {
        let slots = vars
            .into_iter()
            .filter(|var| var.dtype().is_float())
            .map(|var| {
                let zeros = || Var::zeros(var.shape(), var.dtype(), var.device());
                Ok(Slot {
                    m: zeros()?,
                    v: zeros()?,
                    var,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            slots,
            step: 0,
            params,
        })
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    /// Changes the learning rate.
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// One step with `grads`; variables without a gradient are left alone.
    ///
    /// # Errors
    /// Candle errors.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step += 1;
        let p = self.params;
        let t = i32::try_from(self.step).unwrap_or(i32::MAX);
        let scale_m = 1.0 / (1.0 - p.beta1.powi(t));
        let scale_v = 1.0 / (1.0 - p.beta2.powi(t));
        for s in &self.slots {
            let Some(g) = grads.get(&s.var) else { continue };
            let m = ((s.m.as_tensor() * p.beta1)? + (g * (1.0 - p.beta1))?)?;
            let v = ((s.v.as_tensor() * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?;
            let m_hat = (&m * scale_m)?;
            let v_hat = (&v * scale_v)?;
            let decayed = (s.var.as_tensor() * (1.0 - p.lr * p.weight_decay))?;
            let adjusted = (m_hat / (v_hat.sqrt()? + p.eps)?)?;
            let theta = (decayed - (adjusted * p.lr)?)?;
            s.m.set(&m)?;
            s.v.set(&v)?;
            s.var.set(&theta)?;
        }
        Ok(())
    }

    /// Adds the moments (`{prefix}.m.{i}`, `{prefix}.v.{i}`, in variable order), the step
    /// count and the learning rate to a learner's state.
    ///
    /// # Errors
    /// Candle errors reading the moments.
    pub fn save(&self, prefix: &str, out: &mut StateWriter) -> Result<()> {
        for (i, s) in self.slots.iter().enumerate() {
            out.tensor(format!("{prefix}.m.{i}"), s.m.as_tensor())?;
            out.tensor(format!("{prefix}.v.{i}"), s.v.as_tensor())?;
        }
        out.scalar(format!("{prefix}.step"), self.step as f64);
        out.scalar(format!("{prefix}.lr"), self.params.lr);
        Ok(())
    }

    /// Takes back what [`AdamW::save`] wrote under `prefix`.
    ///
    /// # Errors
    /// A state that lacks a moment or holds one of another shape, naming it.
    pub fn restore(&mut self, prefix: &str, state: &LearnerState<'_>) -> Result<()> {
        for (i, s) in self.slots.iter().enumerate() {
            s.m.set(&state.tensor(&format!("{prefix}.m.{i}"), s.m.as_tensor())?)?;
            s.v.set(&state.tensor(&format!("{prefix}.v.{i}"), s.v.as_tensor())?)?;
        }
        let step = state.scalar(&format!("{prefix}.step"))?;
        if !(step >= 0.0 && step.fract() == 0.0) {
            return Err(Error::Config(format!(
                "{}: `{prefix}.step` is {step}, not a step count",
                state.source()
            )));
        }
        self.step = step as u64;
        self.params.lr = state.scalar(&format!("{prefix}.lr"))?;
        Ok(())
    }
}
