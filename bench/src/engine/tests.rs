#![allow(clippy::unwrap_used)]

use super::*;

/// A small model over the in-process and shared-memory links in every pause mode: every
/// timed update loaded the next version while requests were decoding, and each figure is
/// there once per update (the bench itself refuses a load of another version, or one asked
/// with nothing decoding).
#[test]
fn every_link_and_mode_gets_its_updates_with_requests_in_flight() {
    let cfg = PauseBenchConfig {
        sizes: vec![256 << 10],
        links: vec!["inproc".into(), "shm".into()],
        modes: vec![PauseMode::Keep, PauseMode::Abort, PauseMode::Wait],
        updates: 3,
        warmup: 1,
        requests: 3,
        max_tokens: 8,
        threads: 1,
    };
    let mut heard = Vec::new();
    let out = run(&cfg, &mut |line| heard.push(line.to_owned())).unwrap();
    assert_eq!(out.len(), 1);
    let size = &out[0];
    assert!(size.wire_bytes >= 256 << 10, "{}", size.wire_bytes);
    // bf16 on the wire, f32 at the trainer (fused q/k/v keeps the count)
    let params = size.config.params();
    assert!(size.wire_bytes >= 2 * params && size.trainer_bytes >= 4 * params);
    assert!(size.wire_bytes < size.trainer_bytes, "{size:?}");
    assert_eq!((size.memcpy.len(), size.memcpy_split.len()), (3, 3));
    assert_eq!(size.transports.len(), 2);
    for t in &size.transports {
        assert_eq!((t.publish.len(), t.fetch.len(), t.moved().len()), (3, 3, 3));
    }
    assert_eq!(size.engines.len(), 6);
    for e in &size.engines {
        assert_eq!(e.updates.len(), 3, "{} {}", e.link, e.mode);
        let versions = e.each(|u| u.version.get());
        assert!(
            versions.windows(2).all(|w| w[1] == w[0] + 1),
            "{versions:?}"
        );
        for u in &e.updates {
            assert!(u.running >= 1, "{u:?}");
            // nested intervals: the swap and the staging happen inside the load
            assert!(u.paused <= u.load && u.staged <= u.load, "{u:?}");
            assert!(u.convert <= u.publish, "{u:?}");
        }
        assert!(
            e.completed > 0,
            "{} {}: no request completed",
            e.link,
            e.mode
        );
    }
    assert!(heard.iter().any(|l| l.contains("inproc")), "{heard:?}");
}

#[test]
fn bad_configurations_are_refused_naming_the_field() {
    let e = PauseBenchConfig {
        updates: 0,
        ..PauseBenchConfig::default()
    }
    .check()
    .unwrap_err();
    assert!(e.to_string().contains("updates"), "{e}");
    let e = PauseBenchConfig {
        max_tokens: 200,
        ..PauseBenchConfig::default()
    }
    .check()
    .unwrap_err();
    assert!(e.to_string().contains("max_tokens"), "{e}");
    let e = PauseBenchConfig {
        links: vec![],
        ..PauseBenchConfig::default()
    }
    .check()
    .unwrap_err();
    assert!(e.to_string().contains("links"), "{e}");
}
