//! `--metrics-addr`: the update phase timings served as a Prometheus page (the facade's
//! [`refit::metrics_page`], shared with programs that `refit launch` starts).

pub(crate) use refit::metrics_page::serve;
