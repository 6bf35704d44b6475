//! A training topology spread over processes and hosts (in progress): the weight links
//! per transport and the rendezvous of the ranks.

pub mod links;
pub mod rendezvous;
