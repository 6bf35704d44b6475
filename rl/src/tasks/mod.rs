//! Token tasks with verifiable rewards, written in a small synthetic vocabulary (no
//! tokenizer download): [`ReverseDigits`] reverses a string of digits, with per-position
//! credit.

pub mod reverse;
pub mod vocab;

pub use reverse::{ReverseConfig, ReverseDigits};
