//! The book's reference pages say what the code does: the command-line page is what the
//! `refit` tool prints for it, the environment page lists every `REFIT_*` variable the
//! code reads, the topology page every key the parser accepts. And what users read holds
//! no development history.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_command_line_page_is_what_the_tool_says() {
    let out = Command::new(env!("CARGO_BIN_EXE_refit"))
        .arg("__cli-reference")
        .env_remove("REFIT_TOKEN_FILE")
        .env_remove("REFIT_METRICS_ADDR")
        .output()
        .unwrap();
    assert!(out.status.success());
    let generated = String::from_utf8(out.stdout).unwrap();
    let page = read(&root().join("book/src/reference/cli.md"));
    if generated != page {
        let line = generated
            .lines()
            .zip(page.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| generated.lines().count().min(page.lines().count()));
        panic!(
            "book/src/reference/cli.md differs from the tool's definitions from line {}:\n  \
             page: {:?}\n  tool: {:?}\nregenerate it: cargo run --bin refit -- __cli-reference \
             > book/src/reference/cli.md",
            line + 1,
            page.lines().nth(line).unwrap_or("(end)"),
            generated.lines().nth(line).unwrap_or("(end)"),
        );
    }
}

/// Every file under `dir` whose name ends with one of `exts`, skipping build outputs.
fn files(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "target" | "tests" | "__pycache__")
                && !name.starts_with('.')
            {
                files(&path, exts, out);
            }
        } else if exts.iter().any(|x| name.ends_with(x)) {
            out.push(path);
        }
    }
}

/// The `REFIT_*` names in `text`.
fn refit_vars(text: &str) -> BTreeSet<String> {
    let mut vars = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("REFIT_") {
        let name: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        let name = name.trim_end_matches('_').to_owned();
        rest = &rest[i + name.len().max(6)..];
        if name.len() > "REFIT_".len() {
            vars.insert(name);
        }
    }
    vars
}

#[test]
fn the_environment_page_lists_every_variable_the_code_reads() {
    // what programs read: the crates' sources, the tool, the examples, the Python package
    // and the scripts (not the test suites, whose variables are their own)
    let mut sources = Vec::new();
    for dir in [
        "src",
        "runtime/src",
        "node/src",
        "transports/src",
        "rl/src",
        "actors/src",
        "bench/src",
        "python/src",
        "python/refit",
        "python/examples",
        "examples",
        "scripts",
    ] {
        files(&root().join(dir), &[".rs", ".py", ".sh"], &mut sources);
    }
    assert!(sources.len() > 50, "{} source files", sources.len());
    let page = read(&root().join("book/src/reference/environment.md"));
    let mut missing = Vec::new();
    for file in &sources {
        for var in refit_vars(&read(file)) {
            if !page.contains(&format!("`{var}`")) {
                missing.push(format!("{var} (read in {})", file.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "book/src/reference/environment.md does not list: {missing:#?}"
    );
}

/// The smallest file the parser accepts, with `extra` added at the end and `first` at the top.
fn topology(first: &str, extra: &str) -> String {
    format!(
        "{first}\n[run]\ncommand = [\"prog\"]\n[[model]]\nid = \"policy\"\n[[process]]\n\
         name = \"learner\"\nroles = [\"trainer\", \"controller\", \"engine\"]\n{extra}\n"
    )
}

/// The keys the parser names when it refuses `zz_unknown` in a table of `text`.
fn accepted_keys(text: &str) -> Vec<String> {
    let err = refit::runtime::topology::Topology::parse(text)
        .map(|_| ())
        .expect_err("an unknown key must be refused")
        .to_string();
    assert!(err.contains("zz_unknown"), "{err}");
    let expected = err
        .split_once("expected")
        .unwrap_or_else(|| panic!("no list of keys in {err:?}"))
        .1;
    let expected = expected.split(" (line").next().unwrap();
    expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_topology_page_lists_every_key_the_parser_accepts() {
    let base_model = "[[model]]\nid = \"m2\"\n";
    let cases: [(&str, String); 12] = [
        ("", topology("zz_unknown = 1", "")),
        (
            "run.",
            topology("", "").replace("[run]\n", "[run]\nzz_unknown = 1\n"),
        ),
        ("sync.", topology("", "[sync]\nzz_unknown = 1")),
        (
            "sync.timeouts.",
            topology("", "[sync.timeouts]\nzz_unknown = 1"),
        ),
        ("stop.", topology("", "[stop]\nzz_unknown = 1")),
        ("links.", topology("", "[links]\nzz_unknown = 1")),
        (
            "host.",
            topology(
                "",
                "[[host]]\nname = \"local\"\naddr = \"127.0.0.1\"\nzz_unknown = 1",
            ),
        ),
        (
            "process.",
            topology(
                "",
                "[[process]]\nname = \"x\"\nroles = [\"engine\"]\nzz_unknown = 1",
            ),
        ),
        (
            "model.",
            topology("", &format!("{base_model}zz_unknown = 1")),
        ),
        (
            "model.convert.",
            topology("", &format!("{base_model}[model.convert]\nzz_unknown = 1")),
        ),
        (
            "model.convert.layout.",
            topology(
                "",
                &format!("{base_model}[model.convert]\nlayout = [{{ zz_unknown = 1 }}]"),
            ),
        ),
        (
            "model.convert.cast.",
            topology(
                "",
                &format!(
                    "{base_model}[model.convert]\ncast = [{{ to = \"bf16\", zz_unknown = 1 }}]"
                ),
            ),
        ),
    ];
    let page = read(&root().join("book/src/reference/topology.md"));
    let mut missing = Vec::new();
    for (prefix, text) in cases {
        let keys = accepted_keys(&text);
        assert!(!keys.is_empty(), "{prefix}: no keys named");
        for key in keys {
            let written = format!("`{prefix}{key}`");
            if !page.contains(&written) {
                missing.push(written);
            }
        }
    }
    assert!(
        missing.is_empty(),
        "book/src/reference/topology.md does not describe: {missing:?}"
    );
}

#[test]
fn the_book_and_readme_hold_no_development_history() {
    let mut pages = vec![root().join("README.md")];
    files(&root().join("book/src"), &[".md"], &mut pages);
    let mut found = Vec::new();
    for page in &pages {
        for (n, line) in read(page).lines().enumerate() {
            let lower = line.to_lowercase();
            let phrases = ["/work/", "worktree", "this session", "first session", "wt-"];
            if phrases.iter().any(|p| lower.contains(p)) {
                found.push(format!("{}:{}: {line}", page.display(), n + 1));
            }
        }
    }
    assert!(found.is_empty(), "history in what users read: {found:#?}");
}

#[test]
fn the_python_package_carries_the_same_licence_files() {
    for name in ["LICENSE-MIT", "LICENSE-APACHE"] {
        let top = read(&root().join(name));
        assert_eq!(
            read(&root().join("python").join(name)),
            top,
            "python/{name}"
        );
    }
    let cargo = read(&root().join("Cargo.toml"));
    assert!(cargo.contains("license = \"MIT OR Apache-2.0\""));
}

/// The first fenced block of `page`'s text.
fn first_block(page: &str) -> String {
    let mut lines = page.lines().skip_while(|l| !l.starts_with("```"));
    lines.next();
    lines
        .take_while(|l| !l.starts_with("```"))
        .map(|l| format!("{l}\n"))
        .collect()
}

#[test]
fn the_readme_and_the_introduction_start_with_the_main_job_and_the_tests() {
    let expected = "cargo build --release --example cartpole --bin refit && target/release/refit \
                    launch examples/topologies/cartpole-processes.toml\ncargo test --workspace\n";
    for page in ["README.md", "book/src/introduction.md"] {
        assert_eq!(first_block(&read(&root().join(page))), expected, "{page}");
    }
    assert!(
        root()
            .join("examples/topologies/cartpole-processes.toml")
            .is_file()
    );
    let cargo = read(&root().join("Cargo.toml"));
    assert!(cargo.contains("name = \"cartpole\"") && cargo.contains("name = \"refit\""));
}

/// The name in the first `marker` of `line` that is followed by one (`ANCHOR: name`), as
/// mdBook reads `ANCHOR:\s*([\w_-]+)`.
fn anchor_name<'a>(line: &'a str, marker: &str) -> Option<&'a str> {
    line.match_indices(marker).find_map(|(i, _)| {
        let rest = line[i + marker.len()..].trim_start();
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '-'))
            .unwrap_or(rest.len());
        (end > 0).then(|| &rest[..end])
    })
}

/// What mdBook's `{{#include file}}` puts in a page for `text`, the file's contents: every
/// line; with an anchor (`{{#include file:name}}`), the lines between the line holding
/// `ANCHOR: name` and the one holding `ANCHOR_END: name`, other anchor lines left out. No
/// line is dedented. `None` when the anchor is not in the file.
fn included<'a>(text: &'a str, anchor: Option<&str>) -> Option<Vec<&'a str>> {
    let Some(anchor) = anchor else {
        return Some(text.lines().collect());
    };
    let mut lines = text.lines();
    lines.find(|l| anchor_name(l, "ANCHOR:") == Some(anchor))?;
    let mut kept = Vec::new();
    for line in lines {
        match anchor_name(line, "ANCHOR_END:") {
            Some(name) if name == anchor => return Some(kept),
            Some(_) => {}
            None if anchor_name(line, "ANCHOR:").is_some() => {}
            None => kept.push(line),
        }
    }
    Some(kept)
}

const INCLUDE: &str = "<!-- include: ";
const INCLUDE_END: &str = "<!-- /include -->";

/// `page` (its text `text`, in `dir`) with the code of every include marker pasted again
/// from its file, and the problems that pasting cannot mend.
///
/// A marker is the fenced block of the code mdBook's `{{#include path:anchor}}` would show,
/// between two HTML comments that neither mdBook nor GitHub shows, all at the indentation
/// of the first:
///
/// ````text
/// <!-- include: ../../examples/quick_start.rs:all -->
/// ```rust,ignore
/// (the lines of the file between `ANCHOR: all` and `ANCHOR_END: all`)
/// ```
/// <!-- /include -->
/// ````
///
/// The path is relative to the page, as mdBook's is; without `:anchor`, the whole file.
/// The opening fence (its language and attributes) is the page's own; every line of code is
/// indented as the marker is, so that a block inside a list item shows the file's lines as
/// they are.
fn with_includes(page: &str, text: &str, dir: &Path) -> (String, Vec<String>) {
    let mut out = String::new();
    let mut problems = Vec::new();
    let mut lines = text.lines().enumerate();
    while let Some((n, line)) = lines.next() {
        out.push_str(line);
        out.push('\n');
        if line.contains("{{#include") {
            problems.push(format!(
                "{page}:{}: `{{{{#include}}}}` shows as that line on GitHub: write the include \
                 marker instead (see CONTRIBUTING.md)",
                n + 1
            ));
            continue;
        }
        let indent = &line[..line.len() - line.trim_start().len()];
        let Some(target) = line
            .trim_start()
            .strip_prefix(INCLUDE)
            .and_then(|t| t.strip_suffix(" -->"))
        else {
            continue;
        };
        let here = format!("{page}:{} ({target})", n + 1);
        let (file, anchor) = match target.split_once(':') {
            Some((file, anchor)) => (file, Some(anchor)),
            None => (target, None),
        };
        let Some((_, fence)) = lines.next() else {
            problems.push(format!("{here}: no fenced block after the marker"));
            break;
        };
        let ticks = fence.trim_start().len() - fence.trim_start().trim_start_matches('`').len();
        if !fence.starts_with(indent) || ticks < 3 {
            problems.push(format!(
                "{here}: the marker's next line should open a fenced block"
            ));
            continue;
        }
        out.push_str(fence);
        out.push('\n');
        if !lines.any(|(_, l)| l.trim_start() == INCLUDE_END) {
            problems.push(format!("{here}: no `{INCLUDE_END}` after the marker"));
            break;
        }
        if anchor.is_some_and(|a| a.parse::<usize>().is_ok()) {
            problems.push(format!("{here}: name an anchor, not line numbers"));
            continue;
        }
        let source = match std::fs::read_to_string(dir.join(file)) {
            Ok(source) => source,
            Err(e) => {
                problems.push(format!("{here}: {e}"));
                continue;
            }
        };
        let Some(code) = included(&source, anchor) else {
            problems.push(format!(
                "{here}: no `ANCHOR: {}` in {file}",
                anchor.unwrap()
            ));
            continue;
        };
        for l in code {
            if l.trim_start().starts_with(&"`".repeat(ticks)) {
                problems.push(format!(
                    "{here}: a line would end the block: open it with more backticks"
                ));
            }
            if !l.is_empty() {
                out.push_str(indent);
            }
            out.push_str(l);
            out.push('\n');
        }
        out.push_str(&format!(
            "{indent}{}\n{indent}{INCLUDE_END}\n",
            &"`".repeat(ticks)
        ));
    }
    if !text.ends_with('\n') {
        out.pop();
    }
    (out, problems)
}

/// The code that README.md and the book show is the code of the files it is taken from,
/// pasted into the page (GitHub shows no `{{#include}}`) between include markers; with
/// `REFIT_BLESS=1`, this test pastes it again.
#[test]
fn the_pages_show_the_code_of_the_files_they_include() {
    let bless = std::env::var_os("REFIT_BLESS").is_some_and(|v| v == "1");
    let mut pages = vec![root().join("README.md")];
    files(&root().join("book/src"), &[".md"], &mut pages);
    pages.sort();
    let mut markers = 0;
    let (mut problems, mut stale) = (Vec::new(), Vec::new());
    for path in &pages {
        let name = path.strip_prefix(root()).unwrap().display().to_string();
        let text = read(path);
        markers += text
            .lines()
            .filter(|l| l.trim_start().starts_with(INCLUDE))
            .count();
        let (expected, mut found) = with_includes(&name, &text, path.parent().unwrap());
        if !found.is_empty() {
            // nothing is written over a page whose markers cannot be read
            problems.append(&mut found);
            continue;
        }
        if expected == text {
            continue;
        }
        if bless {
            std::fs::write(path, &expected).unwrap();
            eprintln!("pasted the code again into {name}");
            continue;
        }
        // the first line that differs, and the marker above it
        let (page_lines, file_lines): (Vec<_>, Vec<_>) =
            (text.lines().collect(), expected.lines().collect());
        let n = (0..page_lines.len().max(file_lines.len()))
            .find(|&i| page_lines.get(i) != file_lines.get(i))
            .unwrap_or(0);
        let marker = (0..n.min(page_lines.len()))
            .rev()
            .find(|&i| page_lines[i].trim_start().starts_with(INCLUDE))
            .map_or("(no marker)".to_owned(), |i| {
                format!("`{}` (line {})", page_lines[i].trim(), i + 1)
            });
        stale.push(format!(
            "{name}:{}: the code under {marker} is not its file's now:\n    page: {:?}\n    \
             file: {:?}",
            n + 1,
            page_lines.get(n).unwrap_or(&"(end)"),
            file_lines.get(n).unwrap_or(&"(end)"),
        ));
    }
    assert!(markers > 100, "{markers} include markers");
    assert!(problems.is_empty(), "{problems:#?}");
    assert!(
        stale.is_empty(),
        "{stale:#?}\npaste the code again: REFIT_BLESS=1 cargo test --test reference_pages"
    );
}

/// What mdBook 0.5.4 printed for these includes of this file (`{{#include f.rs}}`,
/// `{{#include f.rs:foo}}`, `{{#include f.rs:bar}}`).
#[test]
fn the_include_markers_read_anchors_as_mdbook_does() {
    let text = "l1\n  // ANCHOR: foo\n  l3\n  // ANCHOR: bar\n  l5\n  // ANCHOR_END: bar\n  \
                l7\n// ANCHOR_END: foo\nl9\n\n";
    assert_eq!(
        included(text, None).unwrap(),
        text.lines().collect::<Vec<_>>()
    );
    assert_eq!(
        included(text, Some("foo")).unwrap(),
        ["  l3", "  l5", "  l7"]
    );
    assert_eq!(included(text, Some("bar")).unwrap(), ["  l5"]);
    assert_eq!(included(text, Some("fo")), None);
    assert_eq!(anchor_name("# ANCHOR:links", "ANCHOR:"), Some("links"));
    assert_eq!(anchor_name("x ANCHOR: a-b_c1 y", "ANCHOR:"), Some("a-b_c1"));
    assert_eq!(anchor_name("// ANCHOR_END: foo", "ANCHOR:"), None);

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f.rs"), text).unwrap();
    let page = "- item\n\n  <!-- include: f.rs:foo -->\n  ```rust\n  stale\n  ```\n  \
                <!-- /include -->\n";
    let (expected, problems) = with_includes("page.md", page, dir.path());
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(
        expected,
        "- item\n\n  <!-- include: f.rs:foo -->\n  ```rust\n    l3\n    l5\n    l7\n  ```\n  \
         <!-- /include -->\n"
    );
    let (_, problems) = with_includes(
        "page.md",
        "<!-- include: f.rs:nope -->\n```\n```\n<!-- /include -->\n",
        dir.path(),
    );
    assert!(problems[0].contains("no `ANCHOR: nope`"), "{problems:?}");
    let (_, problems) = with_includes("page.md", "```\n{{#include f.rs}}\n```\n", dir.path());
    assert!(
        problems[0].contains("shows as that line on GitHub"),
        "{problems:?}"
    );
}
