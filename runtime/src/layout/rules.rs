//! Declarative layout rules: what each trainer tensor becomes in the engine's layout.

use std::fmt;

use super::pattern::Pattern;
use crate::error::{Error, Result};

/// One rule; see [`LayoutRules`] for how rules are written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Rule {
    /// Same bytes, new name.
    Rename { from: Pattern, to: Pattern },
    /// A 2-D tensor `[r, c]` becomes `[c, r]` under a new name.
    Transpose { from: Pattern, to: Pattern },
    /// Several tensors concatenated along `axis` into one.
    Fuse {
        from: Vec<Pattern>,
        to: Pattern,
        axis: usize,
    },
    /// One tensor cut along `axis` into several (equal parts when `sizes` is `None`).
    Split {
        from: Pattern,
        to: Vec<Pattern>,
        axis: usize,
        sizes: Option<Vec<usize>>,
    },
    /// Same bytes, same name.
    Keep { pattern: Pattern },
}

impl Rule {
    /// The patterns that claim source tensors.
    pub(crate) fn sources(&self) -> Vec<&Pattern> {
        match self {
            Self::Rename { from, .. } | Self::Transpose { from, .. } | Self::Split { from, .. } => {
                vec![from]
            }
            Self::Fuse { from, .. } => from.iter().collect(),
            Self::Keep { pattern } => vec![pattern],
        }
    }

    /// The error to report against this rule.
    pub(crate) fn error(&self, reason: impl Into<String>) -> Error {
        Error::Layout {
            culprit: format!("rule `{self}`"),
            reason: reason.into(),
        }
    }

    /// Checks that every target placeholder is captured by every source pattern.
    pub(crate) fn check_placeholders(&self) -> Result<()> {
        let targets: Vec<&Pattern> = match self {
            Self::Rename { to, .. } | Self::Transpose { to, .. } | Self::Fuse { to, .. } => {
                vec![to]
            }
            Self::Split { to, .. } => to.iter().collect(),
            Self::Keep { .. } => Vec::new(),
        };
        let sources = self.sources();
        let first = sources
            .first()
            .map(|p| p.placeholders())
            .unwrap_or_default();
        for s in &sources {
            if s.placeholders() != first {
                return Err(self.error(format!(
                    "source patterns `{}` and `{s}` capture different placeholders",
                    sources[0]
                )));
            }
        }
        for t in targets {
            if let Some(missing) = t.placeholders().into_iter().find(|p| !first.contains(p)) {
                return Err(self.error(format!(
                    "target `{t}` uses `{{{missing}}}`, which no source captures"
                )));
            }
        }
        Ok(())
    }
}

fn list(ps: &[Pattern]) -> String {
    ps.iter()
        .map(Pattern::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Rename { from, to } => write!(f, "rename {from} -> {to}"),
            Self::Transpose { from, to } => write!(f, "transpose {from} -> {to}"),
            Self::Fuse { from, to, axis } => {
                write!(f, "fuse [{}] -> {to} on axis {axis}", list(from))
            }
            Self::Split { from, to, axis, .. } => {
                write!(f, "split {from} -> [{}] on axis {axis}", list(to))
            }
            Self::Keep { pattern } => write!(f, "keep {pattern}"),
        }
    }
}

/// The rules that map a trainer's tensor names and shapes to an engine's.
///
/// A pattern is literal text with `{name}` placeholders. A placeholder matches one non-empty
/// segment of ASCII letters, digits and `_` (never a `.`); a name used twice in one pattern
/// must capture the same text both times; matching is of the whole name, with backtracking
/// (`{a}_proj` matches `q_proj` with `a = "q"`). A target may use any placeholder its
/// sources capture. Rules are checked when a [`LayoutPlan`](super::LayoutPlan) is made, never
/// silently skipped: a pattern that does not parse, a rule that matches no tensor, a tensor
/// matched by two rules and a tensor matched by none (unless [`LayoutRules::keep_unmatched`])
/// are all errors.
///
/// ```
/// # use refit_runtime::LayoutRules;
/// let rules = LayoutRules::new()
///     .rename("embed.weight", "model.embed_tokens.weight")
///     .fuse(
///         [
///             "layers.{i}.attn.q_proj.weight",
///             "layers.{i}.attn.k_proj.weight",
///             "layers.{i}.attn.v_proj.weight",
///         ],
///         "model.layers.{i}.self_attn.qkv_proj.weight",
///         0,
///     )
///     .keep("lm_head.weight");
/// # let _ = rules;
/// ```
#[derive(Debug, Default)]
pub struct LayoutRules {
    pub(crate) rules: Vec<Rule>,
    pub(crate) keep_unmatched: bool,
    pub(crate) error: Option<Error>,
}

impl LayoutRules {
    /// No rules yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn parse(&mut self, text: &str) -> Option<Pattern> {
        if self.error.is_some() {
            return None;
        }
        match Pattern::parse(text) {
            Ok(p) => Some(p),
            Err(e) => {
                self.error = Some(e);
                None
            }
        }
    }

    fn parse_all<'a>(&mut self, texts: impl IntoIterator<Item = &'a str>) -> Option<Vec<Pattern>> {
        texts.into_iter().map(|t| self.parse(t)).collect()
    }

    fn push(mut self, rule: Option<Rule>) -> Self {
        if let Some(r) = rule {
            self.rules.push(r);
        }
        self
    }

    /// Every tensor matching `from` is renamed to `to` (bytes, dtype and shape unchanged).
    pub fn rename(mut self, from: &str, to: &str) -> Self {
        let rule = self
            .parse(from)
            .zip(self.parse(to))
            .map(|(from, to)| Rule::Rename { from, to });
        self.push(rule)
    }

    /// Every 2-D tensor `[r, c]` matching `from` becomes `[c, r]`, named `to`.
    pub fn transpose(mut self, from: &str, to: &str) -> Self {
        let rule = self
            .parse(from)
            .zip(self.parse(to))
            .map(|(from, to)| Rule::Transpose { from, to });
        self.push(rule)
    }

    /// For every capture of the first source pattern, the tensors named by all `from`
    /// patterns (same dtype, same shape except along `axis`) are concatenated along `axis`
    /// in the order given, into one tensor named `to`.
    pub fn fuse<'a>(
        mut self,
        from: impl IntoIterator<Item = &'a str>,
        to: &str,
        axis: usize,
    ) -> Self {
        let rule = self
            .parse_all(from)
            .zip(self.parse(to))
            .map(|(from, to)| Rule::Fuse { from, to, axis });
        self.push(rule)
    }

    /// Every tensor matching `from` is cut along `axis` into `to.len()` equal parts, named by
    /// `to` in order.
    pub fn split<'a>(
        mut self,
        from: &str,
        to: impl IntoIterator<Item = &'a str>,
        axis: usize,
    ) -> Self {
        let rule = self
            .parse(from)
            .zip(self.parse_all(to))
            .map(|(from, to)| Rule::Split {
                from,
                to,
                axis,
                sizes: None,
            });
        self.push(rule)
    }

    /// As [`LayoutRules::split`], with the size of each part along `axis` given.
    pub fn split_sizes<'a>(
        mut self,
        from: &str,
        to: impl IntoIterator<Item = (&'a str, usize)>,
        axis: usize,
    ) -> Self {
        let (names, sizes): (Vec<&str>, Vec<usize>) = to.into_iter().unzip();
        let rule = self
            .parse(from)
            .zip(self.parse_all(names))
            .map(|(from, to)| Rule::Split {
                from,
                to,
                axis,
                sizes: Some(sizes),
            });
        self.push(rule)
    }

    /// Tensors matching `pattern` pass through unchanged (it must match at least one).
    pub fn keep(mut self, pattern: &str) -> Self {
        let rule = self.parse(pattern).map(|pattern| Rule::Keep { pattern });
        self.push(rule)
    }

    /// Every tensor no rule matches passes through unchanged, instead of being an error.
    pub fn keep_unmatched(mut self) -> Self {
        self.keep_unmatched = true;
        self
    }
}
