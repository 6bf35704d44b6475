//! Overrides of topology keys (`refit launch --set key=value`), applied to the TOML document
//! before it is validated, so a bad override is refused like a bad file: naming the key.
//!
//! A key is a dotted path: `sync.sync_mode`, `stop.max_time_s`, `model.policy.params.lr`.
//! An entry of an array of tables (`[[process]]`, `[[model]]`, `[[host]]`) is addressed by
//! its `name` (or `id`): `process.actor.replicas`, or as errors write it,
//! `process[actor].replicas`; an entry without a name by its position, `process[#2]`. A
//! segment holding dots is quoted: `model.policy.params."a.b"`. Missing tables on the way are
//! created (`stop.max_time_s` without a `[stop]`); a missing entry is an error listing the
//! entries there are.
//!
//! A value is a TOML value (`3`, `0.001`, `true`, `["a", "b"]`, `{ k = "v" }`, `"quoted"`);
//! anything else is taken as a string, so bare words need no quotes (`fully-async`).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// One segment of an override's key.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    /// A key of a table (or, where the value is an array of tables, an entry's name).
    Key(String),
    /// An entry of an array of tables, by name or `#position` (written `[label]`).
    Entry(String),
}

/// One override of a topology key: a dotted path and a TOML value (see the module docs).
///
/// ```
/// use refit_runtime::topology::{Override, Topology};
///
/// let text = r#"
///     [run]
///     command = ["prog"]
///     [[model]]
///     id = "policy"
///     [[process]]
///     name = "learner"
///     roles = ["trainer", "controller"]
///     [[process]]
///     name = "actor"
///     roles = ["engine"]
/// "#;
/// let set = [
///     Override::parse("sync.sync_mode=fully-async")?,
///     Override::parse("process.actor.replicas=3")?,
/// ];
/// let topo = Topology::parse_with(text, &set)?;
/// assert_eq!(topo.world_size(), 4);
/// assert_eq!(topo.sync.sync_mode.to_string(), "fully-async");
/// # Ok::<(), refit_runtime::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Override {
    key: String,
    path: Vec<Segment>,
    text: String,
    value: toml::Value,
}

/// An error blaming the override's key.
fn refuse(key: &str, reason: impl Into<String>) -> Error {
    Error::Topology {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// Splits `key` into segments: `a.b`, `a[label].b`, `a."dotted.key"`.
fn split(key: &str) -> Result<Vec<Segment>> {
    let bad = |why: &str| refuse(key, format!("is not a key ({why})"));
    let mut out = Vec::new();
    let mut rest = key;
    loop {
        // one key: quoted or bare
        let (name, after) = if let Some(quoted) = rest.strip_prefix('"') {
            let end = quoted.find('"').ok_or_else(|| bad("an unclosed quote"))?;
            (&quoted[..end], &quoted[end + 1..])
        } else {
            let end = rest.find(['.', '[']).unwrap_or(rest.len());
            let name = &rest[..end];
            if name.is_empty() {
                return Err(bad("an empty segment"));
            }
            if !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Err(bad(&format!(
                    "`{name}` holds characters other than letters, digits, `_` and `-`; quote it"
                )));
            }
            (name, &rest[end..])
        };
        out.push(Segment::Key(name.to_string()));
        rest = after;
        // entries: [label][label]...
        while let Some(inner) = rest.strip_prefix('[') {
            let end = inner.find(']').ok_or_else(|| bad("an unclosed `[`"))?;
            let label = inner[..end].trim();
            if label.is_empty() {
                return Err(bad("an empty `[]`"));
            }
            out.push(Segment::Entry(label.to_string()));
            rest = &inner[end + 1..];
        }
        match rest.strip_prefix('.') {
            Some(next) => rest = next,
            None if rest.is_empty() => return Ok(out),
            None => return Err(bad(&format!("`{rest}` follows a segment"))),
        }
    }
}

/// `text` as a TOML value, or as a string when it is not one (a bare word).
fn value_of(key: &str, text: &str) -> Result<toml::Value> {
    let t = text.trim();
    match toml::Value::from_str(t) {
        Ok(v) => Ok(v),
        // what looks like TOML (a string, an array, an inline table) must be TOML
        Err(e) if t.starts_with(['"', '\'', '[', '{']) => Err(refuse(
            key,
            format!(
                "the value {t:?} is not a TOML value: {}",
                e.message().trim()
            ),
        )),
        Err(_) => Ok(toml::Value::String(t.to_string())),
    }
}

/// A key as errors write it (`.`-joined, entries in brackets, odd keys quoted).
fn written(segments: &[Segment]) -> String {
    let mut s = String::new();
    for seg in segments {
        match seg {
            Segment::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                if !k.is_empty()
                    && k.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                {
                    s.push_str(k);
                } else {
                    s.push('"');
                    s.push_str(k);
                    s.push('"');
                }
            }
            Segment::Entry(l) => {
                s.push('[');
                s.push_str(l);
                s.push(']');
            }
        }
    }
    s
}

fn type_name(v: &toml::Value) -> &'static str {
    v.type_str()
}

/// The position of the entry `label` names in an array of tables: by `name`/`id`, else
/// `#N` (1-based).
fn find_entry(array: &[toml::Value], label: &str) -> Option<usize> {
    let named = array.iter().position(|v| {
        v.as_table().is_some_and(|t| {
            ["name", "id"]
                .iter()
                .any(|k| t.get(*k).and_then(toml::Value::as_str) == Some(label))
        })
    });
    named.or_else(|| {
        let n: usize = label.strip_prefix('#')?.parse().ok()?;
        (1..=array.len()).contains(&n).then(|| n - 1)
    })
}

/// The labels of an array's entries, for an error.
fn labels(array: &[toml::Value]) -> String {
    let names: Vec<String> = array
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_table()
                .and_then(|t| t.get("name").or_else(|| t.get("id")))
                .and_then(toml::Value::as_str)
                .map_or_else(|| format!("#{}", i + 1), str::to_string)
        })
        .collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

impl Override {
    /// Parses `key=value` (split at the first `=`; spaces around either side are dropped).
    ///
    /// # Errors
    /// [`Error::Topology`] naming the key: no `=`, an empty or malformed key, a newline in
    /// the assignment, or a value that starts like TOML (`"`, `'`, `[`, `{`) and is not.
    pub fn parse(assignment: &str) -> Result<Self> {
        let Some((key, value)) = assignment.split_once('=') else {
            return Err(refuse(
                assignment.trim(),
                format!("{assignment:?} is not `key=value`"),
            ));
        };
        Self::new(key, value)
    }

    /// An override of `key` by `value` (see the module docs for both).
    ///
    /// # Errors
    /// As [`Override::parse`].
    pub fn new(key: &str, value: &str) -> Result<Self> {
        let key = key.trim();
        if key.contains(['\n', '\r']) || value.contains(['\n', '\r']) {
            return Err(refuse(key, "an override must fit on one line"));
        }
        let path = split(key)?;
        Ok(Self {
            key: key.to_string(),
            path,
            text: value.trim().to_string(),
            value: value_of(key, value)?,
        })
    }

    /// The key as written.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The value.
    pub fn value(&self) -> &toml::Value {
        &self.value
    }

    /// Sets the key in `doc` (a topology file's document); answers the key as errors name it
    /// (`process[actor].replicas`).
    ///
    /// # Errors
    /// [`Error::Topology`] naming the key: an entry no array holds (listing those there
    /// are), a path through a value that is not a table, an entry label on a table, or a
    /// whole entry replaced.
    pub fn apply(&self, doc: &mut toml::Table) -> Result<String> {
        let mut resolved = Vec::with_capacity(self.path.len());
        let mut table = doc;
        let mut i = 0;
        loop {
            let Segment::Key(k) = &self.path[i] else {
                return Err(self.refuse(format!(
                    "`{}` is a table, not an array of tables",
                    written(&resolved)
                )));
            };
            resolved.push(Segment::Key(k.clone()));
            if i + 1 == self.path.len() {
                table.insert(k.clone(), self.value.clone());
                return Ok(written(&resolved));
            }
            let next_is_entry = matches!(self.path[i + 1], Segment::Entry(_));
            if next_is_entry && !table.contains_key(k) {
                return Err(self.refuse(format!("the file has no `[[{}]]`", written(&resolved))));
            }
            let slot = table
                .entry(k.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            match (slot, next_is_entry) {
                (toml::Value::Table(t), false) => {
                    table = t;
                    i += 1;
                }
                (toml::Value::Array(items), _) => {
                    let (Segment::Key(label) | Segment::Entry(label)) = &self.path[i + 1];
                    let at = find_entry(items, label).ok_or_else(|| {
                        self.refuse(format!(
                            "no entry `{label}` in `{}` (entries: {})",
                            written(&resolved),
                            labels(items)
                        ))
                    })?;
                    resolved.push(Segment::Entry(label.clone()));
                    if i + 2 == self.path.len() {
                        return Err(self.refuse(format!(
                            "names the whole entry `{}`; set one of its keys",
                            written(&resolved)
                        )));
                    }
                    let toml::Value::Table(t) = &mut items[at] else {
                        return Err(self.refuse(format!("`{}` is not a table", written(&resolved))));
                    };
                    table = t;
                    i += 2;
                }
                (other, _) => {
                    let why = if next_is_entry {
                        "not an array of tables"
                    } else {
                        "not a table"
                    };
                    return Err(self.refuse(format!(
                        "`{}` is a {}, {why}",
                        written(&resolved),
                        type_name(other)
                    )));
                }
            }
        }
    }

    fn refuse(&self, reason: String) -> Error {
        refuse(&self.key, format!("override `{self}`: {reason}"))
    }

    /// Overrides as one text, one `key=value` per line (what `refit launch` hands every rank
    /// in `REFIT_SET`); [`Override::parse_lines`] reads it back.
    pub fn join_lines(overrides: &[Self]) -> String {
        overrides
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The overrides of a text of `key=value` lines (blank lines skipped), in order.
    ///
    /// # Errors
    /// As [`Override::parse`], for the first bad line.
    pub fn parse_lines(text: &str) -> Result<Vec<Self>> {
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(Self::parse)
            .collect()
    }
}

impl fmt::Display for Override {
    /// `key=value`, as [`Override::parse`] reads it back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.key, self.text)
    }
}

impl FromStr for Override {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

/// `doc` with every override applied, in order; answers each override's key as errors name
/// it, beside the override.
pub(crate) fn apply_all<'o>(
    doc: &mut toml::Table,
    overrides: &'o [Override],
) -> Result<Vec<(String, &'o Override)>> {
    overrides.iter().map(|o| Ok((o.apply(doc)?, o))).collect()
}

/// `err` with the override that set its key named, when one did.
pub(crate) fn blame(err: Error, applied: &[(String, &Override)]) -> Error {
    match err {
        Error::Topology { key, reason } => {
            let by = applied.iter().rev().find(|(k, _)| {
                key == *k
                    || key
                        .strip_prefix(k.as_str())
                        .is_some_and(|rest| rest.starts_with(['.', '[']))
            });
            let reason = match by {
                Some((_, o)) => format!("{reason} (set by the override `{o}`)"),
                None => reason,
            };
            Error::Topology { key, reason }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync_policy::SyncMode;
    use crate::topology::{Restart, Topology};

    const FILE: &str = r#"
[run]
command = ["prog"]
seed = 1
[sync]
sync_mode = "sync"
[[model]]
id = "policy"
[model.params]
lr = 0.01
"a.b" = 1
[[host]]
name = "n1.lab"
addr = "10.0.0.1"
[[process]]
name = "learner"
roles = ["trainer", "controller"]
[[process]]
name = "actor"
roles = ["engine", "rollout"]
"#;

    fn with(sets: &[&str]) -> Result<Topology> {
        let o: Vec<Override> = sets
            .iter()
            .map(|s| Override::parse(s))
            .collect::<Result<_>>()?;
        Topology::parse_with(FILE, &o)
    }

    /// The error of `sets`, asserting it names `key` and holds every one of `words`.
    fn refused(sets: &[&str], key: &str, words: &[&str]) -> String {
        let e = with(sets).expect_err("the override must be refused");
        let Error::Topology { key: k, .. } = &e else {
            panic!("not a topology error: {e}");
        };
        assert_eq!(k, key, "{e}");
        let msg = e.to_string();
        for w in words {
            assert!(msg.contains(w), "{w:?} not in: {msg}");
        }
        msg
    }

    #[test]
    fn values_parse_as_toml_and_bare_words_as_strings() {
        let v = |s: &str| Override::parse(s).unwrap().value().clone();
        assert_eq!(v("a=3"), toml::Value::Integer(3));
        assert_eq!(v("a = 0.001"), toml::Value::Float(0.001));
        assert_eq!(v("a=true"), toml::Value::Boolean(true));
        assert_eq!(
            v("a=fully-async"),
            toml::Value::String("fully-async".into())
        );
        assert_eq!(v("a=\"3\""), toml::Value::String("3".into()));
        assert_eq!(v("a=x=y"), toml::Value::String("x=y".into()));
        assert_eq!(v("a="), toml::Value::String(String::new()));
        assert_eq!(
            v("a=[\"sh\", \"-c\"]"),
            toml::Value::Array(vec!["sh".into(), "-c".into()])
        );
        assert_eq!(v("a={ K = \"v\" }")["K"].as_str(), Some("v"));
        // what starts like TOML must be TOML
        for bad in ["a=[1, 2", "a=\"open", "a={ k = }"] {
            let e = Override::parse(bad).unwrap_err().to_string();
            assert!(e.contains("`a`") && e.contains("not a TOML value"), "{e}");
        }
    }

    #[test]
    fn overrides_write_back_as_they_read() {
        let list: Vec<Override> = [
            "sync.sync_mode=fully-async",
            "run.command=[\"sh\", \"-c\", \"echo a=b\"]",
            "model.policy.params.\"a.b\"=2",
            "process[actor].env={ K = \"v w\" }",
            "stop.max_time_s = 30",
        ]
        .iter()
        .map(|s| Override::parse(s).unwrap())
        .collect();
        let text = Override::join_lines(&list);
        assert_eq!(text.lines().count(), 5);
        assert_eq!(
            Override::parse_lines(&format!("\n{text}\n\n")).unwrap(),
            list
        );
        assert_eq!(list[4].to_string(), "stop.max_time_s=30");
        assert_eq!(list[0].key(), "sync.sync_mode");
    }

    #[test]
    fn every_kind_of_path_reaches_its_key() {
        let t = with(&[
            "sync.sync_mode=fully-async",
            "stop.max_time_s=30",
            "run.seed=3",
            "process.actor.replicas=3",
            "model.policy.params.lr=0.001",
            "model[policy].params.\"a.b\"=2",
            "host[n1.lab].addr=10.0.0.9",
            "process[#1].env.X=\"1\"",
            "sync.timeouts.load_s=5",
        ])
        .unwrap();
        assert_eq!(t.sync.sync_mode, SyncMode::FullyAsync);
        assert_eq!(t.stop().max_time_s, Some(30.0));
        assert_eq!(t.run.seed, 3);
        assert_eq!(t.world_size(), 4);
        let params = &t.models[0].params;
        assert_eq!(params["lr"].as_float(), Some(0.001));
        assert_eq!(params["a.b"].as_integer(), Some(2));
        assert_eq!(t.master_host().unwrap(), "10.0.0.9");
        // a bare integer as an environment value is a TOML integer: refused by the schema
        let e = with(&["process.actor.env.N=1"]).unwrap_err().to_string();
        assert!(
            e.contains("process[actor]") && e.contains("override"),
            "{e}"
        );
        // a later override wins over an earlier one
        let t = with(&[
            "process.actor.restart=on-failure",
            "process.actor.max_restarts=2",
            "process.actor.max_restarts=5",
            "process.actor.env.N=\"1\"",
        ])
        .unwrap();
        let r = t.rank(1).unwrap();
        assert_eq!((r.restart, r.max_restarts), (Restart::OnFailure, 5));
        assert_eq!(r.env["N"], "1");
        // the timeouts table the file left out is created, keeping its other defaults
        assert_eq!(
            t.sync.timeouts.load_s,
            crate::sync_policy::SyncConfig::default().timeouts.load_s
        );
    }

    #[test]
    fn bad_paths_are_named() {
        refused(
            &["process.actro.replicas=3"],
            "process.actro.replicas",
            &["no entry `actro`", "learner, actor"],
        );
        refused(
            &["run.seed.x=1"],
            "run.seed.x",
            &["`run.seed` is a integer", "not a table"],
        );
        refused(
            &["run[x].seed=1"],
            "run[x].seed",
            &["`run` is a table, not an array"],
        );
        refused(
            &["process.actor=1"],
            "process.actor",
            &["whole entry `process[actor]`"],
        );
        refused(&["job[x].a=1"], "job[x].a", &["no `[[job]]`"]);
        for (bad, why) in [
            ("a..b=1", "empty segment"),
            ("a.b c=1", "quote it"),
            ("a.\"b=1", "unclosed quote"),
            ("a[x=1", "unclosed `[`"),
            ("a[]=1", "empty `[]`"),
            ("a[x]b=1", "follows a segment"),
            ("=1", "empty segment"),
        ] {
            let e = Override::parse(bad).unwrap_err().to_string();
            assert!(e.contains("is not a key") && e.contains(why), "{bad}: {e}");
        }
        let e = Override::parse("novalue").unwrap_err().to_string();
        assert!(
            e.contains("`novalue`") && e.contains("not `key=value`"),
            "{e}"
        );
        let e = Override::new("a", "1\nb = 2").unwrap_err().to_string();
        assert!(e.contains("one line"), "{e}");
    }

    #[test]
    fn bad_values_are_named_with_the_override_that_set_them() {
        refused(
            &["sync.sync_mode=eventually"],
            "sync.sync_mode",
            &["eventually", "override `sync.sync_mode=eventually`"],
        );
        refused(
            &["process.actor.replicas=0"],
            "process[actor].replicas",
            &["replicas = 0", "override `process.actor.replicas=0`"],
        );
        refused(
            &["process.actor.replicas=many"],
            "process[actor].replicas",
            &["many", "override"],
        );
        refused(
            &["stop.max_time_s=-1"],
            "stop.max_time_s",
            &["positive", "override"],
        );
        refused(
            &["run.sead=3"],
            "run.sead",
            &["unknown field `sead`", "override"],
        );
        // an error the overrides did not cause does not blame them
        let e = Topology::parse_with(
            &FILE.replace("seed = 1", "seed = 1\nwait_s = 0.0"),
            &[Override::parse("run.seed=2").unwrap()],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("run.wait_s") && !e.contains("override"), "{e}");
        // a file that is not TOML is named by its line, as without overrides
        let e = Topology::parse_with("[run\n", &[Override::parse("run.seed=2").unwrap()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1"), "{e}");
    }
}
