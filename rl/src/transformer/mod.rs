//! A GPT-style transformer in two forms: the trainer's ([`Transformer`], candle variables in
//! `f32` with separate `q`, `k`, `v` projections and autograd) and the generator's
//! ([`TransformerGenerator`], a [`Generator`](crate::Generator) serving fused `qkv` in
//! `bf16` with a KV cache per sequence and continuous batching). The trainer's exports reach
//! the generator through refit's conversions ([`TransformerConfig::want`]: layout rules,
//! then cast rules), the same path a trainer takes to an inference engine of another layout.

pub mod config;
mod ops;
pub mod serve;
pub mod train;

pub use config::TransformerConfig;
pub use serve::{KvCache, ServingWeights, TransformerGenerator};
pub use train::{Grad, Transformer};

#[cfg(test)]
mod tests;
