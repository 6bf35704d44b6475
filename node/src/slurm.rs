//! Slurm's compressed host lists (`SLURM_STEP_NODELIST`, `SLURM_JOB_NODELIST`):
//! `node[01-03,07],gpu5` names `node01`, `node02`, `node03`, `node07` and `gpu5`.

use crate::error::{Error, Result};

/// Most host names one list may expand to (a guard against `node[0-999999999]`).
pub const MAX_HOSTS: usize = 65_536;

fn bad(var: &'static str, list: &str, reason: impl std::fmt::Display) -> Error {
    Error::Launch {
        var,
        reason: format!("host list {list:?}: {reason}"),
    }
}

/// Splits at commas outside brackets.
fn items(list: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                out.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&list[start..]);
    out
}

/// Expands one item (`prefix[ranges]suffix`, or a plain name) into `out`.
fn expand_item(var: &'static str, list: &str, item: &str, out: &mut Vec<String>) -> Result<()> {
    let item = item.trim();
    if item.is_empty() {
        return Err(bad(var, list, "an empty host name"));
    }
    let Some(open) = item.find('[') else {
        if item.contains(']') {
            return Err(bad(var, list, format!("`{item}` has `]` without `[`")));
        }
        out.push(item.to_string());
        return Ok(());
    };
    let close = item[open..]
        .find(']')
        .map(|c| open + c)
        .ok_or_else(|| bad(var, list, format!("`{item}` has `[` without `]`")))?;
    let (prefix, ranges, suffix) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    // suffixes may hold further brackets (`a[1-2]b[3-4]`)
    let mut tails = Vec::new();
    expand_item(var, list, &format!("x{suffix}"), &mut tails)?;
    for range in ranges.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let num = |s: &str| {
            s.trim()
                .parse::<u64>()
                .map_err(|_| bad(var, list, format!("`{range}` is not a number or a range")))
        };
        let (a, b) = (num(lo)?, num(hi)?);
        if a > b {
            return Err(bad(var, list, format!("range `{range}` runs backwards")));
        }
        let width = lo.trim().len();
        for n in a..=b {
            if out.len() + tails.len() > MAX_HOSTS {
                return Err(bad(var, list, format!("more than {MAX_HOSTS} hosts")));
            }
            for t in &tails {
                out.push(format!("{prefix}{n:0width$}{}", &t[1..]));
            }
        }
    }
    Ok(())
}

/// Every host a Slurm host list names, in order. `var` is the variable it came from (for
/// the error).
///
/// # Errors
/// [`Error::Launch`] naming `var` for an empty list, an empty name, unbalanced brackets, a
/// range that is not numeric or runs backwards, or more than [`MAX_HOSTS`] hosts.
pub fn expand_nodelist(var: &'static str, list: &str) -> Result<Vec<String>> {
    if list.trim().is_empty() {
        return Err(bad(var, list, "empty"));
    }
    let mut out = Vec::new();
    for item in items(list.trim()) {
        expand_item(var, list, item, &mut out)?;
    }
    Ok(out)
}

/// The first host of a Slurm host list (where rank 0 runs: `MASTER_ADDR`).
///
/// # Errors
/// As [`expand_nodelist`].
pub fn first_host(var: &'static str, list: &str) -> Result<String> {
    let mut hosts = expand_nodelist(var, list)?;
    Ok(hosts.swap_remove(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: &str = "SLURM_STEP_NODELIST";

    #[test]
    fn lists_expand_in_order() {
        assert_eq!(
            expand_nodelist(V, "node[01-03,07],gpu5").unwrap(),
            ["node01", "node02", "node03", "node07", "gpu5"]
        );
        assert_eq!(expand_nodelist(V, "solo").unwrap(), ["solo"]);
        assert_eq!(expand_nodelist(V, "a[8-10]").unwrap(), ["a8", "a9", "a10"]);
        assert_eq!(
            expand_nodelist(V, "r[1-2]-n[3-4]").unwrap(),
            ["r1-n3", "r1-n4", "r2-n3", "r2-n4"]
        );
        assert_eq!(
            expand_nodelist(V, "x[009-011].cluster").unwrap(),
            ["x009.cluster", "x010.cluster", "x011.cluster"]
        );
        assert_eq!(first_host(V, "gpu[3-4],cpu1").unwrap(), "gpu3");
        assert_eq!(first_host(V, "10.0.0.7").unwrap(), "10.0.0.7");
    }

    #[test]
    fn bad_lists_name_the_variable_and_the_fault() {
        for (list, what) in [
            ("", "empty"),
            ("node[1-3", "without `]`"),
            ("node1]", "without `[`"),
            ("node[a-b]", "not a number"),
            ("node[5-2]", "backwards"),
            ("a,,b", "empty host name"),
            ("n[0-99999999]", "more than"),
        ] {
            let e = expand_nodelist(V, list).unwrap_err().to_string();
            assert!(e.contains(V) && e.contains(what), "{list:?}: {e}");
        }
    }
}
