//! Tensor-name patterns with captures: `layers.{i}.attn.q_proj.weight`.
//!
//! A pattern is literal text with `{name}` placeholders. A placeholder matches one non-empty
//! segment of ASCII letters, digits and `_` (never a `.`), so `{i}` in `layers.{i}.mlp`
//! matches `0`, `17` or `first`, but not `0.1`. A name used twice in one pattern must capture
//! the same text both times. Matching is exact (the whole name), with backtracking, so
//! `{a}_proj` matches `q_proj` with `a = "q"`.

use std::collections::BTreeMap;
use std::fmt;

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Lit(String),
    Cap(String),
}

/// A parsed name pattern: literal text with `{name}` placeholders.
///
/// A placeholder matches one non-empty segment of ASCII letters, digits and `_` (never a
/// `.`); a name used twice must capture the same text both times; matching is of the whole
/// name, with backtracking (`{a}_proj` matches `q_proj` with `a = "q"`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Pattern {
    text: String,
    parts: Vec<Part>,
}

/// What a pattern's placeholders captured, by placeholder name.
pub(crate) type Captures = BTreeMap<String, String>;

fn is_segment_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

impl Pattern {
    /// Parses a pattern.
    ///
    /// # Errors
    /// [`Error::Layout`] naming the pattern when it is empty, has an unclosed or empty
    /// `{}`, a placeholder name that is not letters/digits/`_`, or two placeholders side by
    /// side (`{a}{b}`, which cannot be split).
    pub(crate) fn parse(text: &str) -> Result<Self> {
        let bad = |reason: &str| Error::Layout {
            culprit: format!("pattern `{text}`"),
            reason: reason.into(),
        };
        if text.is_empty() {
            return Err(bad("empty pattern"));
        }
        let mut parts = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            if let Some(after) = rest.strip_prefix('{') {
                let close = after.find('}').ok_or_else(|| bad("unclosed `{`"))?;
                let name = &after[..close];
                if name.is_empty() || !name.chars().all(is_segment_char) {
                    return Err(bad("placeholder names are letters, digits and `_`"));
                }
                if matches!(parts.last(), Some(Part::Cap(_))) {
                    return Err(bad("two placeholders side by side"));
                }
                parts.push(Part::Cap(name.to_string()));
                rest = &after[close + 1..];
            } else {
                let end = rest.find(['{', '}']).unwrap_or(rest.len());
                if rest[end..].starts_with('}') {
                    return Err(bad("`}` without `{`"));
                }
                parts.push(Part::Lit(rest[..end].to_string()));
                rest = &rest[end..];
            }
        }
        Ok(Self {
            text: text.to_string(),
            parts,
        })
    }

    /// The pattern as written.
    pub(crate) fn as_str(&self) -> &str {
        &self.text
    }

    /// The placeholder names, sorted, without repeats.
    pub(crate) fn placeholders(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .parts
            .iter()
            .filter_map(|p| match p {
                Part::Cap(n) => Some(n.as_str()),
                Part::Lit(_) => None,
            })
            .collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    /// Matches a whole name; returns the captures when it matches.
    pub(crate) fn matches(&self, name: &str) -> Option<Captures> {
        let mut caps = Captures::new();
        match_parts(&self.parts, name, &mut caps).then_some(caps)
    }

    /// Writes the pattern with its placeholders replaced by `caps`.
    ///
    /// # Errors
    /// [`Error::Layout`] naming the pattern and the placeholder that `caps` lacks.
    pub(crate) fn fill(&self, caps: &Captures) -> Result<String> {
        let mut out = String::with_capacity(self.text.len());
        for p in &self.parts {
            match p {
                Part::Lit(s) => out.push_str(s),
                Part::Cap(n) => out.push_str(caps.get(n).ok_or_else(|| Error::Layout {
                    culprit: format!("pattern `{}`", self.text),
                    reason: format!("placeholder `{{{n}}}` is not captured by the source"),
                })?),
            }
        }
        Ok(out)
    }
}

fn match_parts(parts: &[Part], name: &str, caps: &mut Captures) -> bool {
    let Some((first, rest)) = parts.split_first() else {
        return name.is_empty();
    };
    match first {
        Part::Lit(s) => name
            .strip_prefix(s.as_str())
            .is_some_and(|tail| match_parts(rest, tail, caps)),
        Part::Cap(n) => {
            let run = name
                .char_indices()
                .find(|&(_, c)| !is_segment_char(c))
                .map_or(name.len(), |(i, _)| i);
            // Longest first, then shorter: `{a}_proj` must give back `_proj`.
            for end in (1..=run).rev() {
                let (seg, tail) = name.split_at(end);
                let prior = caps.get(n).cloned();
                if prior.as_deref().is_some_and(|p| p != seg) {
                    continue;
                }
                caps.insert(n.clone(), seg.to_string());
                if match_parts(rest, tail, caps) {
                    return true;
                }
                match prior {
                    Some(p) => caps.insert(n.clone(), p),
                    None => caps.remove(n),
                };
            }
            false
        }
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captures_segments_and_refuses_dots() {
        let p = Pattern::parse("layers.{i}.attn.{w}_proj.weight").unwrap();
        let c = p.matches("layers.12.attn.q_proj.weight").unwrap();
        assert_eq!(c["i"], "12");
        assert_eq!(c["w"], "q");
        assert!(p.matches("layers.1.2.attn.q_proj.weight").is_none());
        assert!(p.matches("layers..attn.q_proj.weight").is_none());
        assert!(p.matches("layers.1.attn.q_proj.weight.extra").is_none());
        let out = Pattern::parse("model.layers.{i}.self_attn.{w}.w").unwrap();
        assert_eq!(out.fill(&c).unwrap(), "model.layers.12.self_attn.q.w");
        assert_eq!(p.placeholders(), ["i", "w"]);
    }

    #[test]
    fn repeated_placeholder_must_agree_and_literals_are_exact() {
        let p = Pattern::parse("{a}.to.{a}").unwrap();
        assert!(p.matches("x.to.x").is_some());
        assert!(p.matches("x.to.y").is_none());
        let lit = Pattern::parse("embed.weight").unwrap();
        assert_eq!(lit.matches("embed.weight"), Some(Captures::new()));
        assert!(lit.matches("embed.weights").is_none());
    }

    #[test]
    fn bad_patterns_are_refused_with_their_text() {
        for bad in ["", "a.{i", "a.{}", "a.{i.j}", "{a}{b}", "a}"] {
            let e = Pattern::parse(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("pattern `{bad}`")), "{e}");
        }
        let p = Pattern::parse("x.{j}").unwrap();
        let e = p.fill(&Captures::new()).unwrap_err().to_string();
        assert!(e.contains("`{j}`"), "{e}");
    }
}
