//! Deltas over a bucket plan, for transports that move buckets (TCP): the tensors whose
//! piece checksums changed since the base decide which buckets move; the others are taken
//! from the base the receiver holds.

use std::ops::Range;

use crate::bucket::BucketPlan;

/// The buckets one update moves by a plan: every one (full), or those holding a byte of a
/// tensor that changed since the base (a delta).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketDelta {
    /// Indices of the buckets to move, ascending.
    pub buckets: Vec<usize>,
    /// True when every bucket moves (no base, or a base cut by another plan).
    pub full: bool,
}

impl BucketDelta {
    /// What moves for the version whose piece checksums (every piece of `plan`, in plan
    /// order) are `new`, to a receiver holding the version whose checksums are `base`: the
    /// buckets touching a tensor with a changed piece, or every bucket when there is no base
    /// or it was cut otherwise (its checksum count differs).
    pub fn plan(plan: &BucketPlan, base: Option<&[u64]>, new: &[u64]) -> Self {
        match base.and_then(|b| Self::changed_tensors(plan, b, new)) {
            Some(changed) => Self {
                buckets: plan.touching(&changed),
                full: false,
            },
            None => Self {
                buckets: (0..plan.len()).collect(),
                full: true,
            },
        }
    }

    /// The tensors (manifest positions, ascending) with a piece whose checksum differs
    /// between `base` and `new`; `None` when the two do not both hold one checksum per
    /// piece of `plan`.
    pub fn changed_tensors(plan: &BucketPlan, base: &[u64], new: &[u64]) -> Option<Vec<usize>> {
        let pieces: usize = plan.buckets.iter().map(|b| b.pieces.len()).sum();
        if base.len() != pieces || new.len() != pieces {
            return None;
        }
        let mut changed: Vec<usize> = plan
            .buckets
            .iter()
            .flat_map(|b| &b.pieces)
            .zip(new.iter().zip(base))
            .filter(|(_, (a, b))| a != b)
            .map(|(p, _)| p.tensor)
            .collect();
        changed.sort_unstable();
        changed.dedup();
        Some(changed)
    }

    /// The arena byte ranges of the buckets of `plan` a delta moving `moved` (ascending
    /// bucket indices) leaves out: the receiver takes them from its base.
    pub fn kept(plan: &BucketPlan, moved: &[usize]) -> Vec<Range<usize>> {
        let mut moved = moved.iter().peekable();
        plan.buckets
            .iter()
            .enumerate()
            .filter(|(i, _)| moved.next_if(|&&m| m == *i).is_none())
            .map(|(_, spec)| spec.range())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Manifest, ModelId};

    #[test]
    fn a_changed_tensor_moves_its_buckets_and_keeps_the_others() {
        let mut b = Manifest::builder();
        for (i, n) in [4096usize, 8192, 64, 64].iter().enumerate() {
            b.push(format!("t{i}"), DType::U8, &[*n]);
        }
        let m = b.build().unwrap();
        let id = ModelId::new("m").unwrap();
        let plan = BucketPlan::compute(&id, &m, &m, 4096).unwrap();
        let pieces: usize = plan.buckets.iter().map(|b| b.pieces.len()).sum();
        let base: Vec<u64> = (0..pieces as u64).collect();
        // no base, or one cut by another plan: full
        let full = BucketDelta::plan(&plan, None, &base);
        assert!(full.full);
        assert_eq!(full.buckets, (0..plan.len()).collect::<Vec<_>>());
        assert!(BucketDelta::plan(&plan, Some(&base[1..]), &base).full);
        // nothing changed: nothing moves, everything is kept
        let none = BucketDelta::plan(&plan, Some(&base), &base);
        assert!(!none.full && none.buckets.is_empty());
        assert_eq!(
            BucketDelta::kept(&plan, &none.buckets),
            plan.buckets.iter().map(|b| b.range()).collect::<Vec<_>>()
        );
        // t1 (cut over two buckets) changed in one piece: both its buckets move
        let mut new = base.clone();
        let at = plan
            .buckets
            .iter()
            .flat_map(|b| &b.pieces)
            .position(|p| p.tensor == 1)
            .unwrap();
        new[at + 1] ^= 1;
        assert_eq!(
            BucketDelta::changed_tensors(&plan, &base, &new),
            Some(vec![1])
        );
        let d = BucketDelta::plan(&plan, Some(&base), &new);
        assert!(!d.full);
        assert_eq!(d.buckets, plan.touching(&[1]));
        let kept = BucketDelta::kept(&plan, &d.buckets);
        assert_eq!(kept.len(), plan.len() - d.buckets.len());
        for (i, spec) in plan.buckets.iter().enumerate() {
            assert_eq!(kept.contains(&spec.range()), !d.buckets.contains(&i));
        }
    }
}
