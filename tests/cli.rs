//! The `refit` tool as a user runs it (real processes, real sockets on loopback): the
//! cluster token comes only from the environment or an owner-only file, printed specs hold
//! no token, an unspecified bind address needs `--advertise`, and `serve --watch` publishes
//! a file replaced on disk.
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use refit::prelude::*;
use refit::transports::tcp::TcpEndpoint;

const TOKEN: &str = "cli-test-token-0123456789abcdef";

/// The `refit` binary with no token in its environment.
fn refit() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_refit"));
    c.env_remove("REFIT_TOKEN").env_remove("REFIT_TOKEN_FILE");
    c
}

/// A spec in `refit serve`'s form whose sender is gone (port 9 of loopback, where nothing
/// listens): the inputs of a pull are good, so it gets as far as the token and the connect.
fn dead_spec() -> String {
    let node = refit::node::Node::loopback(refit::node::ClusterToken::random()).unwrap();
    let endpoint = TcpEndpoint {
        addr: "127.0.0.1:9".parse().unwrap(),
        agent: node.id(),
    };
    node.shutdown();
    refit::runtime::wire::to_token(&endpoint).unwrap()
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A one-tensor model (`w`, 256 f32 all equal to `value`) written as safetensors.
fn write_model(path: &Path, value: f32) {
    let manifest = Manifest::builder()
        .tensor("w", DType::F32, &[256])
        .build()
        .unwrap();
    let mut ws = WeightSet::zeroed(ModelId::new("policy").unwrap(), Arc::new(manifest));
    ws.view_mut::<f32>("w").unwrap().fill(value);
    ws.write_safetensors(path).unwrap();
}

fn model_value(path: &Path) -> f32 {
    let ws = WeightSet::read_safetensors(path, Some(&ModelId::new("policy").unwrap())).unwrap();
    ws.view::<f32>("w").unwrap()[0]
}

fn write_with_mode(path: &Path, content: &str, mode: u32) {
    std::fs::write(path, content).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_token_file_others_can_read_is_refused_by_name_and_mode() {
    let dir = tempfile::tempdir().unwrap();
    let (model, token) = (dir.path().join("m.safetensors"), dir.path().join("token"));
    write_model(&model, 1.0);
    for mode in [0o644, 0o640, 0o604] {
        write_with_mode(&token, TOKEN, mode);
        let serve = refit()
            .arg("serve")
            .arg(&model)
            .arg("--token-file")
            .arg(&token)
            .args(["--for-s", "1"])
            .output()
            .unwrap();
        let pull = refit()
            .args([
                "pull",
                "out.safetensors",
                "--timeout-s",
                "2",
                "--spec",
                &dead_spec(),
            ])
            .env("REFIT_TOKEN_FILE", &token)
            .current_dir(dir.path())
            .output()
            .unwrap();
        for out in [serve, pull] {
            let (stdout, stderr) = text(&out);
            assert!(!out.status.success(), "mode {mode:o}: {stdout}{stderr}");
            assert!(
                stderr.contains(&token.display().to_string()),
                "mode {mode:o}: {stderr}"
            );
            assert!(stderr.contains(&format!("{mode:04o}")), "{stderr}");
            assert!(!stdout.contains(TOKEN) && !stderr.contains(TOKEN));
        }
    }
}

#[test]
fn without_a_token_serve_and_pull_say_where_to_put_one() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.safetensors");
    write_model(&model, 1.0);
    let serve = refit()
        .arg("serve")
        .arg(&model)
        .args(["--for-s", "1"])
        .output()
        .unwrap();
    let pull = refit()
        .args(["pull", "out.safetensors", "--spec", &dead_spec()])
        .current_dir(dir.path())
        .output()
        .unwrap();
    for out in [serve, pull] {
        let (_, stderr) = text(&out);
        assert!(!out.status.success());
        assert!(
            stderr.contains("no cluster token")
                && stderr.contains("REFIT_TOKEN")
                && stderr.contains("--token-file"),
            "{stderr}"
        );
    }
    // a token on the command line is not an option
    let out = refit()
        .args(["pull", "out.safetensors", "--spec", "00", "--token", TOKEN])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[test]
fn refit_token_writes_an_owner_only_file_and_never_overwrites() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cluster.token");
    let out = refit().arg("token").arg(&path).output().unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let token = std::fs::read_to_string(&path).unwrap();
    assert!(token.trim().len() >= 16);
    let (stdout, stderr) = text(&out);
    assert!(!stdout.contains(token.trim()) && !stderr.contains(token.trim()));
    let again = refit().arg("token").arg(&path).output().unwrap();
    assert!(!again.status.success());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), token);
}

#[test]
fn serving_an_unspecified_address_needs_advertise() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.safetensors");
    write_model(&model, 1.0);
    let out = refit()
        .arg("serve")
        .arg(&model)
        .args(["--bind", "0.0.0.0:0", "--for-s", "1"])
        .env("REFIT_TOKEN", TOKEN)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(
        stderr.contains("--advertise") && stderr.contains("0.0.0.0:0"),
        "{stderr}"
    );
    assert!(!stdout.contains("spec:"), "{stdout}");
}

/// Pulls with the token from the environment into `out`; the pull's output.
fn pull(dir: &Path, spec_args: &[&str], env: (&str, &str), out: &str) -> Output {
    refit()
        .arg("pull")
        .arg(out)
        .args(spec_args)
        .args(["--timeout-s", "60"])
        .env(env.0, env.1)
        .current_dir(dir)
        .output()
        .unwrap()
}

#[test]
fn serve_prints_no_token_pull_brings_its_own_and_watch_publishes_a_replaced_file() {
    let dir = tempfile::tempdir().unwrap();
    let (model, token_file) = (dir.path().join("m.safetensors"), dir.path().join("token"));
    write_model(&model, 1.0);
    write_with_mode(&token_file, &format!("{TOKEN}\n"), 0o600);
    let mut serve = refit()
        .arg("serve")
        .arg(&model)
        .arg("--token-file")
        .arg(&token_file)
        .args(["--spec-file", "spec.txt", "--watch", "--for-s", "120"])
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stdout = serve.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let spec_line = rx.recv_timeout(Duration::from_secs(60));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let spec_line = spec_line.unwrap();
        let spec = spec_line.strip_prefix("spec: ").unwrap().trim().to_owned();
        for shown in [
            &spec,
            &std::fs::read_to_string(dir.path().join("spec.txt")).unwrap(),
        ] {
            assert!(
                !shown.contains(TOKEN) && !shown.contains(&hex(TOKEN)),
                "{shown}"
            );
        }
        let endpoint: TcpEndpoint = refit::runtime::wire::from_token(&spec).unwrap();
        assert!(endpoint.addr.ip().is_loopback());

        // the token from the environment
        let out = pull(
            dir.path(),
            &["--spec", &spec],
            ("REFIT_TOKEN", TOKEN),
            "a.st",
        );
        assert!(out.status.success(), "{:?}", text(&out));
        assert_eq!(model_value(&dir.path().join("a.st")), 1.0);

        // a wrong token is refused, and nothing is written
        let wrong = "another-token-0123456789abcdef";
        let out = pull(
            dir.path(),
            &["--spec", &spec],
            ("REFIT_TOKEN", wrong),
            "b.st",
        );
        assert!(!out.status.success(), "{:?}", text(&out));
        assert!(!dir.path().join("b.st").exists());

        // a new file replaces the served one (written aside, renamed into place)
        let next = dir.path().join("next.tmp");
        write_model(&next, 2.0);
        std::fs::rename(&next, &model).unwrap();
        let token_path = token_file.to_str().unwrap();
        let t = Instant::now();
        loop {
            let out = pull(
                dir.path(),
                &["--spec-file", "spec.txt"],
                ("REFIT_TOKEN_FILE", token_path),
                "c.st",
            );
            assert!(out.status.success(), "{:?}", text(&out));
            if model_value(&dir.path().join("c.st")) == 2.0 {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "version 2 not served within 60 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }));
    serve.kill().unwrap();
    let out = serve.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let rest: Vec<String> = rx.try_iter().collect();
    if let Err(e) = result {
        panic!("{e:?}\nserve's stderr:\n{stderr}");
    }
    assert!(stderr.contains("published version 2"), "{stderr}");
    assert!(!stderr.contains(TOKEN), "{stderr}");
    assert!(rest.iter().all(|l| !l.contains(TOKEN)), "{rest:?}");
}

/// A port on loopback held by this test: a program that tried to serve there would fail.
fn held_port() -> (std::net::TcpListener, String) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (l, addr)
}

#[test]
fn version_and_help_start_no_metrics_page_whatever_the_environment_says() {
    // the address is taken: serving it would fail the command
    let (_held, addr) = held_port();
    for args in [&["--version"][..], &["--help"], &["serve", "--help"]] {
        let out = refit()
            .args(args)
            .env("REFIT_METRICS_ADDR", &addr)
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{args:?}: {stdout}{stderr}");
        assert!(!stderr.contains("metrics") && !stdout.contains("metrics: http"));
    }
    let out = refit()
        .arg("--version")
        .env("REFIT_METRICS_ADDR", &addr)
        .output()
        .unwrap();
    assert_eq!(
        text(&out).0.trim(),
        format!("refit {}", env!("CARGO_PKG_VERSION"))
    );
}

/// `refit serve` for one second over shared memory (no token needed); its stdout.
fn serve_briefly(model: &Path, args: &[&str], env: &[(&str, &str)]) -> (String, String) {
    let mut c = refit();
    c.arg("serve")
        .arg(model)
        .args(["--link", "shm", "--for-s", "1"])
        .args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{args:?} {env:?}: {stdout}{stderr}");
    (stdout, stderr)
}

#[test]
fn serve_metrics_addr_comes_from_the_flag_before_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.safetensors");
    write_model(&model, 1.0);
    let (_held, taken) = held_port();
    // the flag wins over the variable (which names a taken port)
    let (stdout, _) = serve_briefly(
        &model,
        &["--metrics-addr", "127.0.0.1:0"],
        &[("REFIT_METRICS_ADDR", &taken)],
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("metrics: http://127.0.0.1:"))
        .unwrap_or_else(|| panic!("no metrics line in {stdout}"));
    assert!(!line.contains(&taken), "{line}");
    // the variable alone is the flag's default
    let (free_l, free) = held_port();
    drop(free_l);
    let (stdout, _) = serve_briefly(&model, &[], &[("REFIT_METRICS_ADDR", &free)]);
    assert!(
        stdout.contains(&format!("metrics: http://{free}/metrics")),
        "{stdout}"
    );
    // neither: no page
    let (stdout, _) = serve_briefly(&model, &[], &[]);
    assert!(!stdout.contains("metrics:"), "{stdout}");
}

#[test]
fn help_names_each_flags_variable_and_hides_its_value() {
    let secret_path = "/a/path/that/must/not/show";
    for (command, vars) in [
        ("serve", &["REFIT_TOKEN_FILE", "REFIT_METRICS_ADDR"][..]),
        ("pull", &["REFIT_TOKEN_FILE"]),
        ("node", &["REFIT_TOKEN_FILE"]),
        ("launch", &["REFIT_METRICS_ADDR"]),
    ] {
        let out = refit()
            .args([command, "--help"])
            .env("REFIT_TOKEN_FILE", secret_path)
            .env("REFIT_METRICS_ADDR", "127.0.0.1:9")
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{command}: {stderr}");
        for var in vars {
            assert!(
                stdout.contains(&format!("[env: {var}]")),
                "{command} --help does not name {var}:\n{stdout}"
            );
        }
        assert!(
            !stdout.contains(secret_path) && !stdout.contains("127.0.0.1:9"),
            "{stdout}"
        );
    }
}

#[test]
fn a_token_file_from_the_environment_beside_a_token_is_refused_and_the_flag_wins() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    write_with_mode(&token_file, TOKEN, 0o600);
    let spec = dead_spec();
    // both variables: refused, naming both
    let out = refit()
        .args(["pull", "out.st", "--timeout-s", "2", "--spec", &spec])
        .env("REFIT_TOKEN", TOKEN)
        .env("REFIT_TOKEN_FILE", &token_file)
        .current_dir(dir.path())
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("both REFIT_TOKEN and REFIT_TOKEN_FILE are set"),
        "{stderr}"
    );
    // --token-file wins over REFIT_TOKEN: the pull gets as far as the connect
    let out = refit()
        .args([
            "pull",
            "out.st",
            "--timeout-s",
            "2",
            "--spec",
            &spec,
            "--token-file",
        ])
        .arg(&token_file)
        .env("REFIT_TOKEN", "not-this-one-0123456789abcdef")
        .current_dir(dir.path())
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        !stderr.contains("both REFIT_TOKEN") && !stderr.contains("cluster token"),
        "{stderr}"
    );
}

#[test]
fn pull_without_a_spec_names_every_way_to_give_one() {
    let out = refit()
        .args(["pull", "out.safetensors"])
        .env("REFIT_TOKEN", TOKEN)
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--spec <SPEC>") && stderr.contains("--spec-file <FILE>"),
        "{stderr}"
    );
    // and both at once are refused
    let out = refit()
        .args([
            "pull",
            "out.safetensors",
            "--spec",
            "00",
            "--spec-file",
            "f",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// Runs `refit` with stdout and stderr on a new pseudo-terminal; what it wrote there.
fn on_a_terminal(args: &[&str], env: &[(&str, &str)]) -> String {
    use std::io::Read;
    use std::os::fd::{FromRawFd, OwnedFd};
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty writes two new descriptors into `master` and `slave`; the name,
    // termios and window size pointers may be null.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just opened by openpty and nothing else owns them.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let mut c = refit();
    c.args(args)
        .env_remove("NO_COLOR")
        .env_remove("CLICOLOR_FORCE")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::from(slave.try_clone().unwrap()))
        .stderr(Stdio::from(slave));
    for (k, v) in env {
        c.env(k, v);
    }
    let mut child = c.spawn().unwrap();
    drop(c); // this process's copies of the terminal's end: EOF once the child exits
    let mut terminal = std::fs::File::from(master);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        // the master reads EIO once every writer is gone
        while let Ok(n @ 1..) = terminal.read(&mut buf) {
            out.extend_from_slice(&buf[..n]);
        }
        let _ = tx.send(out);
    });
    let out = rx.recv_timeout(Duration::from_secs(60)).unwrap();
    child.wait().unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn no_color_turns_colour_off_on_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.safetensors");
    write_model(&model, 1.0);
    let model = model.to_str().unwrap();
    // help (clap), and log lines (tracing): the node's debug line as `serve` starts
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);
    let cases: [Case; 2] = [
        (&["--help"], &[]),
        (
            &["serve", model, "--for-s", "1"],
            &[("RUST_LOG", "refit_node=debug"), ("REFIT_TOKEN", TOKEN)],
        ),
    ];
    for (args, env) in cases {
        let coloured = on_a_terminal(args, env);
        assert!(
            coloured.contains('\x1b'),
            "{args:?} not coloured:\n{coloured}"
        );
        let mut env = env.to_vec();
        env.push(("NO_COLOR", "1"));
        let plain = on_a_terminal(args, &env);
        assert!(!plain.contains('\x1b'), "{args:?} with NO_COLOR:\n{plain}");
        let expected = if args[0] == "serve" {
            "node listening"
        } else {
            "Usage:"
        };
        assert!(plain.contains(expected), "{args:?}:\n{plain}");
    }
}

/// `refit probe` names every link of the factory and whether this process can open it; the
/// GPU links give their reason (not compiled with CUDA and how to build, or the probe's).
/// Without a usable GPU it ends with the probe's error.
#[test]
fn probe_says_which_links_this_build_and_machine_can_open() {
    let out = refit().arg("probe").output().unwrap();
    let (stdout, stderr) = text(&out);
    for l in refit::transports::link::LINKS {
        assert!(
            stdout.contains(&format!("link {}: ", l.name())),
            "{}: {stdout}",
            l.name()
        );
    }
    assert!(stdout.contains("link shm: usable (one host)"), "{stdout}");
    match refit::transports::gpu::probe() {
        Ok(_) => assert!(out.status.success(), "{stderr}"),
        Err(e) => {
            assert!(!out.status.success());
            assert!(stderr.contains(&e.to_string()), "{stderr}");
            for name in ["nccl", "cuda-ipc"] {
                let line = stdout
                    .lines()
                    .find(|l| l.starts_with(&format!("link {name}: not usable: ")))
                    .unwrap_or_else(|| panic!("no refusal for {name}: {stdout}"));
                if cfg!(feature = "cuda") {
                    assert!(line.contains("no usable GPU"), "{line}");
                } else {
                    assert!(
                        line.contains("not compiled with CUDA") && line.contains("--features cuda"),
                        "{line}"
                    );
                }
            }
        }
    }
}
