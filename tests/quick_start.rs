//! Runs the `quick_start` example (the book's first program, built with no optional
//! feature) and checks that the engine applied every version the trainer published.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::Command;

mod common;
use common::example;

#[test]
fn quick_start_delivers_every_version_to_the_engine() {
    let out = Command::new(example("quick_start")).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("engine: serving version 1"), "{stdout}");
    for v in 2..=3 {
        for line in [
            format!("engine: applied version {v} (fc.bias = {v})"),
            format!("trainer: version {v} applied by the engine"),
        ] {
            assert!(stdout.contains(&line), "missing {line:?} in\n{stdout}");
        }
    }
    assert!(
        stdout.contains("engine: trainer gone, still serving version 3"),
        "{stdout}"
    );
}

/// The fenced blocks of `page` whose info string starts with `lang`: the code is pasted into
/// the page (`tests/reference_pages.rs` checks that it is its file's).
fn blocks(page: &str, lang: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    for line in page.lines() {
        match (&mut current, line.strip_prefix("```")) {
            (None, Some(info)) if info.starts_with(lang) => current = Some(String::new()),
            (Some(_), Some("")) => out.extend(current.take()),
            (Some(block), _) => {
                block.push_str(line);
                block.push('\n');
            }
            _ => {}
        }
    }
    out
}

/// The `[profile.*]` tables of a `Cargo.toml`.
fn profiles(manifest: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in manifest.lines() {
        if line.starts_with('[') {
            inside = line.starts_with("[profile.");
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The quick start page's `Cargo.toml` lines and its program, put into a new crate outside
/// this workspace (the path of its `refit` dependency pointed at this checkout), compile:
/// the program needs nothing but `refit` with no default features. Offline, with this
/// workspace's lockfile, target folder and profiles, so the dependencies are those the
/// lean build's `cargo clippy -p refit --no-default-features` already checked and only
/// Refit's own crates are checked again.
#[test]
fn the_quick_start_page_compiles_as_a_fresh_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(root.join("book/src/quick-start.md")).unwrap();
    let [dependency] = &blocks(&page, "toml")[..] else {
        panic!("the quick start should show one Cargo.toml block");
    };
    let [program] = &blocks(&page, "rust")[..] else {
        panic!("the quick start should show one program");
    };
    assert!(program.contains("fn main()"), "{program}");
    let checkout = format!("{:?}", root.display().to_string());
    let dependency = dependency.replace("\"../refit\"", &checkout);
    assert!(
        dependency.contains(&checkout),
        "the page's dependency should be `path = \"../refit\"`: {dependency}"
    );

    let dir = tempfile::tempdir().unwrap();
    let workspace = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    std::fs::write(
        dir.path().join("Cargo.toml"),
        format!(
            "[package]\nname = \"my-trainer\"\nversion = \"0.1.0\"\nedition = \"2024\"\n\n\
             {dependency}\n[workspace]\n\n{}",
            profiles(&workspace)
        ),
    )
    .unwrap();
    std::fs::create_dir(dir.path().join("src")).unwrap();
    std::fs::write(dir.path().join("src/main.rs"), program).unwrap();
    std::fs::copy(root.join("Cargo.lock"), dir.path().join("Cargo.lock")).unwrap();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["check", "--offline", "--quiet", "--message-format", "short"])
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the quick start does not compile in a fresh crate:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
