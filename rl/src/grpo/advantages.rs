//! Group-relative advantages, per sequence or per position.

use std::collections::BTreeMap;

use crate::batch::Sequence;

/// Per-token advantages of `seqs` (one vector per sequence, one value per generated token);
/// see the [module docs](crate::grpo).
pub fn group_advantages(
    seqs: &[Sequence],
    scale_by_std: bool,
    token_credit: bool,
) -> Vec<Vec<f32>> {
    const EPS: f32 = 1e-6;
    let mut groups: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (i, s) in seqs.iter().enumerate() {
        groups.entry(s.group).or_default().push(i);
    }
    let mut adv: Vec<Vec<f32>> = seqs.iter().map(|s| vec![0.0; s.tokens.len()]).collect();
    let stats = |vals: &[f32]| {
        let n = vals.len() as f32;
        let mean = vals.iter().sum::<f32>() / n;
        let var = vals.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
        (mean, var.sqrt())
    };
    let norm = |v: f32, (mean, std): (f32, f32)| {
        if scale_by_std {
            (v - mean) / (std + EPS)
        } else {
            v - mean
        }
    };
    for members in groups.values() {
        let per_token = token_credit
            && members.iter().all(|&i| {
                seqs[i]
                    .token_rewards
                    .as_ref()
                    .is_some_and(|r| r.len() == seqs[i].tokens.len())
            });
        if per_token {
            let longest = members
                .iter()
                .map(|&i| seqs[i].tokens.len())
                .max()
                .unwrap_or(0);
            let mut vals = Vec::with_capacity(members.len());
            // `t` is a position in several sequences at once.
            #[allow(clippy::needless_range_loop)]
            for t in 0..longest {
                vals.clear();
                let at: Vec<usize> = members
                    .iter()
                    .copied()
                    .filter(|&i| t < seqs[i].tokens.len())
                    .collect();
                vals.extend(at.iter().map(|&i| token_reward(&seqs[i], t)));
                let st = stats(&vals);
                for (&i, &v) in at.iter().zip(&vals) {
                    adv[i][t] = norm(v, st);
                }
            }
        } else {
            let vals: Vec<f32> = members.iter().map(|&i| seqs[i].reward).collect();
            let st = stats(&vals);
            for (&i, &v) in members.iter().zip(&vals) {
                let a = norm(v, st);
                adv[i].fill(a);
            }
        }
    }
    adv
}

fn token_reward(s: &Sequence, t: usize) -> f32 {
    s.token_rewards
        .as_ref()
        .and_then(|r| r.get(t))
        .copied()
        .unwrap_or(0.0)
}
