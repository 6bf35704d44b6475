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

/// The numbers of one bracket (`01-03,07`), formatted to the width of each range's low end
/// (`01-03` gives `01`, `02`, `03`; `8-10` gives `8`, `9`, `10`), in order. `room` is how
/// many more hosts may come.
fn numbers(var: &'static str, list: &str, ranges: &str, room: usize) -> Result<Vec<String>> {
    let mut out = Vec::new();
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
        if b - a >= (room - out.len()) as u64 {
            return Err(bad(var, list, format!("more than {MAX_HOSTS} hosts")));
        }
        let width = lo.trim().len();
        out.extend((a..=b).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

/// Expands one item (`prefix[ranges]`, `r[1-2]-n[3-4]`, or a plain name) into `out`, in
/// the order `scontrol show hostnames` gives: the last bracket varies fastest, then the
/// first, the second, and so on (`a[1-2]b[3-4]c[5-6]` gives `a1b3c5 a1b3c6 a2b3c5 a2b3c6
/// a1b4c5 ...`).
fn expand_item(var: &'static str, list: &str, item: &str, out: &mut Vec<String>) -> Result<()> {
    let item = item.trim();
    if item.is_empty() {
        return Err(bad(var, list, "an empty host name"));
    }
    // the literal text around the brackets (one more than the brackets), and each bracket
    let mut texts: Vec<&str> = Vec::new();
    let mut brackets: Vec<Vec<String>> = Vec::new();
    let mut rest = item;
    loop {
        let Some(open) = rest.find('[') else {
            if rest.contains(']') {
                return Err(bad(var, list, format!("`{item}` has `]` without `[`")));
            }
            texts.push(rest);
            break;
        };
        if rest[..open].contains(']') {
            return Err(bad(var, list, format!("`{item}` has `]` without `[`")));
        }
        let close = rest[open..]
            .find(']')
            .map(|c| open + c)
            .ok_or_else(|| bad(var, list, format!("`{item}` has `[` without `]`")))?;
        texts.push(&rest[..open]);
        let room = MAX_HOSTS.saturating_sub(out.len()).max(1);
        brackets.push(numbers(var, list, &rest[open + 1..close], room)?);
        rest = &rest[close + 1..];
    }
    let Some((last, lead)) = brackets.split_last() else {
        out.push(item.to_string());
        return Ok(());
    };
    if let Some(tail) = texts.last().filter(|t| !t.is_empty()) {
        return Err(bad(
            var,
            list,
            format!("`{item}` has `{tail}` after its last `]`, which Slurm does not accept"),
        ));
    }
    let total = brackets
        .iter()
        .try_fold(1usize, |n, b| n.checked_mul(b.len()))
        .filter(|n| out.len().saturating_add(*n) <= MAX_HOSTS);
    if total.is_none() {
        return Err(bad(var, list, format!("more than {MAX_HOSTS} hosts")));
    }
    // an odometer over the leading brackets, the first turning fastest
    let mut at = vec![0usize; lead.len()];
    loop {
        let mut name = String::new();
        for (i, b) in lead.iter().enumerate() {
            name.push_str(texts[i]);
            name.push_str(&b[at[i]]);
        }
        name.push_str(texts[lead.len()]);
        for n in last {
            out.push(format!("{name}{n}"));
        }
        let Some(turn) = (0..lead.len()).find(|&i| at[i] + 1 < lead[i].len()) else {
            return Ok(());
        };
        at[turn] += 1;
        at[..turn].fill(0);
    }
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

    /// Each list with what `scontrol show hostnames LIST` printed for it (Slurm 22.05.8,
    /// Debian 12's slurm-client).
    #[test]
    fn lists_expand_as_scontrol_show_hostnames_does() {
        for (list, scontrol) in [
            ("node[01-03,07],gpu5", "node01 node02 node03 node07 gpu5"),
            ("a[8-10]", "a8 a9 a10"),
            ("r[1-2]-n[3-4]", "r1-n3 r1-n4 r2-n3 r2-n4"),
            ("solo", "solo"),
            ("10.0.0.7", "10.0.0.7"),
            ("n[098-101]", "n098 n099 n100 n101"),
            ("gpu[3-4],cpu1", "gpu3 gpu4 cpu1"),
            ("[1000-1002]", "1000 1001 1002"),
            ("n[1-2] ,m3", "n1 n2 m3"),
            ("n[7]", "n7"),
            ("n[01-3]", "n01 n02 n03"),
            ("n[1-03]", "n1 n2 n3"),
            ("n[1-2]-[3-4]", "n1-3 n1-4 n2-3 n2-4"),
            ("x[1-2]y[3-4],z[1-2]", "x1y3 x1y4 x2y3 x2y4 z1 z2"),
            ("a[1-2]b[3-4]c[5]", "a1b3c5 a2b3c5 a1b4c5 a2b4c5"),
            (
                "a[1-2]b[3-4]c[5-6]",
                "a1b3c5 a1b3c6 a2b3c5 a2b3c6 a1b4c5 a1b4c6 a2b4c5 a2b4c6",
            ),
            (
                "a[1-3]b[4-5]c[6-7]",
                "a1b4c6 a1b4c7 a2b4c6 a2b4c7 a3b4c6 a3b4c7 a1b5c6 a1b5c7 a2b5c6 a2b5c7 a3b5c6 a3b5c7",
            ),
            (
                "a[1-2]b[3-4]c[5-6]d[7-8]",
                "a1b3c5d7 a1b3c5d8 a2b3c5d7 a2b3c5d8 a1b4c5d7 a1b4c5d8 a2b4c5d7 a2b4c5d8 \
                 a1b3c6d7 a1b3c6d8 a2b3c6d7 a2b3c6d8 a1b4c6d7 a1b4c6d8 a2b4c6d7 a2b4c6d8",
            ),
        ] {
            let want: Vec<&str> = scontrol.split_whitespace().collect();
            assert_eq!(expand_nodelist(V, list).unwrap(), want, "{list}");
        }
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
            // scontrol: "Invalid hostlist" for both
            ("x[009-011].cluster", "`.cluster` after its last `]`"),
            ("a[1-2]b[3-4]c", "`c` after its last `]`"),
            ("a[[1-2]]", "not a number"),
            ("n[0-70000]", "more than"),
            ("a[0-300]b[0-300]", "more than"),
            ("a,,b", "empty host name"),
            ("n[0-99999999]", "more than"),
        ] {
            let e = expand_nodelist(V, list).unwrap_err().to_string();
            assert!(e.contains(V) && e.contains(what), "{list:?}: {e}");
        }
    }
}
