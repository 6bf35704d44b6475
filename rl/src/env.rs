//! Environments: the [`Env`] trait users implement, and [`CartPole`] (Gymnasium `CartPole-v1`).
//!
//! Observations are small `f32` vectors and actions are discrete (`usize` indices). A
//! collector steps several environments of one worker side by side (its vectorised form)
//! and resets finished ones automatically.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};

/// What one environment step returns.
#[derive(Clone, Debug, PartialEq)]
pub struct StepResult {
    /// The observation after the step (the terminal observation if the episode ended).
    pub obs: Vec<f32>,
    /// The reward of the step.
    pub reward: f32,
    /// The episode reached a terminal state (no bootstrapping past it).
    pub terminated: bool,
    /// The episode was cut (time limit); the state is not terminal.
    pub truncated: bool,
}

impl StepResult {
    /// True when the episode ended, terminated or truncated.
    pub fn done(&self) -> bool {
        self.terminated || self.truncated
    }
}

// ANCHOR: env
/// An environment with `f32` observations and discrete actions.
pub trait Env: Send {
    /// Length of an observation.
    fn obs_dim(&self) -> usize;
    /// Number of discrete actions.
    fn num_actions(&self) -> usize;
    /// Starts a new episode; `seed` reseeds the environment's generator (`None` continues it).
    ///
    /// # Errors
    /// Whatever the environment reports; [`Error::Env`] is the usual variant.
    fn reset(&mut self, seed: Option<u64>) -> Result<Vec<f32>>;
    /// Applies one action.
    ///
    /// # Errors
    /// An invalid action or an environment failure ([`Error::Env`]).
    fn step(&mut self, action: usize) -> Result<StepResult>;
}
// ANCHOR_END: env

/// Gymnasium `CartPole-v1`: same constants, same Euler integration, same rules, with the
/// 500-step time limit of its registration built in.
///
/// The state is integrated in `f64` as Gymnasium does (NumPy float64) and observations are
/// returned as `f32`. Reset draws each state component uniformly in `[-0.05, 0.05]`; the
/// random generator differs from NumPy's, so seeded episodes differ from Gymnasium's.
#[derive(Debug, Clone)]
pub struct CartPole {
    state: [f64; 4],
    rng: SmallRng,
    elapsed: u32,
    max_episode_steps: u32,
    steps_beyond_terminated: Option<u32>,
    index: usize,
}

impl CartPole {
    /// Gravity, m/s².
    pub const GRAVITY: f64 = 9.8;
    /// Mass of the cart, kg.
    pub const MASS_CART: f64 = 1.0;
    /// Mass of the pole, kg.
    pub const MASS_POLE: f64 = 0.1;
    /// Cart plus pole.
    pub const TOTAL_MASS: f64 = Self::MASS_CART + Self::MASS_POLE;
    /// Half the pole's length, m.
    pub const LENGTH: f64 = 0.5;
    /// Pole mass times half length.
    pub const POLEMASS_LENGTH: f64 = Self::MASS_POLE * Self::LENGTH;
    /// Magnitude of the push, N.
    pub const FORCE_MAG: f64 = 10.0;
    /// Seconds between state updates.
    pub const TAU: f64 = 0.02;
    /// Pole angle beyond which the episode terminates: 12 degrees, in radians.
    pub const THETA_THRESHOLD_RADIANS: f64 = 12.0 * 2.0 * std::f64::consts::PI / 360.0;
    /// Cart position beyond which the episode terminates, m.
    pub const X_THRESHOLD: f64 = 2.4;
    /// The time limit of `CartPole-v1`.
    pub const MAX_EPISODE_STEPS: u32 = 500;

    /// A cart-pole seeded with `seed` (state set by the first [`Env::reset`]).
    pub fn new(seed: u64) -> Self {
        Self {
            state: [0.0; 4],
            rng: SmallRng::seed_from_u64(seed),
            elapsed: 0,
            max_episode_steps: Self::MAX_EPISODE_STEPS,
            steps_beyond_terminated: None,
            index: 0,
        }
    }

    /// Changes the time limit (500 for `CartPole-v1`).
    #[must_use]
    pub fn with_max_episode_steps(mut self, steps: u32) -> Self {
        self.max_episode_steps = steps;
        self
    }

    /// Sets the index reported in errors (the collector's env slot).
    #[must_use]
    pub fn with_index(mut self, index: usize) -> Self {
        self.index = index;
        self
    }

    /// The state `[x, x_dot, theta, theta_dot]`.
    pub fn state(&self) -> [f64; 4] {
        self.state
    }

    /// Sets the state (tests, replays) and restarts the episode clock.
    pub fn set_state(&mut self, state: [f64; 4]) {
        self.state = state;
        self.elapsed = 0;
        self.steps_beyond_terminated = None;
    }

    fn obs(&self) -> Vec<f32> {
        self.state.iter().map(|&v| v as f32).collect()
    }
}

impl Env for CartPole {
    fn obs_dim(&self) -> usize {
        4
    }

    fn num_actions(&self) -> usize {
        2
    }

    fn reset(&mut self, seed: Option<u64>) -> Result<Vec<f32>> {
        if let Some(seed) = seed {
            self.rng = SmallRng::seed_from_u64(seed);
        }
        for v in &mut self.state {
            *v = self.rng.random_range(-0.05..=0.05);
        }
        self.elapsed = 0;
        self.steps_beyond_terminated = None;
        Ok(self.obs())
    }

    fn step(&mut self, action: usize) -> Result<StepResult> {
        if action > 1 {
            return Err(Error::env(
                self.index,
                format!("cartpole action {action} is invalid (0 or 1)"),
            ));
        }
        let [x, x_dot, theta, theta_dot] = self.state;
        let force = if action == 1 {
            Self::FORCE_MAG
        } else {
            -Self::FORCE_MAG
        };
        let (sintheta, costheta) = theta.sin_cos();
        let temp =
            (force + Self::POLEMASS_LENGTH * theta_dot * theta_dot * sintheta) / Self::TOTAL_MASS;
        let thetaacc = (Self::GRAVITY * sintheta - costheta * temp)
            / (Self::LENGTH
                * (4.0 / 3.0 - Self::MASS_POLE * costheta * costheta / Self::TOTAL_MASS));
        let xacc = temp - Self::POLEMASS_LENGTH * thetaacc * costheta / Self::TOTAL_MASS;
        // Euler integration, as Gymnasium's default `kinematics_integrator = "euler"`.
        self.state = [
            x + Self::TAU * x_dot,
            x_dot + Self::TAU * xacc,
            theta + Self::TAU * theta_dot,
            theta_dot + Self::TAU * thetaacc,
        ];
        let [x, _, theta, _] = self.state;
        let terminated = !(-Self::X_THRESHOLD..=Self::X_THRESHOLD).contains(&x)
            || !(-Self::THETA_THRESHOLD_RADIANS..=Self::THETA_THRESHOLD_RADIANS).contains(&theta);
        let reward = if !terminated {
            1.0
        } else if let Some(n) = self.steps_beyond_terminated.as_mut() {
            // Stepping past termination: Gymnasium warns and pays 0.
            *n += 1;
            0.0
        } else {
            self.steps_beyond_terminated = Some(0);
            1.0
        };
        self.elapsed += 1;
        let truncated = self.elapsed >= self.max_episode_steps;
        Ok(StepResult {
            obs: self.obs(),
            reward,
            terminated,
            truncated,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: [f64; 4], b: [f64; 4]) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-12, "{a:?} != {b:?}");
        }
    }

    #[test]
    fn constants_are_gymnasium_cartpole_v1() {
        assert!((CartPole::THETA_THRESHOLD_RADIANS - 0.20943951023931953).abs() < 1e-15);
        assert_eq!(CartPole::TOTAL_MASS, 1.1);
        assert_eq!(CartPole::POLEMASS_LENGTH, 0.05);
    }

    #[test]
    fn steps_match_hand_computed_values() {
        let mut env = CartPole::new(0);
        env.set_state([0.0, 0.0, 0.0, 0.0]);
        let r = env.step(1).unwrap();
        // temp = 10/1.1; thetaacc = -temp / (0.5 * (4/3 - 0.1/1.1)); xacc = temp - 0.05*thetaacc/1.1
        close(
            env.state(),
            [0.0, 0.1951219512195122, 0.0, -0.2926829268292683],
        );
        assert_eq!(r.reward, 1.0);
        assert!(!r.terminated && !r.truncated);
        assert_eq!(r.obs, vec![0.0, 0.19512195, 0.0, -0.29268292]);

        env.set_state([0.01, -0.02, 0.03, 0.04]);
        env.step(1).unwrap();
        close(
            env.state(),
            [
                0.009600000000000001,
                0.17467919574755525,
                0.030799999999999998,
                -0.2430687179600081,
            ],
        );
        env.step(0).unwrap();
        close(
            env.state(),
            [
                0.013093583914951107,
                -0.020868848948191993,
                0.025938625640799837,
                0.0591679999394166,
            ],
        );
    }

    #[test]
    fn termination_truncation_and_reset() {
        let mut env = CartPole::new(7);
        let obs = env.reset(Some(3)).unwrap();
        assert!(obs.iter().all(|v| v.abs() <= 0.05));
        let again = CartPole::new(99).reset(Some(3)).unwrap();
        assert_eq!(obs, again, "same seed, same reset");
        // x beyond 2.4 terminates, reward 1 on the terminating step, 0 after
        env.set_state([2.39, 1.0, 0.0, 0.0]);
        let r = env.step(1).unwrap();
        assert!(r.terminated && !r.truncated);
        assert_eq!(r.reward, 1.0);
        assert_eq!(env.step(1).unwrap().reward, 0.0);
        // theta beyond 12 degrees terminates
        env.set_state([0.0, 0.0, 0.2094, 1.0]);
        assert!(env.step(1).unwrap().terminated);
        env.set_state([0.0, 0.0, -0.2094, -1.0]);
        assert!(env.step(0).unwrap().terminated);
        // time limit: balance by hand for 500 steps with a bang-bang controller
        env.reset(Some(1)).unwrap();
        let mut last = None;
        for t in 0..500 {
            let s = env.state();
            let a = usize::from(s[2] + 0.5 * s[3] > 0.0);
            let r = env.step(a).unwrap();
            assert!(!r.terminated, "fell at {t}");
            last = Some(r);
        }
        assert!(last.unwrap().truncated);
        assert!(env.step(2).is_err());
    }
}
