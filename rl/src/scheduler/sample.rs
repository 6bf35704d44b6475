//! Picking the next token from a row of logits at a request's temperature.

use rand::Rng;

use crate::generation::Token;

/// A sampled token and its log-probability.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Sampled {
    pub(crate) token: Token,
    pub(crate) logprob: f32,
}

/// A logit that is not a finite number (the backend's numerics failed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct BadLogit {
    pub(crate) index: usize,
    pub(crate) value: f32,
}

/// Samples one token from `logits` (one vocabulary row).
///
/// At temperature `t > 0` the token is drawn from `softmax(logits / t)` and its
/// log-probability is taken under that distribution (the behaviour policy). At `t == 0` the
/// most likely token is taken (the lowest index among equals) and its log-probability is
/// reported under the model's own distribution, `softmax(logits)`: the greedy policy itself
/// gives it probability one, which says nothing.
///
/// With `forced`, that token is taken instead of a draw (scoring a given completion) and
/// its log-probability reported the same way.
///
/// `logits` is not empty (the scheduler checks the backend's output length first), and a
/// forced token is inside it (checked when the request arrived).
pub(crate) fn sample(
    logits: &[f32],
    temperature: f32,
    rng: &mut impl Rng,
    forced: Option<Token>,
) -> Result<Sampled, BadLogit> {
    if let Some((index, &value)) = logits.iter().enumerate().find(|(_, l)| !l.is_finite()) {
        return Err(BadLogit { index, value });
    }
    let (argmax, max) =
        logits
            .iter()
            .copied()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, v)| {
                if v > bv { (i, v) } else { (bi, bv) }
            });
    let max = f64::from(max);
    let t = if temperature > 0.0 {
        f64::from(temperature)
    } else {
        1.0
    };
    // the shifted, scaled logits: the largest is 0, so every exp is in (0, 1]
    let z = |l: f32| (f64::from(l) - max) / t;
    let sum: f64 = logits.iter().map(|&l| z(l).exp()).sum();
    let log_sum = sum.ln();
    let index = if let Some(t) = forced {
        (t as usize).min(logits.len() - 1)
    } else if temperature > 0.0 {
        let u = rng.random::<f64>() * sum;
        let mut acc = 0.0;
        let mut pick = argmax;
        for (i, &l) in logits.iter().enumerate() {
            let p = z(l).exp();
            if p > 0.0 {
                // rounding may leave `u` above the last partial sum: the last token with a
                // positive probability then takes it
                pick = i;
            }
            acc += p;
            if u < acc {
                break;
            }
        }
        pick
    } else {
        argmax
    };
    Ok(Sampled {
        // the row is one vocabulary long, and vocabularies are token-indexed
        token: Token::try_from(index).unwrap_or(Token::MAX),
        logprob: (z(logits[index]) - log_sum) as f32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    #[test]
    fn greedy_takes_the_argmax_and_reports_the_model_logprob() {
        let mut rng = SmallRng::seed_from_u64(0);
        let s = sample(&[0.0, 2.0, 1.0, 2.0], 0.0, &mut rng, None).unwrap();
        assert_eq!(s.token, 1, "ties go to the lowest index");
        let z: f64 = [0.0f64, 2.0, 1.0, 2.0].iter().map(|l| l.exp()).sum();
        let expected = (2.0 - z.ln()) as f32;
        assert!((s.logprob - expected).abs() < 1e-6, "{s:?} vs {expected}");
    }

    #[test]
    fn sampling_follows_the_tempered_softmax() {
        let logits = [0.0f32, 1.0, 2.0];
        for t in [0.5f32, 1.0, 2.0] {
            let mut rng = SmallRng::seed_from_u64(42);
            let mut counts = [0usize; 3];
            let n = 20_000;
            for _ in 0..n {
                let s = sample(&logits, t, &mut rng, None).unwrap();
                counts[s.token as usize] += 1;
                // the reported logprob is the tempered one
                let w: Vec<f64> = logits
                    .iter()
                    .map(|&l| (f64::from(l) / f64::from(t)).exp())
                    .collect();
                let p = w[s.token as usize] / w.iter().sum::<f64>();
                assert!((f64::from(s.logprob) - p.ln()).abs() < 1e-5);
            }
            let w: Vec<f64> = logits
                .iter()
                .map(|&l| (f64::from(l) / f64::from(t)).exp())
                .collect();
            let total: f64 = w.iter().sum();
            for (i, c) in counts.iter().enumerate() {
                let freq = *c as f64 / n as f64;
                assert!(
                    (freq - w[i] / total).abs() < 0.02,
                    "t={t}: token {i} drawn {freq}, expected {}",
                    w[i] / total
                );
            }
        }
    }

    #[test]
    fn a_forced_token_is_taken_with_its_tempered_logprob() {
        let logits = [0.0f32, 1.0, 2.0];
        let mut rng = SmallRng::seed_from_u64(1);
        for (t, at) in [(0.5f32, 0.5f64), (1.0, 1.0), (0.0, 1.0)] {
            for token in 0..3u32 {
                let s = sample(&logits, t, &mut rng, Some(token)).unwrap();
                assert_eq!(s.token, token);
                let w: Vec<f64> = logits.iter().map(|&l| (f64::from(l) / at).exp()).collect();
                let p = w[token as usize] / w.iter().sum::<f64>();
                assert!(
                    (f64::from(s.logprob) - p.ln()).abs() < 1e-6,
                    "t={t} token={token}"
                );
            }
        }
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens() {
        let logits = [0.3f32, 0.1, 0.5, 0.2, 0.0];
        let draw = |seed| {
            let mut rng = SmallRng::seed_from_u64(seed);
            (0..32)
                .map(|_| sample(&logits, 1.0, &mut rng, None).unwrap().token)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
    }

    #[test]
    fn a_non_finite_logit_is_named() {
        let mut rng = SmallRng::seed_from_u64(0);
        let e = sample(&[0.0, f32::NAN, 1.0], 1.0, &mut rng, Some(2)).unwrap_err();
        assert_eq!(e.index, 1);
        assert!(e.value.is_nan());
        assert!(sample(&[f32::INFINITY], 0.0, &mut rng, None).is_err());
    }
}
