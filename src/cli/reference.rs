//! `refit __cli-reference`: the book's command-line reference page
//! (`book/src/reference/cli.md`), written from the commands' own definitions, so it says
//! what `--help` says; `tests/reference_pages.rs` fails when the page differs.

use clap::{Arg, Command};

/// What the page says before the commands.
const PREFACE: &str = "\
# Command-line reference

`refit` is the command-line tool of this repository (feature `cli`, on by default):
`cargo build --release --bin refit` puts it at `target/release/refit`. Every command
answers `--help` with what this page says about it.

This page is written by the tool from its own definitions (`cargo run --bin refit --
__cli-reference > book/src/reference/cli.md`), and a test fails when the two differ. The
environment variables in the last column give a flag's value when the flag is left out;
the [environment variables](environment.md) page lists every variable Refit reads.
";

/// The reference page, in Markdown.
pub(crate) fn page(mut cli: Command) -> String {
    cli.build();
    let mut out = String::from(PREFACE);
    command(&mut out, &cli, &[]);
    for sub in cli.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() != "help" {
            command(&mut out, sub, &[cli.get_name()]);
        }
    }
    out
}

/// One command's section: its description, usage and arguments.
fn command(out: &mut String, cmd: &Command, parents: &[&str]) {
    let mut path: Vec<&str> = parents.to_vec();
    path.push(cmd.get_name());
    let name = path.join(" ");
    out.push_str(&format!("\n## `{name}`\n\n"));
    if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
        out.push_str(&format!("{}\n\n", prose(&about.to_string())));
    }
    let usage = cmd.clone().bin_name(&name).render_usage().to_string();
    out.push_str(&format!("```text\n{}\n```\n", usage.trim_end()));
    let args: Vec<&Arg> = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set() && !matches!(a.get_id().as_str(), "help" | "version"))
        .collect();
    if !args.is_empty() {
        out.push_str(
            "\n| argument | default | environment | what it does |\n| --- | --- | --- | --- |\n",
        );
        for a in args {
            // a switch's `false` says nothing
            let switch = !a.get_action().takes_values();
            let default: Vec<String> = a
                .get_default_values()
                .iter()
                .filter(|_| !switch)
                .map(|v| v.to_string_lossy().into_owned())
                .collect();
            let help = a
                .get_long_help()
                .or(a.get_help())
                .map(|h| prose(&h.to_string()))
                .unwrap_or_default();
            let choices: Vec<String> = a
                .get_possible_values()
                .iter()
                .filter(|p| !p.is_hide_set())
                .map(|p| format!("`{}`", p.get_name()))
                .collect();
            let help = if choices.is_empty() {
                help
            } else {
                format!("{help} One of {}.", choices.join(", "))
            };
            // a flag renamed keeps its old name as a visible alias: the page says so
            let aliases: Vec<String> = a
                .get_visible_aliases()
                .unwrap_or_default()
                .iter()
                .map(|n| format!("`--{n}`"))
                .collect();
            let help = if aliases.is_empty() {
                help
            } else {
                format!("{help} Also spelled {}.", aliases.join(", "))
            };
            out.push_str(&format!(
                "| `{}` | {} | {} | {} |\n",
                spelling(a),
                if default.is_empty() {
                    String::new()
                } else {
                    format!("`{}`", default.join(","))
                },
                a.get_env()
                    .map(|e| format!("`{}`", e.to_string_lossy()))
                    .unwrap_or_default(),
                cell(&help),
            ));
        }
    }
    if let Some(after) = cmd.get_after_long_help().or(cmd.get_after_help()) {
        out.push_str(&format!(
            "\n```text\n{}\n```\n",
            after.to_string().trim_end()
        ));
    }
}

/// How an argument is written: `<FILE>`, `--bind <BIND>`, `--watch`, `--set <KEY=VALUE>...`.
fn spelling(a: &Arg) -> String {
    let values: Vec<String> = a
        .get_value_names()
        .map(|names| names.iter().map(|n| format!("<{n}>")).collect())
        .unwrap_or_else(|| vec![format!("<{}>", a.get_id().as_str().to_uppercase())]);
    let takes_value = a.get_action().takes_values();
    let many = matches!(a.get_action(), clap::ArgAction::Append);
    let mut s = match (a.get_long(), a.get_short()) {
        (Some(long), Some(short)) => format!("-{short}, --{long}"),
        (Some(long), None) => format!("--{long}"),
        (None, Some(short)) => format!("-{short}"),
        (None, None) => return values.join(" "),
    };
    if takes_value {
        s.push(' ');
        s.push_str(&values.join(" "));
    }
    if many {
        s.push_str("...");
    }
    s
}

/// A help text as a sentence: as written, with a full stop at the end.
fn prose(text: &str) -> String {
    let t = text.trim();
    if t.ends_with('.') {
        t.to_owned()
    } else {
        format!("{t}.")
    }
}

/// `text` made safe inside a Markdown table cell.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}
